"""Aggregation rules: how the server combines the sampled clients' parameters into one point.

Every rule maps the K x P matrix X (one flattened client per row, float64) and the
clients' aggregation weights w (K,) to a P vector. The FedAvg family (fedavg, fedavgm,
fedadagrad, fedadam, fedyogi, fedprox) takes its aggregation step from its ``rule``
(``[aggregation]``, :mod:`fedloom.algorithms.aggregation_rule`), so a robust rule composes
with any server optimizer: the pseudo-gradient of FedAdam with ``aggregation.rule =
"median"`` is median - x_t.

* ``mean``          sum_k w_k X_k / sum_k w_k                                 (McMahan et al. 2017)
* ``median``        coordinate-wise median of the rows; with K even, the mean of the two
                    middle values (numpy's convention). Unweighted.        (Yin et al. 2018)
* ``trimmed_mean``  per coordinate, drop the b = floor(beta K) smallest and b largest
                    values and average the K - 2b left. Unweighted.        (Yin et al. 2018)
* ``krum``          score_i = sum of ||X_i - X_j||^2 over the n_c = max(1, K - f - 2)
                    rows j != i closest to X_i; keep the row with the lowest score.
                    f = ``num_malicious_nodes``.                     (Blanchard et al. 2017)
* ``multikrum``     keep the m = ``num_nodes_to_select`` lowest-score rows and take their
                    weighted mean. Blanchard et al. average them uniformly; Flower (and
                    fedloom by default) weights them by examples: ``weighting = "uniform"``
                    gives the paper's rule.
* ``bulyan``        select theta = K - 2f rows by Krum iterated (pick the lowest-score row,
                    remove it, score the rest again, theta times), then per coordinate
                    average the beta = theta - 2f selected values closest to the selected
                    rows' median. Unweighted; needs K >= 4f + 3. With Flower's default
                    f = 0 it is the plain unweighted mean.
                                                (El Mhamdi, Guerraoui, Rouault 2018)
* ``norm_bounding`` x_t + sum_k w_k clip(X_k - x_t, M) / sum_k w_k, with
                    clip(d, r) = d min(1, r / ||d||) and M = ``max_norm``; unset, M is the
                    median of the round's K update norms.            (Sun et al. 2019)
* ``centered_clipping``  with v_0 = the previous round's aggregate update (0 at first),
                    v_{l+1} = v_l + (1/K) sum_k clip(X_k - x_t - v_l, tau), l < L, and
                    x_t + v_L; tau = ``clip_radius`` (unset: the median of the K distances
                    ||X_k - x_t - v_l||), L = ``clip_iterations`` (1). Unweighted.
                                                (Karimireddy, He, Jaggi 2021)
* ``fltrust``       with g_0 the server's own update (its training of x_t on a clean root
                    set), TS_k = ReLU(cos(X_k - x_t, g_0)) and each update rescaled to
                    ||g_0||: x_t + sum_k TS_k (||g_0|| / ||X_k - x_t||) (X_k - x_t) / sum_k
                    TS_k, and x_t when every TS_k is 0. Unweighted.
                                                (Cao, Fang, Liu, Gong 2021)

x_t is the reference point: the global parameters the clients started from. The last three
rules act on the updates X_k - x_t and so need it; centered clipping also needs its state,
the last aggregate update, which the algorithm keeps in ``ServerState.extra``
(:meth:`fedloom.algorithms.fedavg.FedAvg.combine_flat`), and FLTrust the round's server
update g_0, which the runtime computes (:mod:`fedloom.runtime.root_update`).

Median, trimmed mean and Bulyan are translation-equivariant and Krum's distances
translation-invariant, so applying them to parameters or to updates X_k - x_t gives the
same point; clipping and FLTrust's cosines are not, hence the reference point.
These rules match Flower's ``FedMedian``, ``FedTrimmedAvg``, ``Krum`` and ``MultiKrum``
(which, like here, do not check Krum's condition K > 2f + 2). ``bulyan`` matches Flower's
``flwr.server.strategy.aggregate.aggregate_bulyan`` with Krum, which iterates Krum as the
paper does; the newer ``flwr.serverapp.strategy.Bulyan`` instead selects its theta rows by
one Multi-Krum scoring of all K rows (no re-scoring after each pick), so it can select
differently.

Where fedloom departs from the papers: Sun et al. and Karimireddy et al. fix M and tau by
hand; fedloom's defaults, the round's median norm (distance), are its own (a fixed radius
means nothing across models and learning rates, and the median is set by the honest
clients while they are the majority); a fixed ``max_norm`` / ``clip_radius`` gives the
papers' rules. Karimireddy et al. apply centered clipping every step to the workers'
momenta, fedloom once a round to the clients' round updates, with v carried from round
to round; their guarantee against attacks spread over time rests on that worker momentum,
which round updates do not have. Cao et al. take the root set as data the service
provider collects; fedloom carves it from the task's training data before the
partition (``aggregation.root_examples``, 100 as in the paper), so no client holds a root
example. Their server update is plain SGD on the root set with the clients' local
hyperparameters; fedloom's is the algorithm's own local training (its optimizer, steps,
proximal terms), the server taking part in every round as one more client whose local
state it keeps. Their global learning rate α is the algorithm's own server step (1 for
FedAvg, the server learning rate of FedAvgM or FedAdam).
"""

from __future__ import annotations

from typing import get_args

import torch

from fedloom.config import RuleName

AGGREGATORS: tuple[RuleName, ...] = get_args(RuleName)
#: the rules that act on the updates X_k - x_t, so need the reference point x_t
ON_UPDATES = ("norm_bounding", "centered_clipping", "fltrust")
#: Flower's defaults: FedTrimmedAvg(beta=0.2), Krum/MultiKrum(num_malicious_nodes=0,
#: num_nodes_to_select=1)
DEFAULT_BETA = 0.2
DEFAULT_MALICIOUS = 0
DEFAULT_SELECT = 1
#: Karimireddy et al.'s experiments run one clipping iteration per aggregation
DEFAULT_CLIP_ITERATIONS = 1


def mean(matrix: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights / weights.sum()) @ matrix


def median(matrix: torch.Tensor) -> torch.Tensor:
    ordered = matrix.sort(dim=0).values
    k = matrix.shape[0]
    return 0.5 * (ordered[(k - 1) // 2] + ordered[k // 2])


def trimmed_mean(matrix: torch.Tensor, beta: float) -> torch.Tensor:
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean: beta must be in [0, 0.5) (got {beta})")
    k = matrix.shape[0]
    cut = int(beta * k)  # the same rounding as scipy's / Flower's trim_mean
    return matrix.sort(dim=0).values[cut : k - cut].mean(dim=0)


def squared_distances(matrix: torch.Tensor) -> torch.Tensor:
    """K x K squared L2 distances between the rows, +inf on the diagonal."""
    distances = torch.cdist(matrix, matrix).square()
    return distances.fill_diagonal_(float("inf"))


def neighbour_scores(distances: torch.Tensor, num_malicious_nodes: int) -> torch.Tensor:
    """Krum's score of each row from its K x K squared ``distances`` (+inf diagonal)."""
    k = distances.shape[0]
    closest = min(max(1, k - num_malicious_nodes - 2), k - 1)
    if closest == 0:
        return torch.zeros(k, dtype=distances.dtype)
    return distances.topk(closest, dim=1, largest=False).values.sum(dim=1)


def krum_scores(matrix: torch.Tensor, num_malicious_nodes: int) -> torch.Tensor:
    """Sum of squared distances from each row to its max(1, K - f - 2) nearest other rows."""
    return neighbour_scores(squared_distances(matrix), num_malicious_nodes)


def multikrum(
    matrix: torch.Tensor, weights: torch.Tensor, num_malicious_nodes: int, num_nodes_to_select: int
) -> torch.Tensor:
    scores = krum_scores(matrix, num_malicious_nodes)
    chosen = torch.argsort(scores, stable=True)[:num_nodes_to_select]
    return mean(matrix[chosen], weights[chosen])


def iterated_krum(matrix: torch.Tensor, num_malicious_nodes: int, count: int) -> torch.Tensor:
    """Indices of ``count`` rows chosen by Krum one at a time: each pick is the lowest
    Krum score among the rows left (the first on ties), scored among those rows only."""
    distances = squared_distances(matrix)
    left = torch.arange(matrix.shape[0])
    chosen = []
    for _ in range(count):
        best = int(neighbour_scores(distances[left][:, left], num_malicious_nodes).argmin())
        chosen.append(left[best])
        left = torch.cat([left[:best], left[best + 1 :]])
    return torch.stack(chosen)


def closest_to_median(matrix: torch.Tensor, count: int) -> torch.Tensor:
    """Per coordinate, the mean of the ``count`` values closest to the rows' median."""
    distance = (matrix - median(matrix)).abs()
    nearest = distance.argsort(dim=0, stable=True)[:count]
    return matrix.gather(0, nearest).mean(dim=0)


def bulyan(matrix: torch.Tensor, num_malicious_nodes: int) -> torch.Tensor:
    f = num_malicious_nodes
    k = matrix.shape[0]
    if k < 4 * f + 3:
        raise ValueError(f"bulyan: needs K >= 4f + 3 = {4 * f + 3} rows (got {k})")
    selected = matrix[iterated_krum(matrix, f, k - 2 * f)]
    return closest_to_median(selected, k - 4 * f)


def clip_rows(rows: torch.Tensor, radius: torch.Tensor | float) -> torch.Tensor:
    """Each row scaled down to L2 norm ``radius`` where it is longer: d min(1, r / ||d||)."""
    norms = rows.norm(dim=1, keepdim=True)
    return rows * torch.where(norms > radius, radius / norms, 1.0)


def median_norm(rows: torch.Tensor) -> torch.Tensor:
    """The median of the rows' L2 norms (the mean of the middle two for an even count)."""
    return median(rows.norm(dim=1, keepdim=True))[0]


def norm_bounding(
    updates: torch.Tensor, weights: torch.Tensor, max_norm: float | None
) -> torch.Tensor:
    """The weighted mean of the updates clipped to ``max_norm`` (None: their median norm)."""
    radius = median_norm(updates) if max_norm is None else max_norm
    return mean(clip_rows(updates, radius), weights)


def centered_clipping(
    updates: torch.Tensor, start: torch.Tensor, clip_radius: float | None, iterations: int
) -> torch.Tensor:
    """v_{l+1} = v_l + mean_k clip(Delta_k - v_l, tau) from v_0 = ``start``, ``iterations``
    times; tau = ``clip_radius`` (None: the median of ||Delta_k - v_l||)."""
    v = start
    for _ in range(iterations):
        centred = updates - v
        radius = median_norm(centred) if clip_radius is None else clip_radius
        v = v + clip_rows(centred, radius).mean(dim=0)
    return v


def trust_scores(updates: torch.Tensor, root_update: torch.Tensor) -> torch.Tensor:
    """FLTrust's TS_k = ReLU(cos(Delta_k, g_0)) of each row; 0 for a zero row or a zero g_0
    (no direction to trust)."""
    norms = updates.norm(dim=1) * root_update.norm()
    cosines = (updates @ root_update) / torch.where(norms > 0, norms, 1.0)
    return cosines.clamp(min=0.0)


def fltrust(updates: torch.Tensor, root_update: torch.Tensor) -> torch.Tensor:
    """FLTrust's aggregate update (Cao, Fang, Liu, Gong, NDSS 2021, "FLTrust:
    Byzantine-robust Federated Learning via Trust Bootstrapping", Algorithm 2):
    sum_k TS_k (||g_0|| / ||Delta_k||) Delta_k / sum_k TS_k, or 0 when no TS_k is
    positive. A client that points away from g_0 gets no weight, and none can contribute
    more than ||g_0||, however long its update."""
    trust = trust_scores(updates, root_update)
    total = trust.sum()
    if total == 0:
        return torch.zeros_like(root_update)
    norms = updates.norm(dim=1)
    scale = trust * root_update.norm() / torch.where(norms > 0, norms, 1.0)
    return scale @ updates / total


def combine(
    rule: str,
    matrix: torch.Tensor,
    weights: torch.Tensor,
    beta: float | None = None,
    num_malicious_nodes: int | None = None,
    num_nodes_to_select: int | None = None,
    *,
    reference: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    max_norm: float | None = None,
    clip_radius: float | None = None,
    clip_iterations: int | None = None,
    root_update: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply ``rule`` to the K x P ``matrix``; unset hyperparameters take Flower's defaults
    (the defaults above for the rules Flower lacks). The rules of :data:`ON_UPDATES` need
    the ``reference`` point x_t (P,); ``state`` is centered clipping's v_0 (None: 0),
    ``root_update`` FLTrust's g_0 (P,)."""
    if rule in ON_UPDATES:
        return reference_rule(
            rule,
            matrix,
            weights,
            reference,
            state,
            max_norm,
            clip_radius,
            clip_iterations,
            root_update,
        )
    if rule == "mean":
        return mean(matrix, weights)
    if rule == "median":
        return median(matrix)
    if rule == "trimmed_mean":
        return trimmed_mean(matrix, DEFAULT_BETA if beta is None else beta)
    f = DEFAULT_MALICIOUS if num_malicious_nodes is None else num_malicious_nodes
    if rule == "krum":
        return multikrum(matrix, weights, f, 1)
    if rule == "multikrum":
        m = DEFAULT_SELECT if num_nodes_to_select is None else num_nodes_to_select
        return multikrum(matrix, weights, f, m)
    if rule == "bulyan":
        return bulyan(matrix, f)
    raise ValueError(f"unknown aggregator {rule!r} (known: {', '.join(AGGREGATORS)})")


def reference_rule(
    rule: str,
    matrix: torch.Tensor,
    weights: torch.Tensor,
    reference: torch.Tensor | None,
    state: torch.Tensor | None,
    max_norm: float | None,
    clip_radius: float | None,
    clip_iterations: int | None,
    root_update: torch.Tensor | None,
) -> torch.Tensor:
    """x_t plus ``rule`` applied to the updates ``matrix`` - x_t."""
    if reference is None:
        raise ValueError(f"{rule}: acts on updates, so needs the reference point x_t")
    updates = matrix - reference
    if rule == "norm_bounding":
        return reference + norm_bounding(updates, weights, max_norm)
    if rule == "fltrust":
        if root_update is None:
            raise ValueError("fltrust: needs the server's update g_0 on its root set")
        return reference + fltrust(updates, root_update)
    start = torch.zeros_like(reference) if state is None else state
    iterations = DEFAULT_CLIP_ITERATIONS if clip_iterations is None else clip_iterations
    return reference + centered_clipping(updates, start, clip_radius, iterations)

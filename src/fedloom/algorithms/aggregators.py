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

Median and trimmed mean are translation-equivariant and Krum's distances translation-
invariant, so applying them to parameters or to updates X_k - x_t gives the same point.
These rules match Flower's ``FedMedian``, ``FedTrimmedAvg``, ``Krum`` and ``MultiKrum``
(which, like here, do not check Krum's condition K > 2f + 2).
"""

from __future__ import annotations

import torch

AGGREGATORS = ("mean", "median", "trimmed_mean", "krum", "multikrum")
#: Flower's defaults: FedTrimmedAvg(beta=0.2), Krum/MultiKrum(num_malicious_nodes=0,
#: num_nodes_to_select=1)
DEFAULT_BETA = 0.2
DEFAULT_MALICIOUS = 0
DEFAULT_SELECT = 1


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


def krum_scores(matrix: torch.Tensor, num_malicious_nodes: int) -> torch.Tensor:
    """Sum of squared distances from each row to its max(1, K - f - 2) nearest other rows."""
    k = matrix.shape[0]
    distances = torch.cdist(matrix, matrix).square()
    distances.fill_diagonal_(float("inf"))
    closest = min(max(1, k - num_malicious_nodes - 2), k - 1)
    if closest == 0:
        return torch.zeros(k, dtype=matrix.dtype)
    return distances.topk(closest, dim=1, largest=False).values.sum(dim=1)


def multikrum(
    matrix: torch.Tensor, weights: torch.Tensor, num_malicious_nodes: int, num_nodes_to_select: int
) -> torch.Tensor:
    scores = krum_scores(matrix, num_malicious_nodes)
    chosen = torch.argsort(scores, stable=True)[:num_nodes_to_select]
    return mean(matrix[chosen], weights[chosen])


def combine(
    rule: str,
    matrix: torch.Tensor,
    weights: torch.Tensor,
    beta: float | None = None,
    num_malicious_nodes: int | None = None,
    num_nodes_to_select: int | None = None,
) -> torch.Tensor:
    """Apply ``rule`` to the K x P ``matrix``; unset hyperparameters take Flower's defaults."""
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
    raise ValueError(f"unknown aggregator {rule!r} (known: {', '.join(AGGREGATORS)})")

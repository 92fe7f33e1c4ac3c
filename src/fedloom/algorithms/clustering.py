"""What clustered methods (IFCA, CFL) share: several adapters travelling as one ``Params``,
a client's choice of the adapter that fits its data best, and grouping clients by their
updates.

The k cluster adapters travel in one message (:func:`fedloom.params.pack`), so a payload
stays a plain ``Params`` that every runtime (the simulator, Flower's messages) carries
unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedloom.algorithms.base import ClientContext, ClientResult
from fedloom.params import Params, stack, weighted_average


def lowest_loss(
    ctx: ClientContext, adapters: Sequence[Params], max_examples: int | None, batch_size: int
) -> tuple[int, list[float]]:
    """(ĵ, losses): the adapter with the lowest mean loss on the client's training data
    (at most ``max_examples`` of it, drawn with the round's seed); ties go to the lowest j.

    Identical adapters are not scored (every one would tie: ĵ = 0)."""
    if all_identical(adapters):
        return 0, [float("nan")] * len(adapters)
    features = list(ctx.train)
    if max_examples is not None and len(features) > max_examples:
        chosen = np.random.default_rng([ctx.seed, 0x1FCA]).choice(
            len(features), size=max_examples, replace=False
        )
        features = [features[i] for i in sorted(chosen.tolist())]
    losses = [_mean_loss(ctx, a, features, batch_size) for a in adapters]
    return int(np.argmin(losses)), losses


def _mean_loss(ctx: ClientContext, adapter: Params, features: list, batch_size: int) -> float:
    ctx.model.set_params(adapter)
    return ctx.model.mean_loss(features, batch_size)  # eval mode: no dropout


def all_identical(adapters: Sequence[Params]) -> bool:
    """Whether every adapter equals the first, tensor by tensor (e.g. clusters not yet seeded)."""
    first = adapters[0]
    return all(
        a.keys() == first.keys() and all(torch.equal(a[n], first[n]) for n in a)
        for a in adapters[1:]
    )


def check_initialization(value: str) -> None:
    """``algorithm.initialization`` of IFCA and FedEM: ``"clients"`` or ``"random"``."""
    if value not in ("clients", "random"):
        raise ValueError(f"algorithm.initialization: must be 'clients' or 'random' (got {value!r})")


def check_seeding(key: str, k: int, noun: str, initialization: str, clients_per_round: int) -> None:
    """With ``initialization = "clients"`` the k adapters (``noun``: clusters, components)
    are seeded from a k-means of the first round's updates (:func:`group_updates`), which
    forms at most one group per client: k above the clients sampled per round leaves
    adapters unseeded (equal to the start, or to each other). ``key`` names k's config key."""
    if initialization == "clients" and k > clients_per_round:
        raise ValueError(
            f"algorithm.{key}: {k} {noun} are seeded from the updates of the {clients_per_round} "
            f"clients sampled in round 1 (initialization = 'clients'), which form at most "
            f"{clients_per_round} groups; use at most {clients_per_round}, sample more clients "
            f"(federation.fraction, federation.min_clients) or initialization = 'random'"
        )


def initial_adapters(initial: Params, k: int, initialization: str) -> list[Params]:
    """The k starting adapters of IFCA's clusters or FedEM's components: redrawn like
    ``initial`` with seeds 0 … k−1 (``"random"``), or k copies of it (``"clients"``, to be
    seeded from the first round's updates by :func:`group_updates`)."""
    if initialization == "random":
        return [redraw(initial, seed=j) for j in range(k)]
    return [initial] * k


def redraw(initial: Params, seed: int) -> Params:
    """A random adapter drawn like ``initial``: each tensor that is not all zeros redrawn
    uniformly on [−max|t|, max|t|] (the Kaiming-uniform ranges PEFT's LoRA A and torch's
    ``Linear`` are drawn from, estimated from the tensor), zeros (LoRA B) kept."""
    gen = torch.Generator().manual_seed(seed)
    out: Params = {}
    for name in sorted(initial):
        t = initial[name]
        bound = float(t.abs().max()) if t.numel() else 0.0
        if bound == 0.0:
            out[name] = t.clone()
        else:
            draw = torch.rand(t.shape, generator=gen, dtype=torch.float64)
            out[name] = ((2 * draw - 1) * bound).to(t.dtype)
    return out


def cosine_similarities(updates: Sequence[Params]) -> np.ndarray:
    """K x K cosine similarities of the flattened updates (0 for a zero update)."""
    names = sorted(updates[0])
    matrix = stack(updates, names).double()
    norms = matrix.norm(dim=1, keepdim=True)
    unit = matrix / torch.where(norms > 0, norms, torch.ones_like(norms))
    return (unit @ unit.T).numpy()


def update(params: Params, start: Params) -> Params:
    """params − start, tensor by tensor."""
    return {n: params[n].float() - start[n].float() for n in params}


def bipartition(similarities: np.ndarray) -> tuple[list[int], list[int], float]:
    """(c1, c2, α_cross): the split of the rows into two non-empty groups with the smallest
    largest cross-group cosine similarity,

        c1, c2 = argmin_{c1 ∪ c2 = c}  max_{i ∈ c1, j ∈ c2} α(i, j)

    (Sattler et al. 2020, Eq. 30), and that α_cross. Exact: the optimum is the cut of the
    weakest edge of the maximum-similarity spanning tree, which single-linkage clustering
    on the distances 1 − α finds (maximum-spacing clustering; Kleinberg & Tardos, ch. 4.7).
    Sattler et al.'s code uses complete linkage, an approximation of it."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    n = len(similarities)
    if n < 2:
        raise ValueError("bipartition needs at least two clients")
    distances = np.clip(1.0 - similarities, 0.0, None)
    np.fill_diagonal(distances, 0.0)
    labels = fcluster(
        linkage(squareform(distances, checks=False), method="single"), t=2, criterion="maxclust"
    )
    c1 = [i for i in range(n) if labels[i] == labels[0]]
    c2 = [i for i in range(n) if labels[i] != labels[0]]
    if not c2:  # every distance equal: any split is optimal, take the last client off
        c1, c2 = c1[:-1], c1[-1:]
    return c1, c2, float(similarities[np.ix_(c1, c2)].max())


def group_updates(start: Params, results: Sequence[ClientResult], k: int) -> dict[int, int]:
    """Client → group from k-means (scikit-learn, k-means++ with 10 restarts, fixed random
    state) on the unit-normalised updates θ_i − ``start``: how IFCA and FedEM seed their
    adapters from the clients. At most as many groups as results."""
    from sklearn.cluster import KMeans

    k = min(k, len(results))
    if k == 1:
        return {r.client_id: 0 for r in results}
    gram = cosine_similarities([update(r.params, start) for r in results])
    # points whose inner products are the Gram matrix of the unit updates: the same
    # geometry (K x K instead of K x P)
    values, vectors = np.linalg.eigh(gram)
    embedding = vectors * np.sqrt(np.clip(values, 0.0, None))
    labels = KMeans(n_clusters=k, n_init=10, random_state=0).fit_predict(embedding)
    return {r.client_id: int(c) for r, c in zip(results, labels)}


def average_groups(
    results: Sequence[ClientResult],
    groups: Mapping[int, int],
    current: Sequence[Params],
    weighting: str,
) -> list[Params]:
    """Adapter j: the weighted mean (FedAvg's ``weighting``) of the results of the clients
    ``groups`` puts in group j, or ``current[j]`` when none is."""
    from fedloom.algorithms.fedavg import aggregation_weights

    out = list(current)
    for j in range(len(current)):
        members = [r for r in results if groups[r.client_id] == j]
        if members:
            out[j] = weighted_average(
                [r.params for r in members],
                aggregation_weights([r.num_examples for r in members], weighting),
            )
    return out

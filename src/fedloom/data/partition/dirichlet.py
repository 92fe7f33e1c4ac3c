"""Label skew by Dirichlet draws, balanced (per class) or with given client sizes (per client).

Balanced (Hsu et al., 2019, "Measuring the effects of non-identical data distribution";
FedML's ``hetero`` recipe): each class is divided over the clients in Dirichlet(alpha)
proportions, skipping clients that already hold their equal share, and the draw is repeated
until every client has ``min_size`` examples.

With client sizes ``n_k`` from a quantity skew (FedLab's unbalanced Dirichlet partition; Li
et al., 2022, "Federated Learning on Non-IID Data Silos: An Experimental Study"): client k's
class mix is ``q_k ~ Dir(alpha · prior)`` with ``prior`` the pooled class frequencies, and it
draws its ``n_k`` examples with mix ``q_k`` from what is left, without replacement,
renormalising ``q_k`` over the classes that still have examples. FedLab gives each next
example to a uniformly random client with room; here, in the same spirit but in blocks, each
of ``_DRAW_ROUNDS`` rounds lets every client (in a random order) draw up to
``ceil(max n_k / _DRAW_ROUNDS)`` more examples. Small clients complete early, and the
exhaustion of classes near the end is shared by the clients still drawing.

Small ``alpha`` gives each client few classes, large ``alpha`` approaches IID. Float labels
(regression) are first put into quantile bins.
"""

from __future__ import annotations

import numpy as np

from .iid import check_num_clients
from .pool import class_ids
from .split import sorted_indices

_DRAW_ROUNDS = 20


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Balanced label-skewed partition of ``range(len(labels))`` (per-class recipe above)."""
    check_num_clients(num_clients)
    _check_alpha(alpha)
    classes = class_ids(labels)
    n = len(classes)
    if num_clients * min_size > n:
        raise ValueError(
            f"min_size={min_size} is impossible: {num_clients} clients x {min_size} > {n} examples"
        )
    by_class = [np.flatnonzero(classes == c) for c in np.unique(classes)]
    for _ in range(max_tries):
        parts = _per_class_draw(by_class, n, num_clients, alpha, rng)
        if min(len(part) for part in parts) >= min_size:
            return [sorted_indices(part) for part in parts]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) draw in {max_tries} tries gave all {num_clients} clients "
        f"at least {min_size} examples; raise alpha, lower min_size or use fewer clients"
    )


def _check_alpha(alpha: float) -> None:
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")


def _per_class_draw(
    by_class: list[np.ndarray], n: int, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for members in by_class:
        # Clients holding their equal share already are skipped; restricting the draw to
        # the others gives the same law as the recipe's zero-and-renormalise step.
        open_clients = np.flatnonzero([len(part) < n / num_clients for part in parts])
        proportions = np.zeros(num_clients)
        proportions[open_clients] = rng.dirichlet(np.full(len(open_clients), alpha))
        cuts = (np.cumsum(proportions) * len(members)).astype(int)[:-1]
        for part, share in zip(parts, np.split(rng.permutation(members), cuts)):
            part.extend(share.tolist())
    return [np.asarray(part, dtype=np.int64) for part in parts]


def partition_dirichlet_sizes(
    labels: np.ndarray, sizes: np.ndarray, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Label-skewed partition of ``range(len(labels))`` into parts of exactly ``sizes``
    (per-client recipe above); ``sizes`` must sum to ``len(labels)``."""
    _check_alpha(alpha)
    classes = class_ids(labels)
    sizes = np.asarray(sizes, dtype=np.int64)
    if int(sizes.sum()) != len(classes):
        raise ValueError(f"client sizes sum to {int(sizes.sum())}, not {len(classes)}")
    values, counts = np.unique(classes, return_counts=True)
    pools = [rng.permutation(np.flatnonzero(classes == value)) for value in values]
    mixes = np.nan_to_num(rng.dirichlet(alpha * counts / counts.sum(), size=len(sizes)))
    left = counts.copy()
    taken: list[list[np.ndarray]] = [[] for _ in sizes]
    filled = np.zeros_like(sizes)
    step = -(-int(sizes.max()) // _DRAW_ROUNDS)
    for round_ in range(1, _DRAW_ROUNDS + 1):
        for client in rng.permutation(len(sizes)):
            need = min(int(sizes[client]), step * round_) - int(filled[client])
            filled[client] += need
            take = _class_counts(need, mixes[client], left, rng)
            taken[client] += [pool[left[c] - take[c] : left[c]] for c, pool in enumerate(pools)]
            left -= take
    return [sorted_indices(np.concatenate(part)) for part in taken]


def _class_counts(
    size: int, mix: np.ndarray, left: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Per-class counts of ``size`` draws with ``mix``, capped by ``left`` and drawn again
    with ``mix`` renormalised over the classes that still have examples until ``size``."""
    take = np.zeros_like(left)
    while (need := size - int(take.sum())) > 0:
        room = left - take
        weights = np.where(room > 0, mix, 0.0)
        if weights.sum() == 0:  # the mix has no mass on what is left: draw like the pool
            weights = room.astype(float)
        take += np.minimum(rng.multinomial(need, weights / weights.sum()), room)
    return take

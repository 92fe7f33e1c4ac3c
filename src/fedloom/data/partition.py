"""Split a pooled training set over federated clients, IID or label-skewed (Dirichlet).

Every function takes an explicit ``numpy.random.Generator`` (or a seed, for
:func:`make_clients`), so a partition is fully reproducible. Index arrays are int64 and
sorted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REGRESSION_BINS = 5


@dataclass(frozen=True, eq=False)
class ClientSplit:
    """One client's share: indices into the pooled training examples."""

    client_id: int
    train: np.ndarray
    test: np.ndarray


def _check_num_clients(num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")


def _sorted_indices(indices: np.ndarray | list[int]) -> np.ndarray:
    return np.sort(np.asarray(indices, dtype=np.int64))


def partition_iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``range(n)`` into ``num_clients`` parts whose sizes differ by at most one."""
    _check_num_clients(num_clients)
    if n < num_clients:
        raise ValueError(f"cannot give each of {num_clients} clients an example: only {n}")
    return [_sorted_indices(part) for part in np.array_split(rng.permutation(n), num_clients)]


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed partition (Hsu et al., 2019; FedML's ``hetero`` recipe).

    Each class is divided over the clients in Dirichlet(``alpha``) proportions, skipping
    clients that already hold their equal share; the draw is repeated until every client
    has at least ``min_size`` examples. Small ``alpha`` gives each client few classes,
    large ``alpha`` approaches IID. Float labels (regression) are first put into
    quantile bins.
    """
    _check_num_clients(num_clients)
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    classes = _class_ids(np.asarray(labels))
    n = len(classes)
    if num_clients * min_size > n:
        raise ValueError(
            f"min_size={min_size} is impossible: {num_clients} clients x {min_size} "
            f"> {n} examples"
        )
    by_class = [np.flatnonzero(classes == c) for c in np.unique(classes)]
    for _ in range(max_tries):
        parts = _dirichlet_draw(by_class, n, num_clients, alpha, rng)
        if min(len(part) for part in parts) >= min_size:
            return [_sorted_indices(part) for part in parts]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) draw in {max_tries} tries gave all {num_clients} clients "
        f"at least {min_size} examples; raise alpha, lower min_size or use fewer clients"
    )


def _class_ids(labels: np.ndarray) -> np.ndarray:
    """Class ids as given, or quantile-bin ids for float (regression) labels."""
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.floating):
        return labels
    edges = np.quantile(labels, np.linspace(0, 1, REGRESSION_BINS + 1)[1:-1])
    return np.digitize(labels, edges)


def _dirichlet_draw(
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


def split_train_test(
    indices: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Randomly hold out ``test_fraction`` of ``indices`` as a local test split.

    The test split gets at least one example when ``test_fraction > 0`` and there are at
    least two indices, and the train split always keeps at least one.
    """
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    indices = np.asarray(indices, dtype=np.int64)
    n = len(indices)
    n_test = int(np.floor(n * test_fraction + 0.5))
    if test_fraction > 0 and n >= 2:
        n_test = min(max(n_test, 1), n - 1)
    shuffled = rng.permutation(indices)
    return _sorted_indices(shuffled[n_test:]), _sorted_indices(shuffled[:n_test])


def make_clients(
    labels: np.ndarray,
    scheme: str,
    num_clients: int,
    seed: int,
    test_fraction: float,
    alpha: float = 0.5,
    min_size: int = 10,
) -> list[ClientSplit]:
    """Partition examples with ``labels`` over clients, each with a local test split.

    ``scheme`` is "iid" or "dirichlet"; each client holds at least ``min_size`` examples
    (train and test together). The result depends only on the arguments.
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = partition_iid(len(labels), num_clients, rng)
        smallest = min(len(part) for part in parts)
        if smallest < min_size:
            raise ValueError(
                f"min_size={min_size} is impossible: {len(labels)} examples over "
                f"{num_clients} clients leave {smallest} to the smallest"
            )
    elif scheme == "dirichlet":
        parts = partition_dirichlet(labels, num_clients, alpha, rng, min_size=min_size)
    else:
        raise ValueError(f"unknown partition scheme {scheme!r}; use 'iid' or 'dirichlet'")
    splits = []
    for client_id, part in enumerate(parts):
        train, test = split_train_test(part, test_fraction, rng)
        splits.append(ClientSplit(client_id=client_id, train=train, test=test))
    return splits


def label_histogram(
    labels: np.ndarray, splits: list[ClientSplit], num_labels: int
) -> np.ndarray:
    """Clients x labels matrix counting each client's training examples per class."""
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError("label_histogram needs integer class ids")
    if labels.size and not 0 <= labels.min() <= labels.max() < num_labels:
        raise ValueError(f"class ids must lie in 0..{num_labels - 1}")
    counts = np.zeros((len(splits), num_labels), dtype=np.int64)
    for row, split in enumerate(splits):
        counts[row] = np.bincount(labels[split.train], minlength=num_labels)
    return counts

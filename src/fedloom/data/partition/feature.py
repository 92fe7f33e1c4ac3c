"""Feature skew: a natural partition by a metadata column or by text length.

Natural partitions follow the data's own sources, as LEAF's writer/user splits do (Caldas et
al., 2018) and as Li et al. (2022) split by feature: the values of a column (STS-B ``genre``
or ``source1``, CoLA ``source``) go to clients. With at least as many values as clients,
whole values are dealt greedily, largest first, to the currently smallest client. With fewer
values, each value gets a number of clients proportional to its count, at least one
(Adams' apportionment: the next client goes to the value whose clients are currently the
largest), and is split IID among them.

``length``: examples are ordered by word count (ties in a seeded random order) and cut into
``num_clients`` equal bands, client 0 holding the shortest.
"""

from __future__ import annotations

import numpy as np

from .iid import check_num_clients
from .pool import PartitionPool
from .split import sorted_indices


def partition_feature(
    pool: PartitionPool,
    members: np.ndarray,
    feature: str,
    num_clients: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Split positions ``range(len(members))`` of the pool indices ``members`` by ``feature``."""
    check_num_clients(num_clients)
    if len(members) < num_clients:
        raise ValueError(
            f"cannot give each of {num_clients} clients an example: only {len(members)}"
        )
    if feature == "length":
        return length_bands(pool.lengths[members], num_clients, rng)
    return partition_by_value(pool.column(feature)[members], num_clients, rng)


def length_bands(
    lengths: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """``num_clients`` equal bands of positions by increasing length."""
    shuffled = rng.permutation(len(lengths))
    order = shuffled[np.argsort(lengths[shuffled], kind="stable")]
    return [sorted_indices(band) for band in np.array_split(order, num_clients)]


def partition_by_value(
    values: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Positions grouped by value and the groups dealt to clients (recipe above)."""
    names, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    groups = [np.flatnonzero(inverse == v) for v in range(len(names))]
    if len(names) >= num_clients:
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        loads = np.zeros(num_clients, dtype=np.int64)
        for v in np.argsort(-counts, kind="stable"):
            client = int(np.argmin(loads))
            parts[client].append(groups[v])
            loads[client] += counts[v]
        return [sorted_indices(np.concatenate(part)) for part in parts]
    seats = _apportion(counts, num_clients)
    return [
        sorted_indices(piece)
        for group, k in zip(groups, seats)
        for piece in np.array_split(rng.permutation(group), k)
    ]


def _apportion(counts: np.ndarray, seats: int) -> np.ndarray:
    """Adams' apportionment of ``seats`` >= ``len(counts)``: one seat each, then each next
    seat to the value with the largest count per seat."""
    given = np.ones(len(counts), dtype=np.int64)
    for _ in range(seats - len(counts)):
        given[int(np.argmax(counts / given))] += 1
    return given

"""IID partition: a uniform random split, into equal parts or into given sizes."""

from __future__ import annotations

import numpy as np

from .split import sorted_indices


def check_num_clients(num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")


def partition_iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``range(n)`` into ``num_clients`` parts whose sizes differ by at most one."""
    check_num_clients(num_clients)
    if n < num_clients:
        raise ValueError(f"cannot give each of {num_clients} clients an example: only {n}")
    return [sorted_indices(part) for part in np.array_split(rng.permutation(n), num_clients)]


def partition_sizes(sizes: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``range(sum(sizes))`` into consecutive parts of the given ``sizes``."""
    cuts = np.cumsum(sizes)[:-1]
    return [sorted_indices(part) for part in np.split(rng.permutation(int(np.sum(sizes))), cuts)]

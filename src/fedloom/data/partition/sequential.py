"""Sequential partition: the pool in its file order, cut into contiguous blocks.

Client k holds the rows [k·m, (k+1)·m) of the pool (of a task's examples under ``tasks``),
m = ``client_size`` or ⌊n / K⌋; rows past K·m belong to no client. No randomness: the
same file gives every framework the same clients, which is what a workload shared with
another framework (a benchmark) needs; it is IID only as far as the file's order is.
"""

from __future__ import annotations

import numpy as np

from .iid import check_num_clients


def partition_sequential(n: int, num_clients: int, client_size: int | None) -> list[np.ndarray]:
    """Positions ``[k·m, (k+1)·m)`` for client k of ``num_clients`` over ``range(n)``."""
    check_num_clients(num_clients)
    size = n // num_clients if client_size is None else client_size
    if size < 1:
        raise ValueError(f"cannot give each of {num_clients} clients an example: only {n}")
    if size * num_clients > n:
        raise ValueError(
            f"client_size={size} is impossible: {num_clients} clients x {size} rows > {n} examples"
        )
    return [np.arange(k * size, (k + 1) * size, dtype=np.int64) for k in range(num_clients)]

"""``Params``: the named tensor dict that is all that crosses the client/server boundary.

The weighted mean streams the clients block by block (:func:`weighted_mean_flat`); the
robust rules work on the flattened K x P matrix of client tensors (:func:`stack`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

Params = dict[str, torch.Tensor]


def flatten(params: Params, names: Sequence[str]) -> torch.Tensor:
    """Concatenate the tensors named ``names`` (in that order) into one fp32 vector."""
    return torch.cat([params[n].reshape(-1).float() for n in names])


def unflatten(
    vector: torch.Tensor, like: Params, names: Sequence[str], dtype: torch.dtype | None = None
) -> Params:
    """Split ``vector`` back into tensors shaped like ``like`` (typed like it, or ``dtype``)."""
    out: Params = {}
    offset = 0
    for n in names:
        ref = like[n]
        size = ref.numel()
        out[n] = vector[offset : offset + size].view(ref.shape).to(dtype or ref.dtype).clone()
        offset += size
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} values, params need {offset}")
    return out


def stack(clients: Sequence[Params], names: Sequence[str]) -> torch.Tensor:
    """K x P matrix, one flattened client per row."""
    return torch.stack([flatten(p, names) for p in clients])


def aggregation_weight_vector(weights: Sequence[float]) -> torch.Tensor:
    """The weights as a float64 vector, checked: non-negative with a positive sum."""
    w = torch.tensor(weights, dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"aggregation weights must be non-negative with a positive sum: {weights}")
    return w


#: values per block of :func:`weighted_mean_flat`: a float32 block (4 MB) stays in the
#: cache while the clients stream through it, and few blocks keep Python's share small
#: (``benchmarks/aggregation.py``: 1 << 20 was the fastest of 1 << 14 ... 1 << 20)
MEAN_BLOCK = 1 << 20


def weighted_mean_flat(
    clients: Sequence[Params], names: Sequence[str], weights: torch.Tensor
) -> torch.Tensor:
    """sum_k w_k theta_k / sum_k w_k over the tensors ``names`` (in that order) as one
    float64 vector, computed block by block: each block of B values is accumulated over
    the clients (``acc += p_k theta_k[block]``, p = w / sum w) in the clients' precision
    (float32, or float64 where a client's tensor is float64), so every client's memory is
    read once and the block never leaves the cache; no K x P matrix and no float64 copy of
    float32 clients is made. Accumulating float32 values in float32 (as Flower's
    ``aggregate`` does) rounds the mean to about 1e-7 of its size; summing K float64
    products of them instead reads at under half the speed (the mixed float32 -> float64
    add is not vectorized as well)."""
    p = (weights.to(torch.float64) / weights.sum()).tolist()
    sizes = [clients[0][n].numel() for n in names]
    out = torch.empty(sum(sizes), dtype=torch.float64)
    offset = 0
    for name, size in zip(names, sizes):
        flat = [c[name].reshape(-1) for c in clients]
        dtype = functools.reduce(torch.promote_types, (f.dtype for f in flat), torch.float32)
        acc = torch.empty(min(MEAN_BLOCK, size), dtype=dtype)
        for start in range(0, size, MEAN_BLOCK):
            stop = min(start + MEAN_BLOCK, size)
            block = acc[: stop - start]
            block.copy_(flat[0][start:stop]).mul_(p[0])  # widened first, then scaled
            for pk, theta in zip(p[1:], flat[1:]):
                block.add_(theta[start:stop], alpha=pk)
            out[offset + start : offset + stop].copy_(block)
        offset += size
    return out


def weighted_average(clients: Sequence[Params], weights: Sequence[float]) -> Params:
    """sum_k w_k theta_k / sum_k w_k (:func:`weighted_mean_flat`), typed like the first
    client's tensors."""
    if not clients:
        raise ValueError("weighted_average of no clients")
    names = sorted(clients[0])
    mean = weighted_mean_flat(clients, names, aggregation_weight_vector(weights))
    return unflatten(mean.float(), clients[0], names)


def num_values(params: Params) -> int:
    return sum(t.numel() for t in params.values())


def num_bytes(params: Params) -> int:
    return sum(t.numel() * t.element_size() for t in params.values())


_SEP = "/"


def pack(adapters: Sequence[Params]) -> Params:
    """One ``Params`` holding several ``adapters``, tensor ``name`` of adapter j as
    ``cluster<j>/<name>`` (``/`` never occurs in a module path)."""
    return {
        f"cluster{j}{_SEP}{name}": t
        for j, adapter in enumerate(adapters)
        for name, t in adapter.items()
    }


def unpack(packed: Params) -> list[Params]:
    """The adapters :func:`pack` packed, in cluster order."""
    clusters: dict[int, Params] = {}
    for key, tensor in packed.items():
        prefix, _, name = key.partition(_SEP)
        if not prefix.startswith("cluster") or not name:
            raise ValueError(f"not a packed cluster tensor: {key!r}")
        clusters.setdefault(int(prefix.removeprefix("cluster")), {})[name] = tensor
    if sorted(clusters) != list(range(len(clusters))):
        raise ValueError(f"packed clusters are not numbered 0..k-1: {sorted(clusters)}")
    return [clusters[j] for j in range(len(clusters))]

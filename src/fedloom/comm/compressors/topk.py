"""Top-k sparsification: the k coordinates of largest magnitude, unscaled (e.g. Stich,
Cordonnier and Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; Aji and Heafield 2017;
Lin et al., Deep Gradient Compression, 2018).

Rule. With S the indices of the k largest |x_i| (ties broken arbitrarily)::

    C(x)_i = x_i  if i ∈ S,  0 otherwise

Biased; a deterministic contraction: ‖C(x) − x‖² is the sum of the d − k smallest x_i²,
at most their average share, so ‖C(x) − x‖² ≤ (1 − k/d)‖x‖² (a k-contraction in Stich
et al.'s terms). ω is None; use it with error feedback. It ranks by |x_i|: a large
negative value is kept before a small positive one.

Encoding: the header, the k indices in increasing order in the smallest unsigned integer
that holds d − 1 (uint8 for d ≤ 256, uint16 for d ≤ 65 536, else uint32), then the k
values as float32: 2 + 4·ndim + k·(w + 4) bytes, w the index width in bytes. k is read
back from the length.

Settings: ``k``, or ``ratio`` (k = ⌈ratio · d⌉, at least 1); with neither, ratio = 0.01;
both is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.comm.compressors.base import pack_header, unpack_header
from fedloom.comm.compressors.coding import (
    flat32,
    index_dtype,
    numel,
    restore,
)
from fedloom.comm.compressors.sparsifier import Sparsifier


@dataclass(frozen=True)
class TopK(Sparsifier):
    """The k coordinates of largest |x_i|, sent as (index, float32 value) pairs."""

    name: ClassVar[str] = "topk"
    unbiased: ClassVar[bool] = False

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        flat = flat32(x)
        k = self.kept(flat.size)
        magnitude = np.abs(flat)
        if k < flat.size:
            index = np.sort(np.argpartition(magnitude, flat.size - k)[flat.size - k :])
        else:
            index = np.arange(flat.size)
        return (
            pack_header(x.shape, x.dtype)
            + index.astype(index_dtype(flat.size)).tobytes()
            + flat[index].tobytes()
        )

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, body = unpack_header(data)
        d = numel(shape)
        width = index_dtype(d)
        k, remainder = divmod(len(body), width.itemsize + 4)
        if remainder or not 1 <= k <= d:
            raise ValueError(
                f"not a topk encoding: {len(body)} bytes of body for {d} values "
                "(truncated or corrupted)"
            )
        index = np.frombuffer(body, dtype=width, count=k).astype(np.int64)
        if int(index[-1]) >= d or (k > 1 and not (np.diff(index) > 0).all()):
            raise ValueError("not a topk encoding: indices out of order or range (corrupted)")
        out = np.zeros(d, dtype=np.float32)
        out[index] = np.frombuffer(body, dtype="<f4", offset=k * width.itemsize)
        return restore(out, shape, dtype)

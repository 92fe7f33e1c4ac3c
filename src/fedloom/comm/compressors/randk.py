"""Random-k sparsification, unbiased: k coordinates drawn uniformly without replacement,
scaled by d/k (Wangni, Wang, Liu and Zhang, "Gradient Sparsification for
Communication-Efficient Distributed Optimization", NeurIPS 2018, with uniform
probabilities; the unbiased rand-k of DIANA and MARINA's analyses. Stich, Cordonnier and
Jaggi 2018's rand-k is the unscaled, contracting variant).

Rule. With S a uniformly random k-subset of {1, …, d}::

    C(x)_i = (d/k) · x_i  if i ∈ S,  0 otherwise

Unbiased (P(i ∈ S) = k/d), and exactly E‖C(x) − x‖² = (d/k − 1)‖x‖², so ω = d/k − 1.
Without the d/k scale the operator would be biased (E C(x) = (k/d) x).

Encoding: the indices are not sent. The encoder draws a 64-bit seed from its generator;
the indices are the first k of ``torch.randperm(d)`` under a generator seeded with it, which
the receiver regenerates from the seed (the seed is what both sides know). The header,
the seed (int64), then the k kept values x_i as float32 (unscaled; the decoder multiplies
by d/k): 2 + 4·ndim + 8 + 4k bytes. k is read back from the length.

Settings: ``k``, or ``ratio`` (k = ⌈ratio · d⌉, at least 1); with neither, ratio = 0.01;
both is refused. Both sides must run the same torch (``randperm``'s stream is torch's).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.comm.compressors.base import pack_header, unpack_header
from fedloom.comm.compressors.coding import flat32, numel, restore
from fedloom.comm.compressors.sparsifier import Sparsifier


def seeded_indices(seed: int, d: int, k: int) -> torch.Tensor:
    """The k indices a 64-bit seed stands for: the first k of randperm(d)."""
    return torch.randperm(d, generator=torch.Generator().manual_seed(seed))[:k]


@dataclass(frozen=True)
class RandK(Sparsifier):
    """k uniformly random coordinates scaled by d/k, indices regenerated from a seed."""

    name: ClassVar[str] = "randk"
    random: ClassVar[bool] = True

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        flat = flat32(x)
        k = self.kept(flat.size)
        seed = int(torch.randint(0, 2**63 - 1, (), generator=generator, dtype=torch.int64))
        index = seeded_indices(seed, flat.size, k).numpy()
        return pack_header(x.shape, x.dtype) + struct.pack("<q", seed) + flat[index].tobytes()

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, body = unpack_header(data)
        d = numel(shape)
        k, remainder = divmod(len(body) - 8, 4)
        if len(body) < 8 or remainder or not 1 <= k <= d:
            raise ValueError(
                f"not a randk encoding: {len(body)} bytes of body for {d} values "
                "(truncated or corrupted)"
            )
        (seed,) = struct.unpack_from("<q", body)
        if seed < 0:
            raise ValueError("not a randk encoding: a negative seed (corrupted)")
        values = np.frombuffer(body, dtype="<f4", offset=8)
        out = np.zeros(d, dtype=np.float32)
        out[seeded_indices(seed, d, k).numpy()] = values * np.float32(d / k)
        return restore(out, shape, dtype)

    def omega(self, x: torch.Tensor) -> float | None:
        d = x.numel()
        return d / self.kept(d) - 1

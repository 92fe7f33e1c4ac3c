"""Scaled sign: the compressor of EF-SignSGD (Karimireddy, Rebjock, Stich and Jaggi,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019).

Rule::

    C(x) = (‖x‖₁ / d) · sign(x)

with sign(0) = + here (0 has the sign bit 0). The scale ‖x‖₁/d is the one that minimizes
‖c·sign(x) − x‖² over c, and (zeros included) Σ x_i sign(x_i) = ‖x‖₁, ‖sign(x)‖² = d, so
the error is exactly

    ‖C(x) − x‖² = (1 − ‖x‖₁² / (d‖x‖²)) ‖x‖²

a deterministic contraction: the paper's δ-approximate compressor with
δ = ‖x‖₁² / (d‖x‖²) ≥ 1/d. Biased (use it with error feedback); ω is None.

Encoding: the header, the scale as float32, then one bit per coordinate (1: negative),
bit-packed: 2 + 4·ndim + 4 + ⌈d/8⌉ bytes.

How fedloom differs: the scale is the whole tensor's ‖x‖₁/d (the paper's layer-wise
variant applies it per layer, which is what a caller does by compressing each tensor).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.comm.compressors.base import Compressor, pack_header, unpack_header
from fedloom.comm.compressors.coding import expect_length, flat32, numel, restore


@dataclass(frozen=True)
class Sign(Compressor):
    """(‖x‖₁/d) · sign(x) in one bit per coordinate and a float32 scale."""

    name: ClassVar[str] = "sign"
    unbiased: ClassVar[bool] = False

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        flat = flat32(x)
        scale = float(np.abs(flat.astype(np.float64)).sum()) / flat.size if flat.size else 0.0
        return (
            pack_header(x.shape, x.dtype)
            + struct.pack("<f", scale)
            + np.packbits(flat < 0).tobytes()
        )

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, body = unpack_header(data)
        d = numel(shape)
        expect_length(body, 4 + -(-d // 8), "sign")
        (scale,) = struct.unpack_from("<f", body)
        negative = np.unpackbits(np.frombuffer(body, dtype=np.uint8, offset=4), count=d)
        magnitude = np.float32(scale)
        return restore(np.where(negative.astype(bool), -magnitude, magnitude), shape, dtype)

"""TernGrad: stochastic ternarization (Wen, Xu, Yan, Wu, Wang, Chen and Li, "TernGrad:
Ternary Gradients to Reduce Communication in Distributed Deep Learning", NeurIPS 2017).

Rule. With s = ‖x‖_∞ and b_i ~ Bernoulli(|x_i| / s) independent::

    C(x)_i = s · sign(x_i) · b_i ∈ {−s, 0, s}

Unbiased (E b_i = |x_i|/s), and E‖C(x)‖² = s‖x‖₁, so its variance is exactly

    E‖C(x) − x‖² = (‖x‖_∞‖x‖₁ / ‖x‖² − 1) ‖x‖²,   ω(x) = ‖x‖_∞‖x‖₁ / ‖x‖² − 1

(:meth:`TernGrad.omega`, a function of x: at most (√d − 1)/2, Mishchenko et al. 2019's
α_∞(d) = 2/(1 + √d); it is the (p, s) = (∞, 1) quantization of ``ps_quant``).

Encoding: the header, s as float32, then 2 bits per coordinate (0: zero, 1: +s, 2: −s),
bit-packed: 2 + 4·ndim + 4 + ⌈2d/8⌉ bytes.

How fedloom differs: the paper scales per layer and clips each gradient to 2.5 standard
deviations before ternarizing (which biases it); fedloom ternarizes the tensor it is given
with its own ‖x‖_∞ and does not clip (the operator stays unbiased).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.comm.compressors.base import Compressor, pack_header, unpack_header
from fedloom.comm.compressors.coding import (
    expect_length,
    fixed_bytes,
    flat32,
    numel,
    pack_fixed,
    restore,
    uniform,
    unpack_fixed,
)

ZERO, PLUS, MINUS = 0, 1, 2


@dataclass(frozen=True)
class TernGrad(Compressor):
    """s · sign(x) · Bernoulli(|x|/s), s = ‖x‖_∞, in 2 bits per coordinate."""

    name: ClassVar[str] = "terngrad"
    random: ClassVar[bool] = True

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        flat = flat32(x)
        scale = float(np.abs(flat).max()) if flat.size else 0.0
        codes = np.zeros(flat.size, dtype=np.int64)
        if scale > 0.0:
            keep = uniform(flat.size, generator) < np.abs(flat.astype(np.float64)) / scale
            codes[keep] = np.where(flat[keep] < 0, MINUS, PLUS)
        return pack_header(x.shape, x.dtype) + struct.pack("<f", scale) + pack_fixed(codes, 2)

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, body = unpack_header(data)
        d = numel(shape)
        expect_length(body, 4 + fixed_bytes(d, 2), "terngrad")
        (scale,) = struct.unpack_from("<f", body)
        codes = unpack_fixed(body[4:], d, 2)
        if d and int(codes.max()) > MINUS:
            raise ValueError("not a terngrad encoding: an unknown 2-bit code (corrupted)")
        values = np.zeros(d, dtype=np.float32)
        values[codes == PLUS] = scale
        values[codes == MINUS] = -scale
        return restore(values, shape, dtype)

    def omega(self, x: torch.Tensor) -> float | None:
        flat = flat32(x).astype(np.float64)
        squared = float(np.dot(flat, flat))
        if squared == 0.0:
            return 0.0
        return float(np.abs(flat).max()) * float(np.abs(flat).sum()) / squared - 1.0

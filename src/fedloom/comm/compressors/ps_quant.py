"""(p, s)-quantization: stochastic quantization to s levels of the ℓ_p norm, the
quantization of DIANA (Mishchenko, Gorbunov, Takáč and Richtárik, "Distributed Learning
with Compressed Gradient Differences", 2019), which QSGD (p = 2) and TernGrad (p = ∞,
s = 1) are instances of.

Rule. With p = ``norm``, s = ``levels`` and ξ_i the stochastic rounding of s|x_i|/‖x‖_p
to the integers {0, …, s} (E ξ_i = s|x_i|/‖x‖_p; |x_i| ≤ ‖x‖_p for every p ≥ 1)::

    C(x)_i = ‖x‖_p · sign(x_i) · ξ_i / s

Published bound. DIANA's p-quantization is the case s = 1 (ξ_i ~ Bernoulli(|x_i|/‖x‖_p));
its lemma gives E C(x) = x and E‖C(x)‖² = ‖x‖₁‖x‖_p exactly, so

    ω(x) = ‖x‖₁‖x‖_p / ‖x‖² − 1  ≤  1/α_p(d) − 1,   α_p(d) = inf_{x≠0} ‖x‖² / (‖x‖₁‖x‖_p),

with α_p increasing in p and decreasing in d: α_1(d) = 1/d, α_2(d) = 1/√d,
α_∞(d) = 2/(1 + √d) (so p = ∞ has the smallest variance, ω ≤ (√d − 1)/2, against √d − 1
at p = 2).

For s > 1 the same argument coordinate by coordinate (the variance of the rounding of a_i
is f(1 − f) ≤ min(a_i, 1/4), f its fractional part) gives the bound :meth:`PSQuant.omega`
returns::

    ω(x) = min( ‖x‖₁‖x‖_p / (s‖x‖²),  d‖x‖_p² / (4s²‖x‖²) )

which for p = 2 is at most QSGD's min(√d/s, d/s²) (Alistarh et al. 2017, Lemma 3.1), and
for s = 1 fedloom returns the exact value above (the smaller of the two).

Encoding: the header, ‖x‖_p as float32, then a sign bit and ξ_i in ⌈log2(s + 1)⌉ bits per
coordinate, bit-packed (QSGD's fixed-width code): 2 + 4·ndim + 4 + ⌈d(1 + ⌈log2(s+1)⌉)/8⌉
bytes.

How fedloom differs: DIANA quantizes blocks of coordinates with a norm each (block
quantization); this operator quantizes the whole tensor with one norm (one block). The
norm is sent as float32 and ξ is computed against that rounded value (in float64), so the
operator is exactly unbiased with respect to what is sent.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import numpy as np
import torch
from pydantic import AllowInfNan

from fedloom.comm.compressors.base import Compressor, pack_header, unpack_header
from fedloom.comm.compressors.coding import flat32, numel, restore
from fedloom.comm.compressors.qsgd import (
    check_levels,
    dequantize,
    fixed_body,
    p_norm,
    quantize,
    read_fixed,
)


@dataclass(frozen=True)
class PSQuant(Compressor):
    """Stochastic quantization to s = ``levels`` levels of the ℓ_p norm, p = ``norm``."""

    name: ClassVar[str] = "ps_quant"
    random: ClassVar[bool] = True
    #: p, the norm the levels are scaled by (≥ 1; ``float('inf')`` allowed)
    norm: Annotated[float, AllowInfNan()] = 2.0
    #: s, the number of levels
    levels: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.norm, bool) or not isinstance(self.norm, (int, float)):
            raise ValueError(f"norm: must be a number >= 1 (got {self.norm!r})")  # noqa: TRY004
        if math.isnan(self.norm) or self.norm < 1:
            raise ValueError(f"norm: must be >= 1, inf allowed (got {self.norm})")
        check_levels(self.levels)

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        flat = flat32(x)
        scale = p_norm(flat, float(self.norm))
        xi, negative = quantize(flat, scale, self.levels, generator)
        return (
            pack_header(x.shape, x.dtype)
            + struct.pack("<f", scale)
            + fixed_body(xi, negative, self.levels)
        )

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, body = unpack_header(data)
        if len(body) < 4:
            raise ValueError("not a ps_quant encoding: shorter than its norm")
        (scale,) = struct.unpack_from("<f", body)
        xi, negative = read_fixed(body[4:], numel(shape), self.levels, "ps_quant")
        return restore(dequantize(xi, negative, scale, self.levels), shape, dtype)

    def omega(self, x: torch.Tensor) -> float | None:
        flat = flat32(x)
        wide = flat.astype(np.float64)
        squared = float(np.dot(wide, wide))
        if squared == 0.0:
            return 0.0
        s, d = self.levels, flat.size
        lp = p_norm(flat, float(self.norm))  # the float32 norm that encode sends
        l1 = float(np.abs(wide).sum())
        by_mass = l1 * lp / (s * squared) - (1.0 if s == 1 else 0.0)
        by_levels = d * lp**2 / (4 * s**2 * squared)
        return min(by_mass, by_levels)

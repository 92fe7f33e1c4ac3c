"""Natural compression: unbiased stochastic rounding to a power of two (Horváth, Ho,
Horváth, Sahu, Canini and Richtárik, "Natural Compression for Distributed Deep Learning",
2019).

Rule. For x_i ≠ 0 with 2^a ≤ |x_i| < 2^(a+1)::

    C(x)_i = sign(x_i) · 2^a      with probability (2^(a+1) − |x_i|) / 2^a
             sign(x_i) · 2^(a+1)  with probability (|x_i| − 2^a) / 2^a

and C(x)_i = 0 for x_i = 0. Unbiased; the variance of one coordinate is
(|x_i| − 2^a)(2^(a+1) − |x_i|) ≤ x_i²/8 (the maximum at |x_i| = (4/3)·2^a), so
E‖C(x) − x‖² ≤ ω‖x‖² with ω = 1/8 (the paper's Theorem: C_nat ∈ B(1/8)).

Encoding: the result is a power of two, i.e. a float32 whose mantissa is zero, so it
travels as its sign bit and its 8-bit exponent: 9 bits per coordinate. The header, then
the d sign bits bit-packed (⌈d/8⌉ bytes), then one exponent byte per coordinate (d
bytes): 2 + 4·ndim + ⌈d/8⌉ + d bytes, within one byte of 9d/8. Exponent byte 0 is zero,
e ∈ [1, 254] is 2^(e − 127).

How fedloom differs: the rounding reads float32's bits (exponent E, mantissa m; the
probability of rounding up is m / 2²³, exactly the rule above), and the ends of float32's
range are handled so that every code is a float32: a subnormal |x_i| < 2⁻¹²⁶ rounds to 0
or 2⁻¹²⁶ (unbiased, with a variance above x_i²/8 but below 2⁻²⁵⁴), and |x_i| ≥ 2¹²⁷
rounds down to 2¹²⁷ (biased there; 2¹²⁸ is not a float32); likewise a float16 tensor's
|x_i| ≥ 2¹⁵ rounds down to 2¹⁵ (2¹⁶ is beyond float16's 65504). The sign of −0.0 is
kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.comm.compressors.base import Compressor, pack_header, unpack_header
from fedloom.comm.compressors.coding import (
    expect_length,
    flat32,
    numel,
    restore,
    uniform,
)

#: the largest exponent byte: 2^127
TOP = 254
#: the largest exponent byte by the encoded dtype: a float16 tensor's values stay below
#: 2^16 (65504 is float16's largest), so they round to at most 2^15
TOPS = {torch.float16: 127 + 15}


def natural_codes(
    flat: np.ndarray, generator: torch.Generator | None, top: int = TOP
) -> np.ndarray:
    """The exponent byte of each rounded |x_i| (0: zero), at most ``top``."""
    bits = np.abs(flat).view(np.uint32)
    exponent = (bits >> np.uint32(23)).astype(np.int64)
    mantissa = (bits & np.uint32(0x7FFFFF)).astype(np.float64)
    up = uniform(flat.size, generator) < mantissa * 2.0**-23
    return np.minimum(exponent + up, top).astype(np.uint8)


@dataclass(frozen=True)
class Natural(Compressor):
    """Stochastic rounding of each value to a neighbouring power of two, 9 bits each."""

    name: ClassVar[str] = "natural"
    random: ClassVar[bool] = True

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        flat = flat32(x)
        signs = np.packbits(np.signbit(flat))
        top = TOPS.get(x.dtype, TOP)
        return (
            pack_header(x.shape, x.dtype)
            + signs.tobytes()
            + natural_codes(flat, generator, top).tobytes()
        )

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, body = unpack_header(data)
        d = numel(shape)
        signs_bytes = -(-d // 8)
        expect_length(body, signs_bytes + d, "natural")
        raw = np.frombuffer(body, dtype=np.uint8)
        codes = raw[signs_bytes:]
        if d and int(codes.max()) > TOP:
            raise ValueError("not a natural encoding: exponent byte 255 (corrupted)")
        negative = np.unpackbits(raw[:signs_bytes], count=d).astype(np.uint32)
        bits = (negative << np.uint32(31)) | (codes.astype(np.uint32) << np.uint32(23))
        return restore(bits.view(np.float32), shape, dtype)

    def omega(self, x: torch.Tensor) -> float | None:
        return 1 / 8

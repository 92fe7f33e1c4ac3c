"""QSGD: stochastic quantization to s levels of the ℓ2 norm (Alistarh, Grubic, Li, Tomioka
and Vojnovic, "QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding",
NeurIPS 2017).

Rule. With s = ``levels``, d values and ζ_i ∈ {0, …, s} the stochastic rounding of
s|x_i|/‖x‖₂ (⌊·⌋ + 1 with probability the fractional part, so E ζ_i = s|x_i|/‖x‖₂)::

    C(x)_i = ‖x‖₂ · sign(x_i) · ζ_i / s

Published bounds (Lemma 3.1): unbiased, E‖C(x) − x‖² ≤ min(d/s², √d/s) ‖x‖² (that is ω,
:meth:`QSGD.omega`), and E‖C(x)‖₀ ≤ s(s + √d) nonzeros.

Encoding: the header, ‖x‖₂ as float32, a flag byte, then the smaller of two bodies:

* flag 0, fixed width: per coordinate a sign bit and ζ_i in w = ⌈log2(s + 1)⌉ bits,
  bit-packed: ⌈d(1 + w)/8⌉ bytes.
* flag 1, Elias-γ (Sec. 3.2, "Efficient coding"): the number m of nonzero ζ_i (uint32),
  then for each nonzero coordinate the Elias code of the gap to the previous nonzero
  position (position + 1 for the first), its sign bit, and the Elias code of ζ_i:
  ⌈(Σ|γ(gap)| + m + Σ|γ(ζ_i)|)/8⌉ bytes after the count, with |γ(k)| = 2⌊log2 k⌋ + 1.

So the encoding costs 2 + 4·ndim (header) + 4 + 1 + min(4 + ⌈elias bits/8⌉, ⌈d(1+w)/8⌉)
bytes.

How fedloom differs. (1) The paper codes the integers with Elias' recursive (ω) code,
|Elias(k)| = log k + log log k + … + 1, which its Theorem 3.2 bounds by
(3 + (3/2 + o(1)) log(2(s² + d)/(s(s + √d)))) · s(s + √d) + 32 bits in expectation; this
module uses the Elias-γ code, 2⌊log2 k⌋ + 1 bits (no longer than the recursive code
below k = 2⁸, about twice as long for very large k), so on a long sparse vector, where
the gaps are large, it can exceed that formula by a few % (the expected size on a flat
vector at s = 1, where the count of nonzeros is nearly s(s + √d): 0.92 of the formula at
d = 4,096, 0.99 at d = 65,536, 1.04 at d = 663,552). (2) It sends the count m (32 bits) so that the codes'
bits can be laid out in blocks (:func:`~fedloom.comm.compressors.coding.gamma_encode`:
the same bits reordered, decoded without a sequential scan). (3) It sends the fixed-width
body instead when that is smaller (the dense regime, where the paper devises another
code). (4) The norm travels as float32 and ζ is computed against that rounded norm (so
the operator stays exactly unbiased with respect to what is sent), in float64. (5) One
norm for the whole tensor it is given: the paper's experiments quantize buckets of b
consecutive values with a norm each (its "bucketing"), which bounds ω by min(b/s², √b/s)
at 32 bits per bucket; here b is the tensor's size (for a 663,552-value vector at s = 1,
ω = √d ≈ 815 and the encoding is about 1.7 kB).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.comm.compressors.base import Compressor, pack_header, unpack_header
from fedloom.comm.compressors.coding import (
    at_least_one,
    expect_length,
    fixed_bytes,
    fixed_width,
    flat32,
    gamma_decode,
    gamma_encode,
    gamma_lengths,
    numel,
    pack_fixed,
    restore,
    stochastic_round,
    unpack_fixed,
)

#: the most levels an operator quantizes to (ζ and the fixed width stay exact)
MAX_LEVELS = 1 << 24

FIXED, ELIAS = 0, 1


def check_levels(levels: int) -> None:
    at_least_one("levels", levels)
    if levels > MAX_LEVELS:
        raise ValueError(f"levels: must be <= {MAX_LEVELS} (got {levels})")


def p_norm(flat: np.ndarray, p: float) -> float:
    """‖x‖_p of a float32 vector rounded to float32 (computed in float64, on x / max|x|
    where p is not 1, 2 or ∞, so that a large p cannot overflow), and never below max|x|
    (so that s|x_i|/‖x‖_p ≤ s)."""
    if flat.size == 0:
        return 0.0
    top = float(np.abs(flat).max())
    if top == 0.0 or math.isinf(p):
        return top
    wide = flat.astype(np.float64)
    if p == 2.0:  # float32's squares and their sum fit float64
        norm = math.sqrt(float(np.dot(wide, wide)))
    elif p == 1.0:
        norm = float(np.abs(wide).sum())
    else:
        norm = top * float(((np.abs(wide) / top) ** p).sum()) ** (1.0 / p)
    rounded = float(np.float32(norm))
    if math.isinf(rounded):
        raise ValueError("cannot encode: the norm of the values overflows float32")
    return max(rounded, top)


def quantize(
    flat: np.ndarray, norm: float, levels: int, generator: torch.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """(ζ, the signs as 0/1 for ≥ 0/< 0): ζ_i the stochastic rounding of s|x_i|/norm."""
    negative = (flat < 0).astype(np.int64)
    if norm == 0.0:
        return np.zeros(flat.size, dtype=np.int64), negative
    a = np.abs(flat.astype(np.float64)) * (levels / norm)
    zeta = np.minimum(stochastic_round(a, generator), levels)
    return zeta, negative


def fixed_body(zeta: np.ndarray, negative: np.ndarray, levels: int) -> bytes:
    """A sign bit and ζ_i in ⌈log2(s + 1)⌉ bits per coordinate, bit-packed."""
    width = fixed_width(levels)
    return pack_fixed((negative << width) | zeta, 1 + width)


def read_fixed(body: memoryview, d: int, levels: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(ζ, signs 0/1) from :func:`fixed_body`'s bytes; a ``ValueError`` if they are not."""
    width = fixed_width(levels)
    expect_length(body, fixed_bytes(d, 1 + width), what)
    codes = unpack_fixed(body, d, 1 + width)
    zeta, negative = codes & ((1 << width) - 1), codes >> width
    if d and int(zeta.max()) > levels:
        raise ValueError(f"not a {what} encoding: a level above {levels} (corrupted)")
    return zeta, negative


def elias_body(zeta: np.ndarray, negative: np.ndarray, positions: np.ndarray) -> bytes:
    """The count m of nonzero ζ_i (uint32), then for each nonzero coordinate (at
    ``positions``, increasing) γ(gap), its sign bit and γ(ζ_i), laid out in blocks: the
    gaps' codes, the signs, the levels' codes."""
    gaps = np.diff(positions, prepend=-1)
    bits = np.concatenate(
        [
            gamma_encode(gaps),
            negative[positions].astype(np.uint8),
            gamma_encode(zeta[positions]),
        ]
    )
    return struct.pack("<I", len(positions)) + np.packbits(bits).tobytes()


def elias_bits(zeta: np.ndarray, positions: np.ndarray | None = None) -> int:
    """The bits of the Elias-γ codes, signs included, for these levels (no count, no
    padding): Σ|γ(gap)| + m + Σ|γ(ζ_i)|; ``positions``: the nonzero ones, if known."""
    if positions is None:
        positions = np.flatnonzero(zeta)
    gaps = np.diff(positions, prepend=-1)
    codes = int(gamma_lengths(gaps).sum()) + int(gamma_lengths(zeta[positions]).sum())
    return codes + len(positions)


def read_elias(body: memoryview, d: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    if len(body) < 4:
        raise ValueError("not a qsgd encoding: the Elias body is truncated")
    (m,) = struct.unpack_from("<I", body)
    if m > d:
        raise ValueError(f"not a qsgd encoding: {m} nonzeros of {d} values (corrupted)")
    raw = np.frombuffer(body, dtype=np.uint8, offset=4)
    bits = np.unpackbits(raw)
    ones = np.flatnonzero(bits)
    gaps, offset = gamma_decode(bits, ones, 0, m)
    if offset + m > len(bits):
        raise ValueError("not a qsgd encoding: the sign bits are truncated")
    signs = bits[offset : offset + m].astype(np.int64)
    values, offset = gamma_decode(bits, ones, offset + m, m)
    if -(-offset // 8) != len(raw) or bits[offset:].any():
        raise ValueError("not a qsgd encoding: bytes after the codes (corrupted)")
    positions = np.cumsum(gaps) - 1
    if m and (int(positions[-1]) >= d or int(values.max()) > levels):
        raise ValueError("not a qsgd encoding: a position or level out of range (corrupted)")
    zeta = np.zeros(d, dtype=np.int64)
    negative = np.zeros(d, dtype=np.int64)
    zeta[positions] = values
    negative[positions] = signs
    return zeta, negative


def dequantize(zeta: np.ndarray, negative: np.ndarray, norm: float, levels: int) -> np.ndarray:
    """norm · sign · ζ / s as float32."""
    magnitude = zeta.astype(np.float32) * np.float32(norm / levels)
    return np.where(negative.astype(bool), -magnitude, magnitude)


@dataclass(frozen=True)
class QSGD(Compressor):
    """QSGD with s = ``levels`` levels of ‖x‖₂, Elias-γ or fixed-width coded."""

    name: ClassVar[str] = "qsgd"
    random: ClassVar[bool] = True
    #: s, the number of levels (ζ_i ∈ {0, …, s})
    levels: int = 16

    def __post_init__(self) -> None:
        check_levels(self.levels)

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        flat = flat32(x)
        norm = p_norm(flat, 2.0)
        zeta, negative = quantize(flat, norm, self.levels, generator)
        head = pack_header(x.shape, x.dtype) + struct.pack("<f", norm)
        fixed = fixed_bytes(flat.size, 1 + fixed_width(self.levels))
        positions = np.flatnonzero(zeta)
        if 4 + -(-elias_bits(zeta, positions) // 8) < fixed:
            return head + bytes([ELIAS]) + elias_body(zeta, negative, positions)
        return head + bytes([FIXED]) + fixed_body(zeta, negative, self.levels)

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, body = unpack_header(data)
        if len(body) < 5:
            raise ValueError("not a qsgd encoding: shorter than its norm and flag")
        (norm,) = struct.unpack_from("<f", body)
        flag, rest = body[4], body[5:]
        d = numel(shape)
        if flag == FIXED:
            zeta, negative = read_fixed(rest, d, self.levels, "qsgd")
        elif flag == ELIAS:
            zeta, negative = read_elias(rest, d, self.levels)
        else:
            raise ValueError(f"not a qsgd encoding: unknown code flag {flag}")
        return restore(dequantize(zeta, negative, norm, self.levels), shape, dtype)

    def omega(self, x: torch.Tensor) -> float | None:
        d = x.numel()
        s = self.levels
        return min(d / s**2, math.sqrt(d) / s)

"""Fixed-point quantization for secure aggregation, and the bound that keeps the sum exact.

The rule. Masks live in Z_{2^b}, so each client first maps its float vector x to
integers: clip to [−c, c], scale to u = (clip(x) + c) · L / (2c) ∈ [0, L] with
L = 2^{b_q} − 1 (b_q bits of quantization), and round stochastically,

    q = ⌊u⌋ + 1  with probability u − ⌊u⌋,   q = ⌊u⌋ otherwise,

so that E[q] = u: **the rounding is unbiased for every x inside [−c, c]** (outside, it is
unbiased for clip(x), and the clipping is the bias). The inverse is
x̂ = q · Δ − c with the step Δ = 2c / L; one client's error |x̂ − x| is below Δ, its
variance at most Δ²/4. The server unmasks the sum S = Σ_{i ∈ U} q_i of the m = |U|
surviving clients and dequantizes it as S · Δ − m · c: within m · Δ of Σ x_i (coordinate
by coordinate, for inputs inside the range), with standard deviation at most Δ·√m / 2.

The overflow bound. The server recovers S mod 2^b. Each q_i ≤ L, so S ≤ m · L ≤ n · L for
a round of n clients, and S mod 2^b = S for every drop-out pattern exactly when

    n · (2^{b_q} − 1) ≤ 2^b − 1,   i.e.   n ≤ ⌊(2^b − 1) / (2^{b_q} − 1)⌋.

(The rounder n · 2^{b_q} ≤ 2^b is sufficient but not necessary: b = 32 and b_q = 16 hold
exactly 65 537 = 2^16 + 1 clients, one more than 2^32 / 2^16.) A configuration that breaks
it is refused (``secagg.bits``), never allowed to wrap. By default b_q is the largest
that the round's n allows (:func:`quant_bits_for`), at most 52 so that u is exact in a
float64 and the rounding stays unbiased.

How fedloom differs: Flower's SecAgg+ quantizes to ``quantization_range`` levels and
checks only that the number of shares times that range fits the modulus; fedloom states
the exact condition for the round's clients and derives b_q from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedloom.secagg.masks import check_bits

#: the most quantization bits: u must be exact in a float64 (53-bit significand)
MAX_QUANT_BITS = 52


def max_clients(bits: int, quant_bits: int) -> int:
    """The most clients whose b_q-bit values sum mod 2^b without wrapping:
    ⌊(2^b − 1) / (2^{b_q} − 1)⌋."""
    return ((1 << bits) - 1) // ((1 << quant_bits) - 1)


def check_overflow(clients: int, bits: int, quant_bits: int) -> None:
    """Refuse (``ValueError``, ``secagg.bits``) when ``clients`` values of ``quant_bits``
    bits can wrap modulo 2^``bits``."""
    check_bits(bits)
    if not 1 <= quant_bits <= MAX_QUANT_BITS:
        raise ValueError(
            f"secagg.quant_bits: {quant_bits} (1 to {MAX_QUANT_BITS}: a float64 must hold "
            f"the scaled value exactly)"
        )
    limit = max_clients(bits, quant_bits)
    if clients > limit:
        raise ValueError(
            f"secagg.bits: the sum of {clients} clients' {quant_bits}-bit values can wrap "
            f"modulo 2^{bits}: n·(2^{quant_bits} − 1) must be ≤ 2^{bits} − 1, which allows "
            f"at most {limit} clients; raise secagg.bits or lower secagg.quant_bits"
        )


def bits_left(count: int, bits: int) -> int:
    """The largest b_q ≤ 52 with ``count`` · (2^{b_q} − 1) ≤ 2^``bits`` − 1: the bits each
    of ``count`` values keeps in a sum modulo 2^``bits`` that cannot wrap (0: not one)."""
    check_bits(bits)
    fitting = (q for q in range(min(bits, MAX_QUANT_BITS), 0, -1) if count <= max_clients(bits, q))
    return next(fitting, 0)


def bits_needed(count: int, quant_bits: int) -> int:
    """The smallest b with ``count`` · (2^``quant_bits`` − 1) ≤ 2^b − 1: the modulus that
    holds the sum of ``count`` values of ``quant_bits`` bits."""
    return (count * ((1 << quant_bits) - 1)).bit_length()


def quant_bits_for(clients: int, bits: int) -> int:
    """The largest b_q ≤ 52 with ``clients`` · (2^{b_q} − 1) ≤ 2^``bits`` − 1."""
    quant_bits = bits_left(clients, bits)
    if quant_bits == 0:
        raise ValueError(
            f"secagg.bits: 2^{bits} cannot hold the sum of {clients} clients' values even at "
            f"one bit each; raise secagg.bits"
        )
    return quant_bits


@dataclass(frozen=True)
class Quantizer:
    """Stochastic rounding of floats in [−``clip_range``, ``clip_range``] to
    ``quant_bits``-bit integers, and back."""

    clip_range: float
    quant_bits: int

    def __post_init__(self) -> None:
        if not (np.isfinite(self.clip_range) and self.clip_range > 0):
            raise ValueError(f"secagg.clip_range: {self.clip_range} (a positive number)")
        if not 1 <= self.quant_bits <= MAX_QUANT_BITS:
            raise ValueError(f"secagg.quant_bits: {self.quant_bits} (1 to {MAX_QUANT_BITS})")

    @property
    def levels(self) -> int:
        """L = 2^{b_q} − 1: the largest quantized value."""
        return (1 << self.quant_bits) - 1

    @property
    def step(self) -> float:
        """Δ = 2c / L: the value of one quantization step."""
        return 2 * self.clip_range / self.levels

    def quantize(self, x: ArrayLike, rng: np.random.Generator) -> NDArray[np.uint64]:
        """q ∈ {0, …, L}, with E[q · Δ − c] = x for x inside [−c, c]."""
        values = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise ValueError("secagg: cannot quantize a non-finite value")
        c = self.clip_range
        u = (np.clip(values, -c, c) + c) * (self.levels / (2 * c))
        u = np.clip(u, 0.0, float(self.levels))
        low = np.floor(u)
        up = rng.random(u.shape) < (u - low)
        return (low + up).astype(np.uint64)

    def dequantize(self, q: ArrayLike) -> NDArray[np.float64]:
        """x̂ = q · Δ − c for one client's values."""
        return self.dequantize_sum(q, 1)

    def dequantize_sum(self, total: ArrayLike, count: int) -> NDArray[np.float64]:
        """The float sum of ``count`` clients from the sum of their quantized values:
        S · Δ − count · c."""
        s = np.asarray(total).astype(np.float64)
        return s * self.step - count * self.clip_range

    def error_bound(self, count: int) -> float:
        """The largest |dequantized sum − float sum| of ``count`` clients, coordinate by
        coordinate, for inputs inside the range: count · Δ (strictly below it)."""
        return count * self.step

"""Several small integers in one big one: the slots of a packed Paillier plaintext.

The rule: s values v_0 … v_{s−1}, each below 2^w, are the integer P = Σ_j v_j · 2^{j·w}.
Adding packed integers adds the slots, and no slot carries into the next as long as every
slot's sum stays below 2^w; the sum is then below 2^{s·w}, which the caller keeps below
the plaintext modulus. :func:`unpack` refuses an integer with bits above its s slots
(a sum that wrapped, or not a sum of packed inputs).

Written by hand: phe encrypts one integer per ciphertext and packs nothing, and a
3072-bit plaintext per 32-bit value would make a client's update a hundred times larger.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedloom.secagg.masks import UInts


def slots(capacity_bits: int, slot_bits: int) -> int:
    """How many ``slot_bits``-bit slots fit below 2^``capacity_bits``; a ``ValueError``
    when not one does."""
    count = capacity_bits // slot_bits
    if count < 1:
        raise ValueError(
            f"homomorphic: a slot of {slot_bits} bits does not fit a plaintext of "
            f"{capacity_bits} bits"
        )
    return count


def pack(values: UInts, slot_bits: int, per_integer: int) -> list[int]:
    """``values`` (each below 2^``slot_bits``) as ⌈len / per_integer⌉ packed integers,
    the first value in the lowest slot."""
    out = []
    as_ints = [int(v) for v in values]
    for start in range(0, len(as_ints), per_integer):
        packed = 0
        for v in reversed(as_ints[start : start + per_integer]):
            packed = (packed << slot_bits) | v
        out.append(packed)
    return out


def unpack(integers: Sequence[int], slot_bits: int, per_integer: int, count: int) -> UInts:
    """The first ``count`` slot values of ``integers`` (what :func:`pack` wrote, or sums
    of it) as uint64; a ``ValueError`` for an integer with bits beyond its slots."""
    if len(integers) != -(-count // per_integer):
        raise ValueError(f"homomorphic: {len(integers)} packed integers do not hold {count} values")
    mask = (1 << slot_bits) - 1
    out: list[int] = []
    for packed in integers:
        here = min(per_integer, count - len(out))
        if packed < 0 or packed >> (here * slot_bits):
            raise ValueError(
                "homomorphic: a packed sum has bits beyond its slots (it wrapped, or is "
                "not a sum of packed inputs)"
            )
        for _ in range(here):
            out.append(packed & mask)
            packed >>= slot_bits
    return np.array(out, dtype=np.uint64)

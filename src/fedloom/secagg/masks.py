"""Masks: a 32-byte seed expanded by a cryptographic keystream into d integers mod 2^b.

The rule (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving
Machine Learning"; Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead"): client i sends

    y_i = q_i + PRG(b_i) + Σ_{j ∈ N(i), j > i} PRG(s_ij) − Σ_{j ∈ N(i), j < i} PRG(s_ij)
          (mod 2^b)

where q_i is its quantized input, b_i its self-mask seed and s_ij = s_ji the seed it
agreed with neighbour j. Each pairwise mask enters the sum once with + (from the smaller
id) and once with − (from the larger), so the pairwise masks of two clients that both
sent cancel; the server removes the self-masks of the senders, and the pairwise masks
with a client that dropped, from seeds it rebuilds from shares. PRG(seed) is uniform
modulo 2^b, so y_i alone is uniform whatever q_i is (a one-time pad over Z_{2^b}).

PRG here is ChaCha20 (``cryptography``) keyed by the full 32-byte seed, its 128-bit
nonce made of a zero block counter, the round and a domain tag (self-mask or pairwise
mask), so that no (seed, round, domain) keystream is used twice. The keystream is read as
little-endian 64-bit words, one per coordinate, and reduced mod 2^b by keeping the low b
bits: a uniform 64-bit word has uniform low bits, so the mask is exactly uniform mod 2^b.
Arithmetic is numpy ``uint64``, which wraps mod 2^64; since 2^b divides 2^64, sums and
differences wrap correctly mod 2^b once masked with 2^b − 1. One ChaCha20 stream covers
2^32 blocks of 64 bytes: up to 2^35 coordinates per mask.

How fedloom differs from Flower's SecAgg+: Flower folds the seed into a 32-bit integer
and draws the mask from numpy's ``RandomState`` (a Mersenne Twister, not a cryptographic
generator, with 2^32 possible masks); fedloom keys a stream cipher with all 256 bits.
b is limited to 62 so that every value mod 2^b, and the unmasked sum, is a nonnegative
``int64`` as well.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from numpy.typing import NDArray

#: the largest modulus exponent b
MAX_BITS = 62
#: domain tags of the keystream nonce
SELF_MASK = 1
PAIR_MASK = 2

UInts = NDArray[np.uint64]


def check_bits(bits: int) -> None:
    if not 2 <= bits <= MAX_BITS:
        raise ValueError(f"secagg.bits: {bits} (the modulus is 2^b with 2 ≤ b ≤ {MAX_BITS})")


def modulus_mask(bits: int) -> np.uint64:
    """2^b − 1: ``x & modulus_mask(b)`` is x mod 2^b."""
    check_bits(bits)
    return np.uint64((1 << bits) - 1)


def expand(seed: bytes, round_: int, dim: int, bits: int, domain: int) -> UInts:
    """PRG(seed): ``dim`` integers uniform modulo 2^``bits``, from ChaCha20 keyed by
    ``seed`` (32 bytes) with a nonce from ``round_`` and ``domain``."""
    if len(seed) != 32:
        raise ValueError(f"secagg: a mask seed of {len(seed)} bytes (32 needed)")
    if dim > (1 << 35):
        raise ValueError(f"secagg: {dim} coordinates exceed one ChaCha20 stream")
    # cryptography's ChaCha20 nonce: 4-byte little-endian block counter, then 12 bytes
    nonce = struct.pack("<IQI", 0, round_, domain)
    encryptor = Cipher(algorithms.ChaCha20(seed, nonce), mode=None).encryptor()
    stream = encryptor.update(bytes(8 * dim))
    words = np.frombuffer(stream, dtype="<u8").astype(np.uint64)
    return words & modulus_mask(bits)


def pair_sign(me: int, peer: int) -> int:
    """+1 when ``me`` < ``peer``, −1 when ``me`` > ``peer``: the sign of PRG(s_ij) in
    client ``me``'s masked input, opposite in ``peer``'s so that the two cancel."""
    if me == peer:
        raise ValueError(f"secagg: client {me} has no pairwise mask with itself")
    return 1 if me < peer else -1


def add_signed(acc: UInts, mask: UInts, sign: int) -> None:
    """acc ← acc ± mask (mod 2^64; reduce mod 2^b with :func:`modulus_mask`), in place."""
    if sign > 0:
        np.add(acc, mask, out=acc)
    else:
        np.subtract(acc, mask, out=acc)


def pair_masks(me: int, seeds: Mapping[int, bytes], round_: int, dim: int, bits: int) -> UInts:
    """Σ_j ±PRG(s_ij) mod 2^b over client ``me``'s pairwise ``seeds`` (peer → s_ij)."""
    acc = np.zeros(dim, dtype=np.uint64)
    for peer, seed in seeds.items():
        add_signed(acc, expand(seed, round_, dim, bits, PAIR_MASK), pair_sign(me, peer))
    return acc & modulus_mask(bits)


def mask_input(
    quantized: UInts,
    self_seed: bytes,
    me: int,
    seeds: Mapping[int, bytes],
    round_: int,
    bits: int,
) -> UInts:
    """y = q + PRG(b) + Σ_j ±PRG(s_ij) mod 2^b: what client ``me`` sends."""
    q = np.asarray(quantized, dtype=np.uint64)
    dim = q.shape[0]
    y = q + expand(self_seed, round_, dim, bits, SELF_MASK)
    np.add(y, pair_masks(me, seeds, round_, dim, bits), out=y)
    return y & modulus_mask(bits)

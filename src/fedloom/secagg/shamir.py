"""Shamir secret sharing over the prime field GF(2^127 − 1).

The rule (Shamir 1979): to share a secret s at threshold t among parties with distinct
nonzero ids x_1..x_m, draw a polynomial f of degree t − 1 with f(0) = s and the other t − 1
coefficients uniform in the field, and give party j the point (x_j, f(x_j)). Any t points
determine f, hence s = f(0), by Lagrange interpolation at 0; any t − 1 points are
consistent with every value of f(0), each equally likely, so they reveal nothing of s.

A secret of any length is cut into 15-byte chunks (120 bits < 127, so each chunk is a field
element) and each chunk is shared with its own polynomial; a share carries one field
element per chunk and the secret's length. A 32-byte seed or X25519 private key is three
chunks: one share is 4 + 2 + 3·16 = 54 bytes on the wire (:meth:`Share.to_bytes`).

In the protocol (Bonawitz et al. 2017, "Practical Secure Aggregation for
Privacy-Preserving Machine Learning"; Bell et al. 2020, "Secure Single-Server Aggregation
with (Poly)Logarithmic Overhead") each client shares its self-mask seed and its mask
private key among its neighbours and itself, so that the server can rebuild a dropped
client's pairwise masks, or a survivor's self-mask, from t of the holders' shares.

Why hand-written: the scheme is a few lines of modular arithmetic (Python's integers are
exact and ``pow(a, -1, p)`` inverts), and no well-kept Python library offers it for this
use: ``cryptography`` has no secret sharing, and PyCryptodome's ``Shamir`` (which Flower
uses) works on 16-byte blocks in GF(2^128) through a second crypto stack that fedloom
would otherwise not depend on. How fedloom differs from Flower's: one prime field, chunks
without padding, the secret's length carried in the share, and the coefficients drawn
from :mod:`secrets`.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass

#: the field's modulus, the Mersenne prime 2^127 − 1
PRIME = (1 << 127) - 1
#: bytes of secret per field element (15 · 8 = 120 bits < 127)
CHUNK = 15
#: bytes of one field element on the wire
ELEMENT = 16
_HEADER = struct.Struct(">IH")  # x, secret length


@dataclass(frozen=True)
class Share:
    """One party's point of the polynomials: its id ``x`` (nonzero), one value per chunk,
    and the length of the secret in bytes."""

    x: int
    values: tuple[int, ...]
    length: int

    def to_bytes(self) -> bytes:
        """``x`` (4 bytes), the length (2 bytes), then 16 bytes per value, big-endian."""
        return _HEADER.pack(self.x, self.length) + b"".join(
            v.to_bytes(ELEMENT, "big") for v in self.values
        )

    #: bytes of :meth:`to_bytes`'s header (``x``, the length)
    HEADER_SIZE = _HEADER.size

    @classmethod
    def size_of(cls, header: bytes) -> int:
        """The length of a share's :meth:`to_bytes` from its first :data:`HEADER_SIZE`
        bytes (a share read from a stream)."""
        _, length = _HEADER.unpack(header)
        return _HEADER.size + ELEMENT * _chunks(length)

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        if len(data) < _HEADER.size or (len(data) - _HEADER.size) % ELEMENT:
            raise ValueError(f"shamir: a share of {len(data)} bytes is malformed")
        x, length = _HEADER.unpack_from(data)
        body = data[_HEADER.size :]
        values = tuple(
            int.from_bytes(body[i : i + ELEMENT], "big") for i in range(0, len(body), ELEMENT)
        )
        if len(values) != _chunks(length) or any(v >= PRIME for v in values) or x == 0:
            raise ValueError(f"shamir: a share of {len(data)} bytes is malformed")
        return cls(x, values, length)


def _chunks(length: int) -> int:
    return -(-length // CHUNK)


def split(secret: bytes, threshold: int, ids: Sequence[int]) -> list[Share]:
    """Shares of ``secret`` for the parties ``ids`` (distinct, 1 ≤ id < 2^32), any
    ``threshold`` of which recover it and fewer reveal nothing; in the order of ``ids``."""
    if not 1 <= len(secret) <= 0xFFFF:
        raise ValueError(f"shamir: a secret of {len(secret)} bytes (1 to 65535 allowed)")
    if len(set(ids)) != len(ids) or any(not 0 < x < 1 << 32 for x in ids):
        raise ValueError(f"shamir: share ids must be distinct and in [1, 2^32): {list(ids)}")
    if not 1 <= threshold <= len(ids):
        raise ValueError(f"shamir: threshold {threshold} with {len(ids)} shares")
    chunks = [int.from_bytes(secret[i : i + CHUNK], "big") for i in range(0, len(secret), CHUNK)]
    # one polynomial per chunk: the chunk is f(0), the other coefficients are uniform
    polys = [[c] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)] for c in chunks]
    return [Share(x, tuple(_evaluate(poly, x) for poly in polys), len(secret)) for x in ids]


def _evaluate(poly: Sequence[int], x: int) -> int:
    """f(x) mod PRIME by Horner's rule; ``poly`` from the constant term up."""
    acc = 0
    for c in reversed(poly):
        acc = (acc * x + c) % PRIME
    return acc


def combine(shares: Sequence[Share], threshold: int | None = None) -> bytes:
    """The secret whose polynomials pass through ``shares`` (Lagrange interpolation at 0).

    With ``threshold``, fewer shares are refused and the first ``threshold`` are used.
    Without it, all are used: fewer than the sharing's threshold give an unrelated value
    (that is the scheme's secrecy), never an error.
    """
    if threshold is not None:
        if len(shares) < threshold:
            raise ValueError(
                f"shamir: {len(shares)} shares cannot recover a secret shared at "
                f"threshold {threshold}"
            )
        shares = shares[:threshold]
    if not shares:
        raise ValueError("shamir: no shares to combine")
    length = shares[0].length
    if any(s.length != length or len(s.values) != _chunks(length) for s in shares):
        raise ValueError("shamir: the shares are of different secrets")
    xs = [s.x for s in shares]
    if len(set(xs)) != len(xs):
        raise ValueError(f"shamir: repeated share ids {xs}")
    # Lagrange basis at 0: l_j(0) = Π_{m ≠ j} x_m / (x_m − x_j)
    basis = []
    for j, xj in enumerate(xs):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % PRIME
                den = den * (xm - xj) % PRIME
        basis.append(num * pow(den, -1, PRIME) % PRIME)
    out = bytearray()
    for c in range(_chunks(length)):
        value = sum(lj * s.values[c] for lj, s in zip(basis, shares)) % PRIME
        size = min(CHUNK, length - c * CHUNK)
        # fewer shares than the threshold give a random field element that may not fit
        # the chunk: keep its low bytes (the result is meaningless either way)
        out += (value % (1 << (8 * size))).to_bytes(size, "big")
    return bytes(out)

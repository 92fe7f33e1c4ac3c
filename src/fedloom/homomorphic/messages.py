"""The messages of homomorphic aggregation, with their wire encoding.

Every message is a frozen dataclass with ``to_bytes``, ``from_bytes`` and ``nbytes()``
(the length of ``to_bytes``, computed without building it), in the layout of
:mod:`fedloom.secagg.encoding`: ids 4 bytes, the round 8, a length 4, byte strings after
their length. The stages (:data:`STAGES`): "keys" (:class:`HomomorphicSetup` to the key
holder, :class:`PublicContext` back), "encrypt" (:class:`EncryptRequest` to every
client, :class:`Ciphertexts` back), "decrypt" (:class:`DecryptRequest` to the key holder,
:class:`PlainSum` back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fedloom.homomorphic.scheme import Layout, Scheme, scheme_for
from fedloom.secagg.encoding import Reader, WireError, Writer
from fedloom.secagg.masks import UInts
from fedloom.secagg.quantize import Quantizer

HomomorphicName = Literal["ckks", "paillier"]
PROTOCOLS: tuple[HomomorphicName, ...] = ("ckks", "paillier")
#: the stages, by number: a client that stops at stage s sends nothing from s on
STAGES = ("keys", "encrypt", "decrypt")

_ID, _ROUND, _LEN = 4, 8, 4


def _write_blobs(w: Writer, blobs: Sequence[bytes]) -> Writer:
    w.uint(len(blobs), _LEN)
    for blob in blobs:
        w.blob(blob, _LEN)
    return w


def _read_blobs(r: Reader) -> tuple[bytes, ...]:
    return tuple(r.blob(_LEN) for _ in range(r.uint(_LEN)))


def _blobs_nbytes(blobs: Sequence[bytes]) -> int:
    return _LEN + sum(_LEN + len(b) for b in blobs)


@dataclass(frozen=True)
class HomomorphicSetup:
    """Stage "keys", server → key holder (and inside every :class:`EncryptRequest`): the
    round's public parameters."""

    round: int
    clients: tuple[int, ...]
    dim: int
    protocol: HomomorphicName
    bits: int
    quant_bits: int
    clip_range: float
    #: the client that generates the round's key pair and decrypts the sum
    key_holder: int
    #: Paillier's modulus bits (0 under CKKS, whose parameters are fixed)
    key_bits: int

    @property
    def quantizer(self) -> Quantizer:
        return Quantizer(self.clip_range, self.quant_bits)

    @property
    def layout(self) -> Layout:
        return Layout(self.dim, self.bits, len(self.clients))

    def scheme(self) -> Scheme:
        return scheme_for(self.protocol, self.layout, self.key_bits)

    def nbytes(self) -> int:
        # round, n, ids, dim, protocol, b, b_q, c (float64), key holder, key bits
        return _ROUND + _LEN + _ID * len(self.clients) + _LEN + 1 + 1 + 1 + 8 + _ID + _LEN

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.round, _ROUND).uint(len(self.clients), _LEN)
        for c in self.clients:
            w.uint(c, _ID)
        w.uint(self.dim, _LEN).uint(PROTOCOLS.index(self.protocol), 1)
        w.uint(self.bits, 1).uint(self.quant_bits, 1).float64(self.clip_range)
        return w.uint(self.key_holder, _ID).uint(self.key_bits, _LEN).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> HomomorphicSetup:
        r = Reader(data, "homomorphic setup")
        round_, n = r.uint(_ROUND), r.uint(_LEN)
        clients = tuple(r.uint(_ID) for _ in range(n))
        dim, protocol = r.uint(_LEN), r.uint(1)
        if protocol >= len(PROTOCOLS):
            raise WireError(f"homomorphic: protocol number {protocol} is unknown")
        bits, quant_bits, c = r.uint(1), r.uint(1), r.float64()
        holder, key_bits = r.uint(_ID), r.uint(_LEN)
        r.end()
        return cls(round_, clients, dim, PROTOCOLS[protocol], bits, quant_bits, c, holder, key_bits)


@dataclass(frozen=True)
class PublicContext:
    """Stage "keys", key holder → server: the round's public key (Paillier's N, or CKKS's
    public context), serialized by its library."""

    client: int
    round: int
    key: bytes

    def nbytes(self) -> int:
        return _ID + _ROUND + _LEN + len(self.key)

    def to_bytes(self) -> bytes:
        return Writer().uint(self.client, _ID).uint(self.round, _ROUND).blob(self.key).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> PublicContext:
        r = Reader(data, "public context")
        out = cls(r.uint(_ID), r.uint(_ROUND), r.blob(_LEN))
        r.end()
        return out


@dataclass(frozen=True)
class EncryptRequest:
    """Stage "encrypt", server → every client: the setup and the public key to encrypt
    its input under."""

    setup: HomomorphicSetup
    key: bytes

    def nbytes(self) -> int:
        return _LEN + self.setup.nbytes() + _LEN + len(self.key)

    def to_bytes(self) -> bytes:
        return Writer().blob(self.setup.to_bytes()).blob(self.key).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> EncryptRequest:
        r = Reader(data, "encrypt request")
        out = cls(HomomorphicSetup.from_bytes(r.blob(_LEN)), r.blob(_LEN))
        r.end()
        return out


@dataclass(frozen=True)
class Ciphertexts:
    """Stage "encrypt", client → server: its input, encrypted."""

    client: int
    round: int
    blobs: tuple[bytes, ...]

    def nbytes(self) -> int:
        return _ID + _ROUND + _blobs_nbytes(self.blobs)

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.client, _ID).uint(self.round, _ROUND)
        return _write_blobs(w, self.blobs).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> Ciphertexts:
        r = Reader(data, "ciphertexts")
        out = cls(r.uint(_ID), r.uint(_ROUND), _read_blobs(r))
        r.end()
        return out


@dataclass(frozen=True)
class DecryptRequest:
    """Stage "decrypt", server → key holder: the ciphertexts of the sum, and whose inputs
    it adds."""

    round: int
    summed: tuple[int, ...]
    blobs: tuple[bytes, ...]

    def nbytes(self) -> int:
        return _ROUND + _LEN + _ID * len(self.summed) + _blobs_nbytes(self.blobs)

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.round, _ROUND).uint(len(self.summed), _LEN)
        for c in self.summed:
            w.uint(c, _ID)
        return _write_blobs(w, self.blobs).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> DecryptRequest:
        r = Reader(data, "decrypt request")
        round_, n = r.uint(_ROUND), r.uint(_LEN)
        summed = tuple(r.uint(_ID) for _ in range(n))
        out = cls(round_, summed, _read_blobs(r))
        r.end()
        return out


@dataclass(frozen=True)
class PlainSum:
    """Stage "decrypt", key holder → server: the sum, ``bits`` bits a coordinate on the
    wire (w = b + ⌈log2 n⌉)."""

    client: int
    round: int
    total: UInts
    bits: int

    def nbytes(self) -> int:
        return _ID + _ROUND + _LEN + 1 + -(-self.total.shape[0] * self.bits // 8)

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.client, _ID).uint(self.round, _ROUND)
        return w.vector(self.total, self.bits).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> PlainSum:
        r = Reader(data, "plain sum")
        client, round_ = r.uint(_ID), r.uint(_ROUND)
        return cls(client, round_, *r.vector())

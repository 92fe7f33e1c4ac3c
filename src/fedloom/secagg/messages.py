"""SecAgg / SecAgg+'s round setup and messages (:mod:`fedloom.secagg.protocol` says the
protocol): what the server announces (:class:`RoundSetup`), the messages of the four
stages with their wire encoding (each ``to_bytes``; ``nbytes()`` is its length), and the
errors a party raises."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from fedloom.secagg import graph as graphs
from fedloom.secagg.encoding import Reader, WireError, Writer
from fedloom.secagg.masks import (
    UInts,
    check_bits,
)
from fedloom.secagg.quantize import Quantizer, check_overflow, quant_bits_for
from fedloom.secagg.shamir import Share

ProtocolName = Literal["secagg+", "secagg"]


PROTOCOLS: tuple[ProtocolName, ...] = ("secagg+", "secagg")


#: the stages, by number: a client that drops at stage s sends nothing from s on
STAGES = ("advertise", "share", "mask", "unmask")


# the wire encoding (each message's to_bytes; nbytes() is its length): ids 4 bytes, the
# round 8, a length 4, an X25519 public key 32
_ID, _ROUND, _LEN, _KEY = 4, 8, 4, 32


_MAX_ID = (1 << 32) - 2  # a share's x is id + 1 < 2^32


class ProtocolError(ValueError):
    """The protocol cannot go on: too few clients or shares, or a malformed message."""


class ClientRefusal(ProtocolError):
    """A client refuses a server's request that would reveal more than the sum."""


@dataclass(frozen=True)
class SecAggConfig:
    """The ``[secagg]`` settings: None means the default for the round's n clients."""

    protocol: ProtocolName = "secagg+"
    #: b: the modulus is 2^b
    bits: int = 32
    #: c: inputs are clipped to [−c, c] before quantization
    clip_range: float = 1.0
    #: t: default ⌈2·|G|/3⌉ with |G| = k + 1 the holders of a client's shares
    threshold: int | None = None
    #: k (SecAgg+ only): default min(n − 1, 2·⌈log2 n⌉)
    neighbours: int | None = None
    #: b_q: default the largest with n·(2^{b_q} − 1) ≤ 2^b − 1
    quant_bits: int | None = None


@dataclass(frozen=True)
class RoundSetup:
    """Stage 0, server → every client: the round's public parameters."""

    round: int
    clients: tuple[int, ...]
    dim: int
    protocol: ProtocolName
    neighbours: int
    threshold: int
    bits: int
    quant_bits: int
    clip_range: float
    graph_seed: bytes

    @cached_property
    def graph(self) -> graphs.Graph:
        if self.protocol == "secagg":
            return graphs.complete_graph(self.clients)
        return graphs.neighbour_graph(self.clients, self.neighbours, self.graph_seed)

    def group(self, client: int) -> frozenset[int]:
        """G(i): the holders of client ``client``'s shares, its neighbours and itself."""
        return self.graph[client] | {client}

    @property
    def quantizer(self) -> Quantizer:
        return Quantizer(self.clip_range, self.quant_bits)

    def nbytes(self) -> int:
        # round, n, ids, dim, protocol, k, t, b, b_q, c (float64), seed
        return _ROUND + _LEN + _ID * len(self.clients) + _LEN + 1 + _LEN + _LEN + 1 + 1 + 8 + 32

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.round, _ROUND).uint(len(self.clients), _LEN)
        for c in self.clients:
            w.uint(c, _ID)
        w.uint(self.dim, _LEN).uint(PROTOCOLS.index(self.protocol), 1)
        w.uint(self.neighbours, _LEN).uint(self.threshold, _LEN)
        w.uint(self.bits, 1).uint(self.quant_bits, 1).float64(self.clip_range)
        return w.raw(_seed(self.graph_seed)).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> RoundSetup:
        r = Reader(data, "round setup")
        round_, n = r.uint(_ROUND), r.uint(_LEN)
        clients = tuple(r.uint(_ID) for _ in range(n))
        dim, protocol = r.uint(_LEN), r.uint(1)
        if protocol >= len(PROTOCOLS):
            raise WireError(f"secagg: protocol number {protocol} is unknown")
        k, t, bits, quant_bits = r.uint(_LEN), r.uint(_LEN), r.uint(1), r.uint(1)
        c, seed = r.float64(), r.raw(32)
        r.end()
        return cls(round_, clients, dim, PROTOCOLS[protocol], k, t, bits, quant_bits, c, seed)


def setup_round(
    config: SecAggConfig,
    clients: Sequence[int],
    round_: int,
    dim: int,
    graph_seed: bytes | None = None,
) -> RoundSetup:
    """The round's :class:`RoundSetup`, or a ``ValueError`` naming the ``secagg`` key a
    setting breaks."""
    n = len(clients)
    if len(set(clients)) != n or any(not 0 <= c <= _MAX_ID for c in clients):
        raise ValueError(f"secagg: client ids must be distinct and in [0, 2^32 − 2]: {clients}")
    if n < 2:
        raise ValueError(f"secagg: a round of {n} client cannot hide an input in a sum")
    if config.protocol not in PROTOCOLS:
        raise ValueError(f"secagg.protocol: {config.protocol!r} (one of {list(PROTOCOLS)})")
    check_bits(config.bits)
    Quantizer(config.clip_range, 1)  # checks the clipping range
    if dim < 1:
        raise ValueError(f"secagg: a vector of {dim} coordinates")
    if config.protocol == "secagg":
        k = n - 1
    else:
        k = graphs.default_neighbours(n) if config.neighbours is None else config.neighbours
        if k < min(2, n - 1):
            raise ValueError(f"secagg.neighbours: {k} (at least 2)")
        k = min(k, n - 1)
    # H(k, n) with k and n odd has one node of degree k + 1 (graph.py)
    deg_max = k + 1 if (k % 2 and n % 2 and k < n - 1) else k
    group_min, group_max = k + 1, deg_max + 1
    t = math.ceil(2 * group_max / 3) if config.threshold is None else config.threshold
    if t > group_min:
        raise ValueError(
            f"secagg.threshold: t = {t} exceeds the {group_min} shares each client deals "
            f"(to its {k} neighbours and itself)"
        )
    if 2 * t <= group_max:
        raise ValueError(
            f"secagg.threshold: t = {t} is not a majority of the {group_max} holders of a "
            f"client's shares; the protocol's security needs t > {group_max}/2"
        )
    if config.quant_bits is None:
        quant_bits = quant_bits_for(n, config.bits)
    else:
        quant_bits = config.quant_bits
        check_overflow(n, config.bits, quant_bits)
    seed = graphs.new_seed() if graph_seed is None else graph_seed
    return RoundSetup(
        round_,
        tuple(clients),
        dim,
        config.protocol,
        k,
        t,
        config.bits,
        quant_bits,
        float(config.clip_range),
        seed,
    )


@dataclass(frozen=True)
class KeyAdvert:
    """Stage 0, client → server: the two public keys."""

    client: int
    round: int
    mask_key: bytes
    enc_key: bytes

    def nbytes(self) -> int:
        return _ID + _ROUND + len(self.mask_key) + len(self.enc_key)

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.client, _ID).uint(self.round, _ROUND)
        return w.raw(_key(self.mask_key)).raw(_key(self.enc_key)).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> KeyAdvert:
        r = Reader(data, "key advert")
        out = cls(r.uint(_ID), r.uint(_ROUND), r.raw(_KEY), r.raw(_KEY))
        r.end()
        return out


@dataclass(frozen=True)
class PeerKeys:
    """Stage 0, server → client: its neighbours' public keys (mask, encryption)."""

    round: int
    keys: Mapping[int, tuple[bytes, bytes]]

    def nbytes(self) -> int:
        return _ROUND + _LEN + sum(_ID + len(m) + len(e) for m, e in self.keys.values())

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.round, _ROUND).uint(len(self.keys), _LEN)
        for peer, (mask_key, enc_key) in self.keys.items():
            w.uint(peer, _ID).raw(_key(mask_key)).raw(_key(enc_key))
        return w.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerKeys:
        r = Reader(data, "peer keys")
        round_, n = r.uint(_ROUND), r.uint(_LEN)
        keys = {}
        for _ in range(n):
            peer = r.uint(_ID)
            keys[peer] = (r.raw(_KEY), r.raw(_KEY))
        r.end()
        return cls(round_, keys)


@dataclass(frozen=True)
class EncryptedShares:
    """Stage 1, client → server: one ciphertext per neighbour, by receiver."""

    client: int
    round: int
    ciphertexts: Mapping[int, bytes]

    def nbytes(self) -> int:
        return _ID + _ROUND + _LEN + sum(_ID + _LEN + len(c) for c in self.ciphertexts.values())

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.client, _ID).uint(self.round, _ROUND)
        return _write_ciphertexts(w, self.ciphertexts).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> EncryptedShares:
        r = Reader(data, "encrypted shares")
        client, round_ = r.uint(_ID), r.uint(_ROUND)
        return cls(client, round_, _read_ciphertexts(r))


@dataclass(frozen=True)
class Forwarded:
    """Stage 1, server → client: the ciphertexts addressed to it, by sender."""

    round: int
    ciphertexts: Mapping[int, bytes]

    def nbytes(self) -> int:
        return _ROUND + _LEN + sum(_ID + _LEN + len(c) for c in self.ciphertexts.values())

    def to_bytes(self) -> bytes:
        return _write_ciphertexts(Writer().uint(self.round, _ROUND), self.ciphertexts).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> Forwarded:
        r = Reader(data, "forwarded shares")
        round_ = r.uint(_ROUND)
        return cls(round_, _read_ciphertexts(r))


@dataclass(frozen=True)
class MaskedInput:
    """Stage 2, client → server: y_i, d integers modulo 2^b (b bits each on the wire,
    after d and b)."""

    client: int
    round: int
    masked: UInts
    bits: int

    def nbytes(self) -> int:
        return _ID + _ROUND + _LEN + 1 + math.ceil(self.masked.shape[0] * self.bits / 8)

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.client, _ID).uint(self.round, _ROUND)
        return w.vector(self.masked, self.bits).getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> MaskedInput:
        r = Reader(data, "masked input")
        client, round_ = r.uint(_ID), r.uint(_ROUND)
        return cls(client, round_, *r.vector())


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 3, server → client: which of its neighbours survived (their b-shares are
    wanted) and which dropped after sharing (their key shares are wanted)."""

    round: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]

    def nbytes(self) -> int:
        return _ROUND + 2 * _LEN + _ID * (len(self.survivors) + len(self.dropped))

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.round, _ROUND)
        w.uint(len(self.survivors), _LEN).uint(len(self.dropped), _LEN)
        for c in (*self.survivors, *self.dropped):
            w.uint(c, _ID)
        return w.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskRequest:
        r = Reader(data, "unmask request")
        round_, survivors, dropped = r.uint(_ROUND), r.uint(_LEN), r.uint(_LEN)
        out = cls(
            round_,
            tuple(r.uint(_ID) for _ in range(survivors)),
            tuple(r.uint(_ID) for _ in range(dropped)),
        )
        r.end()
        return out


@dataclass(frozen=True)
class UnmaskResponse:
    """Stage 3, client → server: the shares asked for, by the peer they belong to."""

    client: int
    round: int
    self_mask_shares: Mapping[int, Share]
    key_shares: Mapping[int, Share]

    def nbytes(self) -> int:
        shares = [*self.self_mask_shares.values(), *self.key_shares.values()]
        return _ID + _ROUND + 2 * _LEN + sum(_ID + len(s.to_bytes()) for s in shares)

    def to_bytes(self) -> bytes:
        w = Writer().uint(self.client, _ID).uint(self.round, _ROUND)
        w.uint(len(self.self_mask_shares), _LEN).uint(len(self.key_shares), _LEN)
        for shares in (self.self_mask_shares, self.key_shares):
            for peer, share in shares.items():
                w.uint(peer, _ID).raw(share.to_bytes())
        return w.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskResponse:
        r = Reader(data, "unmask response")
        client, round_, n_self, n_key = r.uint(_ID), r.uint(_ROUND), r.uint(_LEN), r.uint(_LEN)

        def shares(count: int) -> dict[int, Share]:
            out = {}
            for _ in range(count):
                peer, header = r.uint(_ID), r.raw(Share.HEADER_SIZE)
                try:
                    out[peer] = Share.from_bytes(
                        header + r.raw(Share.size_of(header) - len(header))
                    )
                except ValueError as err:
                    raise WireError(str(err)) from None
            return out

        self_mask, keys = shares(n_self), shares(n_key)
        r.end()
        return cls(client, round_, self_mask, keys)


def _key(key: bytes) -> bytes:
    if len(key) != _KEY:
        raise WireError(f"secagg: a public key of {len(key)} bytes (X25519's are {_KEY})")
    return key


def _seed(seed: bytes) -> bytes:
    if len(seed) != 32:
        raise WireError(f"secagg: a graph seed of {len(seed)} bytes (32 expected)")
    return seed


def _write_ciphertexts(w: Writer, ciphertexts: Mapping[int, bytes]) -> Writer:
    w.uint(len(ciphertexts), _LEN)
    for peer, ciphertext in ciphertexts.items():
        w.uint(peer, _ID).blob(ciphertext, _LEN)
    return w


def _read_ciphertexts(r: Reader) -> dict[int, bytes]:
    out = {}
    for _ in range(r.uint(_LEN)):
        peer = r.uint(_ID)
        out[peer] = r.blob(_LEN)
    r.end()
    return out


def share_id(client: int) -> int:
    """A client's Shamir x: its id + 1 (x = 0 would be the secret itself)."""
    return client + 1

"""The SecAgg / SecAgg+ protocol: four stages of explicit messages, run in process.

The rule (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving
Machine Learning"; Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead"). The server announces the round (:class:`RoundSetup`: the
clients, the graph seed, t, b, the quantization); N(i) is client i's neighbours in the
graph (:mod:`fedloom.secagg.graph`: every other client for SecAgg, a Harary graph of
degree k for SecAgg+) and G(i) = N(i) ∪ {i} the holders of its shares.

0. Advertise keys. Each client draws two X25519 key pairs, (c_i^PK, c_i^SK) to encrypt
   shares and (s_i^PK, s_i^SK) for its pairwise masks, and a 32-byte self-mask seed b_i;
   it sends the two public keys. The server sends each client the keys of its neighbours
   that advertised (the set U1).
1. Share keys. Client i splits b_i and s_i^SK with Shamir at threshold t among G(i) ∩ U1,
   keeps its own shares, and encrypts each neighbour's pair of shares with
   ChaCha20-Poly1305 under the key agreed from c_i^SK and c_j^PK (associated data: round,
   sender, receiver). The server, which cannot read them, forwards to each client j of U2
   (the clients that sent shares) the ciphertexts addressed to it by U2.
2. Masked input. Client i decrypts its shares (a forged or replayed one fails
   authentication and the client stops), derives s_ij from s_i^SK and s_j^PK for every j
   that sent it shares, and sends y_i = q(x_i) + PRG(b_i) + Σ_j ±PRG(s_ij) mod 2^b
   (:mod:`fedloom.secagg.masks`, :mod:`fedloom.secagg.quantize`). U3: the clients whose y
   arrived.
3. Unmasking. The server tells each survivor u ∈ U3 which of its neighbours survived
   (U3: it needs their b-shares, to remove their self-masks) and which dropped after
   sharing (U2 \\ U3: it needs their key shares, to rebuild their pairwise masks with the
   survivors). The client answers with those shares only, and refuses a request that
   does not fit what it saw (below). From t shares of each, the server rebuilds the b_u
   and the dropped s_v^SK (checked against the advertised s_v^PK), removes the masks and
   obtains Σ_{u ∈ U3} q(x_u) exactly, which it dequantizes.

Drop-outs: a client that stops before stage 2 is left out cleanly (a client absent from U1
is nobody's neighbour; one in U1 \\ U2 masks with nobody, and nobody with it); one that
stops after sharing (U2 \\ U3) has its pairwise masks removed through its key shares; one
that sent y but stops before stage 3 (U3 \\ U4) is still summed, its b rebuilt from the
others' shares. The server refuses (:class:`ProtocolError`) when any of U1, U2, U3, U4 is
smaller than t, or when a secret it needs has fewer than t shares among the responders.

Security model, as in the papers' semi-honest setting: an honest-but-curious server and
fewer than t colluding clients in any G(i) learn nothing of an input beyond the sum. The
threshold must be a majority of G(i): each holder reveals one kind of share per peer, so a
server that tells some holders that j survived and others that j dropped still cannot
gather t shares of both kinds from fewer than 2t holders. Colluding holders reveal both
kinds, so against such a lying server c colluders among G(j) are safe only while
c < 2t − |G(j)| (Bonawitz et al.'s consistency round, not built, closes this).

What a client checks, rather than trust the server (Bonawitz et al. 2017, Fig. 4, where t
is a parameter of the protocol and a client aborts a round that does not fit what it
saw). A refusal is a :class:`ClientRefusal`, raised before the client sends anything of
that stage; :meth:`fedloom.runtime.secure_round.SecureClient.answer` then treats the client as
one that stopped there (it answers no later stage), and :func:`run_round` ends the round:

* the announced round, when it opens its side: it refuses a threshold that is not a
  strict majority of the holders of its shares (t ≤ |G(i)|/2) or exceeds them
  (t > |G(i)|), fewer neighbours than min(2, n − 1), and repeated client ids, as
  :func:`setup_round` does on the server (a server announcing t = 1 could otherwise ask
  one holder for a client's self-mask share and another for its key share);
* the unmasking request: it answers only if it sent its masked input and is named a
  survivor; every peer named sent it shares (U3 ⊆ U2 ⊆ U1 as it knows them); at least t
  of its share holders survived (|U3 ∩ G(i)| ≥ t); and no peer is asked for both its
  self-mask share and its key share, in one request or across requests (with b_j and
  s_j^SK the server could unmask y_j).

How fedloom differs: no signatures and no consistency check round (Bonawitz et al.'s
actively secure variant, with a PKI, is out of scope); the graph is derived by every
client from the announced seed rather than sent as a list; shares are held by G(i) (the
client itself included, as Flower's SecAgg+ does) so that SecAgg's complete graph gives
n shares and t ranges over ⌊n/2⌋ + 1..n; masks come from ChaCha20 over the full seed
(Flower's come from a Mersenne Twister seeded with a 32-bit fold); the exact overflow
condition for n clients is checked; the messages are objects with an explicit wire
encoding (each one's ``to_bytes``, :mod:`fedloom.secagg.encoding`), passed in process by
the local and Ray runtimes and sent as these bytes in the Flower runtime's message rounds
(:meth:`fedloom.runtime.flower_app.FlowerClients.secagg`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedloom.secagg import graph as graphs
from fedloom.secagg.encoding import Reader, WireError, Writer
from fedloom.secagg.keys import (
    KeyPair,
    decrypt,
    encrypt,
    encryption_key,
    pair_seed,
)
from fedloom.secagg.masks import (
    PAIR_MASK,
    SELF_MASK,
    UInts,
    add_signed,
    check_bits,
    expand,
    mask_input,
    modulus_mask,
    pair_sign,
)
from fedloom.secagg.quantize import Quantizer, check_overflow, quant_bits_for
from fedloom.secagg.shamir import Share, combine, split

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


# --- messages -------------------------------------------------------------------------


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


def _share_id(client: int) -> int:
    """A client's Shamir x: its id + 1 (x = 0 would be the secret itself)."""
    return client + 1


def _pack(b_share: Share, key_share: Share) -> bytes:
    return b_share.to_bytes() + key_share.to_bytes()


def _unpack(data: bytes) -> tuple[Share, Share]:
    if len(data) % 2:
        raise ProtocolError(f"secagg: a share bundle of {len(data)} bytes is malformed")
    half = len(data) // 2
    return Share.from_bytes(data[:half]), Share.from_bytes(data[half:])


# --- the client -----------------------------------------------------------------------


def _refuse_unsafe_setup(setup: RoundSetup, client: int) -> None:
    """Client ``client``'s own check of the round the server announced, before it sends
    anything (:class:`ClientRefusal`). In Bonawitz et al. 2017 t is a parameter every
    party knows, not the server's word: a server that announced t = 1 could ask one holder
    for a client's self-mask share and another for its key share, and unmask its input.
    So the client refuses, as :func:`setup_round` would:

    * client ids that repeat (its neighbourhood would be ill-defined);
    * fewer neighbours than min(2, n − 1), and none at all (its masked input would then
      hide behind its self-mask alone, which the server is entitled to remove);
    * t above |G(i)|, the holders of its shares (it cannot deal them);
    * t ≤ |G(i)|/2: each honest holder reveals one kind of share per peer, so only a
      strict majority keeps a server from gathering t of both kinds.
    """
    n = len(setup.clients)
    if len(set(setup.clients)) != n:
        raise ClientRefusal(
            f"secagg: client {client} refuses round {setup.round}: repeated client ids"
        )
    neighbours = len(setup.graph[client])
    fewest = 2 if n > 2 else 1
    holders, t = neighbours + 1, setup.threshold
    refuse = f"secagg: client {client} refuses round {setup.round}:"
    if neighbours < fewest:
        raise ClientRefusal(f"{refuse} {neighbours} neighbours, fewer than the protocol's {fewest}")
    if t > holders:
        raise ClientRefusal(
            f"{refuse} t = {t} exceeds the {holders} holders of its shares (its "
            f"{neighbours} neighbours and itself)"
        )
    if 2 * t <= holders:
        raise ClientRefusal(
            f"{refuse} t = {t} is not a majority of the {holders} holders of its shares "
            f"(its {neighbours} neighbours and itself); it needs t > {holders}/2"
        )


class SecAggClient:
    """One client's side of one round; its keys and seed are fresh for the round."""

    def __init__(
        self, client_id: int, setup: RoundSetup, rng: np.random.Generator | None = None
    ) -> None:
        if client_id not in setup.clients:
            raise ProtocolError(f"secagg: client {client_id} is not in round {setup.round}")
        _refuse_unsafe_setup(setup, client_id)
        self.id = client_id
        self.setup = setup
        self._rng = np.random.default_rng() if rng is None else rng
        self._mask_keys = KeyPair.generate()
        self._enc_keys = KeyPair.generate()
        self._self_seed = secrets.token_bytes(32)
        self._peer_keys: dict[int, tuple[bytes, bytes]] = {}
        self._aead_keys: dict[int, bytes] = {}
        #: peer (itself included) → the (b-share, key share) of that peer this client holds
        self._held: dict[int, tuple[Share, Share]] = {}
        #: peer → which of its shares this client revealed: "self-mask" or "key"
        self._revealed: dict[int, str] = {}
        #: the client's own quantized input (it never leaves the client); set once it
        #: has sent its masked input
        self.quantized: UInts | None = None

    def _check_round(self, round_: int) -> None:
        if round_ != self.setup.round:
            raise ProtocolError(
                f"secagg: client {self.id} is in round {self.setup.round}, not {round_}"
            )

    def advertise(self) -> KeyAdvert:
        """Stage 0: the two public keys."""
        return KeyAdvert(self.id, self.setup.round, self._mask_keys.public, self._enc_keys.public)

    def share_keys(self, peer_keys: PeerKeys) -> EncryptedShares:
        """Stage 1: b_i and s_i^SK split among G(i) ∩ U1, each neighbour's pair of shares
        encrypted for it."""
        self._check_round(peer_keys.round)
        neighbours = self.setup.graph[self.id]
        if stray := sorted(set(peer_keys.keys) - neighbours):
            raise ProtocolError(
                f"secagg: client {self.id} was sent keys of {stray}, not its neighbours"
            )
        published = [k for pair in peer_keys.keys.values() for k in pair]
        published += [self._mask_keys.public, self._enc_keys.public]
        if len(set(published)) != len(published):
            raise ProtocolError(f"secagg: client {self.id} was sent repeated public keys")
        self._peer_keys = dict(peer_keys.keys)
        holders = sorted({self.id, *self._peer_keys})
        t = self.setup.threshold
        if len(holders) < t:
            raise ProtocolError(
                f"secagg: client {self.id} has {len(holders)} holders for its shares "
                f"(itself and its neighbours with keys), fewer than t = {t}"
            )
        ids = [_share_id(c) for c in holders]
        b_shares = split(self._self_seed, t, ids)
        key_shares = split(self._mask_keys.private_bytes(), t, ids)
        ciphertexts: dict[int, bytes] = {}
        for holder, b_share, key_share in zip(holders, b_shares, key_shares):
            if holder == self.id:
                self._held[self.id] = (b_share, key_share)
                continue
            key = encryption_key(self._enc_keys.private, self._peer_keys[holder][1])
            self._aead_keys[holder] = key
            ciphertexts[holder] = encrypt(
                key,
                _pack(b_share, key_share),
                round_=self.setup.round,
                sender=self.id,
                receiver=holder,
            )
        return EncryptedShares(self.id, self.setup.round, ciphertexts)

    def receive_shares(self, forwarded: Forwarded) -> list[int]:
        """Stage 2, first half: decrypt and keep the shares the server forwarded; the
        senders (this client's part of U2), sorted. A ciphertext that does not
        authenticate raises :class:`~fedloom.secagg.keys.ShareAuthenticationError`."""
        self._check_round(forwarded.round)
        if stray := sorted(set(forwarded.ciphertexts) - set(self._peer_keys)):
            raise ProtocolError(
                f"secagg: client {self.id} was forwarded shares from {stray}, not its "
                f"neighbours with keys"
            )
        held: dict[int, tuple[Share, Share]] = {}
        for sender, ciphertext in forwarded.ciphertexts.items():
            plain = decrypt(
                self._aead_keys[sender],
                ciphertext,
                round_=self.setup.round,
                sender=sender,
                receiver=self.id,
            )
            b_share, key_share = _unpack(plain)
            if b_share.x != _share_id(self.id) or key_share.x != _share_id(self.id):
                raise ProtocolError(
                    f"secagg: client {sender}'s shares for client {self.id} have another id"
                )
            held[sender] = (b_share, key_share)
        self._held.update(held)
        if len(held) + 1 < self.setup.threshold:
            raise ProtocolError(
                f"secagg: client {self.id} received shares from {len(held)} neighbours; "
                f"with itself, fewer than t = {self.setup.threshold}"
            )
        return sorted(held)

    def masked_input(self, forwarded: Forwarded, x: ArrayLike) -> MaskedInput:
        """Stage 2: y_i = q(x_i) + PRG(b_i) + Σ_j ±PRG(s_ij) mod 2^b over the neighbours
        j that sent this client shares."""
        values = np.asarray(x, dtype=np.float64).reshape(-1)
        if values.shape[0] != self.setup.dim:
            raise ProtocolError(
                f"secagg: client {self.id}'s input has {values.shape[0]} coordinates, the "
                f"round {self.setup.dim}"
            )
        return self.masked_integers(forwarded, self.setup.quantizer.quantize(values, self._rng))

    def masked_integers(self, forwarded: Forwarded, q: UInts) -> MaskedInput:
        """Stage 2 for an input the caller encoded itself (``q``: ``dim`` integers below
        2^b, e.g. a weighted quantized update; the caller answers for the overflow bound):
        y_i = q + PRG(b_i) + Σ_j ±PRG(s_ij) mod 2^b."""
        senders = self.receive_shares(forwarded)
        q = np.asarray(q)
        if q.dtype != np.uint64 or q.shape != (self.setup.dim,):
            raise ProtocolError(
                f"secagg: client {self.id}'s input is not {self.setup.dim} unsigned 64-bit integers"
            )
        if np.any(q > modulus_mask(self.setup.bits)):
            raise ProtocolError(
                f"secagg: client {self.id}'s input does not fit modulo 2^{self.setup.bits}"
            )
        self.quantized = q
        seeds = {j: pair_seed(self._mask_keys.private, self._peer_keys[j][0]) for j in senders}
        y = mask_input(q, self._self_seed, self.id, seeds, self.setup.round, self.setup.bits)
        return MaskedInput(self.id, self.setup.round, y, self.setup.bits)

    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Stage 3: the b-shares of the survivors and the key shares of the dropped, once
        the request is consistent with what this client saw (:meth:`_check_survivors`)
        and asks one kind of share per peer (:meth:`_check_one_kind_per_peer`); else a
        :class:`ClientRefusal`, and nothing is revealed."""
        self._check_round(request.round)
        survivors, dropped = set(request.survivors), set(request.dropped)
        self._check_survivors(survivors, dropped)
        asked = self._check_one_kind_per_peer(survivors, dropped)
        self._revealed.update(asked)
        return UnmaskResponse(
            self.id,
            self.setup.round,
            {p: self._held[p][0] for p in sorted(survivors)},
            {p: self._held[p][1] for p in sorted(dropped)},
        )

    def _refuse(self, reason: str) -> ClientRefusal:
        return ClientRefusal(f"secagg: client {self.id} refuses: {reason}")

    def _check_survivors(self, survivors: set[int], dropped: set[int]) -> None:
        """The announced survivors U3 and drop-outs U2 \\ U3 must fit what this client
        saw (Bonawitz et al. 2017, Fig. 4, the unmasking round): it sent its masked input
        and is a survivor; every peer named sent it shares (U3 ⊆ U2 ⊆ U1 as this client
        knows them); and at least t of its share holders survived."""
        if self.quantized is None:
            raise self._refuse("it sent no masked input this round")
        if unknown := sorted((survivors | dropped) - set(self._held)):
            raise self._refuse(
                f"the server names {unknown} among the survivors or the dropped, but they "
                f"sent it no shares (they are not in U2)"
            )
        if self.id in dropped or self.id not in survivors:
            raise self._refuse("the server counts it as dropped, but it sent its masked input")
        if len(survivors) < self.setup.threshold:
            raise self._refuse(
                f"{len(survivors)} survivors among its neighbours and itself, fewer than "
                f"t = {self.setup.threshold}"
            )

    def _check_one_kind_per_peer(self, survivors: set[int], dropped: set[int]) -> dict[int, str]:
        """Which share of each peer is asked for ("self-mask" or "key"), refused where a
        peer's other kind is asked for too, in this request or an earlier one.

        The rule the protocol's security rests on, checked in code (not an ``assert``,
        which ``python -O`` removes): with both of a peer's shares, t such answers give
        the server b_j and s_j^SK, hence q(x_j) from y_j."""
        if both := sorted(survivors & dropped):
            raise self._refuse(
                f"the server asked for both the self-mask share and the key share of "
                f"client {both[0]}"
            )
        asked = {p: "self-mask" for p in survivors} | {p: "key" for p in dropped}
        for peer, kind in sorted(asked.items()):
            if (earlier := self._revealed.get(peer, kind)) != kind:
                raise self._refuse(
                    f"it already revealed client {peer}'s {earlier} share, and was asked for "
                    f"its {kind} share"
                )
        return asked


# --- the server -----------------------------------------------------------------------


@dataclass(frozen=True)
class SecAggResult:
    """What the server learns: the exact sum of the survivors' quantized inputs, its
    dequantization, who was summed, and who dropped when."""

    #: Σ_{u ∈ U3} q(x_u), exact (int64)
    total: NDArray[np.int64]
    #: total · Δ − |U3| · c: the float sum, within ``error_bound`` of Σ x_u
    sum: NDArray[np.float64]
    #: U3, the clients summed
    survivors: tuple[int, ...]
    #: U2 \ U3: dropped after sharing keys, their pairwise masks recovered
    dropouts: tuple[int, ...]
    #: the round's clients absent from U2: dropped before sharing keys, left out
    left_out: tuple[int, ...]
    #: U3 \ U4: sent y, did not answer the unmasking (their self-masks recovered)
    silent: tuple[int, ...]
    #: |Σ dequantized − Σ x| < error_bound per coordinate, for inputs in [−c, c]
    error_bound: float


_Message = KeyAdvert | EncryptedShares | MaskedInput | UnmaskResponse


class SecAggServer:
    """The server's side of one round. It only ever holds public keys, ciphertexts,
    masked inputs and the shares it asks for."""

    def __init__(self, setup: RoundSetup) -> None:
        self.setup = setup
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._u2: set[int] = set()
        self._u3: set[int] = set()
        self._sum: UInts | None = None
        #: what arrived in stage 2, by client: what a curious server could inspect
        self.received: dict[int, UInts] = {}

    def _need(self, count: int, what: str) -> None:
        if count < self.setup.threshold:
            raise ProtocolError(
                f"secagg: {count} clients {what}, fewer than the threshold "
                f"t = {self.setup.threshold}: the round cannot be aggregated securely"
            )

    def _check(self, messages: Sequence[_Message], allowed: Iterable[int], what: str) -> None:
        """Refuse a message of another round, from an unexpected client, or repeated."""
        seen: set[int] = set()
        allowed = set(allowed)
        for m in messages:
            if m.round != self.setup.round:
                raise ProtocolError(
                    f"secagg: client {m.client}'s {what} is for round {m.round}, not "
                    f"{self.setup.round}"
                )
            if m.client not in allowed:
                raise ProtocolError(f"secagg: a {what} from client {m.client}, not expected")
            if m.client in seen:
                raise ProtocolError(f"secagg: two {what}s from client {m.client}")
            seen.add(m.client)

    def collect_keys(self, adverts: Sequence[KeyAdvert]) -> dict[int, PeerKeys]:
        """Stage 0: U1 and, for each of its clients, its neighbours' keys."""
        self._check(adverts, self.setup.clients, "key advertisement")
        self._keys = {a.client: (a.mask_key, a.enc_key) for a in adverts}
        self._need(len(self._keys), "advertised keys")
        return {
            u: PeerKeys(
                self.setup.round,
                {v: self._keys[v] for v in sorted(self.setup.graph[u]) if v in self._keys},
            )
            for u in sorted(self._keys)
        }

    def route_shares(self, messages: Sequence[EncryptedShares]) -> dict[int, Forwarded]:
        """Stage 1: U2 and, for each of its clients, the ciphertexts U2 addressed to it."""
        self._check(messages, self._keys, "share message")
        for m in messages:
            expected = self.setup.graph[m.client] & set(self._keys)
            if set(m.ciphertexts) != expected:
                raise ProtocolError(
                    f"secagg: client {m.client} sent shares to {sorted(m.ciphertexts)}, not "
                    f"to its neighbours with keys {sorted(expected)}"
                )
        self._u2 = {m.client for m in messages}
        self._need(len(self._u2), "shared their keys")
        forwarded: dict[int, dict[int, bytes]] = {j: {} for j in sorted(self._u2)}
        for m in sorted(messages, key=lambda m: m.client):
            for receiver, ciphertext in m.ciphertexts.items():
                if receiver in self._u2:
                    forwarded[receiver][m.client] = ciphertext
        return {j: Forwarded(self.setup.round, cts) for j, cts in forwarded.items()}

    def collect_masked(self, inputs: Sequence[MaskedInput]) -> dict[int, UnmaskRequest]:
        """Stage 2: U3, the running sum of the y, and each survivor's unmasking request."""
        self._check(inputs, self._u2, "masked input")
        bits, dim = self.setup.bits, self.setup.dim
        total = np.zeros(dim, dtype=np.uint64)
        for m in inputs:
            y = m.masked
            if y.dtype != np.uint64 or y.shape != (dim,) or np.any(y > modulus_mask(bits)):
                raise ProtocolError(
                    f"secagg: client {m.client}'s masked input is not {dim} integers mod 2^{bits}"
                )
            self.received[m.client] = y
            np.add(total, y, out=total)
        self._u3 = {m.client for m in inputs}
        self._need(len(self._u3), "sent a masked input")
        self._sum = total
        dropped = self._u2 - self._u3
        return {
            u: UnmaskRequest(
                self.setup.round,
                tuple(sorted(self.setup.group(u) & self._u3)),
                tuple(sorted(self.setup.graph[u] & dropped)),
            )
            for u in sorted(self._u3)
        }

    def finish(self, responses: Sequence[UnmaskResponse]) -> SecAggResult:
        """Stage 3: the self-masks and the dropped clients' pairwise masks rebuilt from the
        shares, removed from the sum; the exact sum of U3's quantized inputs."""
        if self._sum is None:
            raise ProtocolError("secagg: the server has no masked inputs to unmask")
        self._check(responses, self._u3, "unmasking response")
        self._need(len(responses), "answered the unmasking")
        setup, t = self.setup, self.setup.threshold
        b_shares: dict[int, list[Share]] = {u: [] for u in self._u3}
        key_shares: dict[int, list[Share]] = {v: [] for v in self._u2 - self._u3}
        for r in responses:
            for kind, got, wanted in (
                ("self-mask", r.self_mask_shares, b_shares),
                ("key", r.key_shares, key_shares),
            ):
                for peer, share in got.items():
                    if peer not in wanted or r.client not in setup.group(peer):
                        raise ProtocolError(
                            f"secagg: client {r.client} sent a {kind} share of client {peer}, "
                            f"which was not asked for"
                        )
                    if share.x != _share_id(r.client):
                        raise ProtocolError(
                            f"secagg: client {r.client}'s {kind} share of {peer} has another id"
                        )
                    wanted[peer].append(share)
        bits, dim, round_ = setup.bits, setup.dim, setup.round
        total = self._sum.copy()
        for u in sorted(self._u3):
            b_u = combine(self._enough(b_shares[u], u, "self-mask"), t)
            add_signed(total, expand(b_u, round_, dim, bits, SELF_MASK), -1)
        for v in sorted(key_shares):
            partners = sorted(setup.graph[v] & self._u3)
            if not partners:
                continue
            secret = combine(self._enough(key_shares[v], v, "key"), t)
            keys = KeyPair.from_private_bytes(secret)
            if keys.public != self._keys[v][0]:
                raise ProtocolError(
                    f"secagg: client {v}'s mask key rebuilt from shares does not match the "
                    f"public key it advertised (a corrupt share)"
                )
            for u in partners:
                seed = pair_seed(keys.private, self._keys[u][0])
                # y_u holds pair_sign(u, v)·PRG(s_uv): take it out
                add_signed(total, expand(seed, round_, dim, bits, PAIR_MASK), -pair_sign(u, v))
        exact = (total & modulus_mask(bits)).astype(np.int64)
        quantizer = setup.quantizer
        survivors = tuple(sorted(self._u3))
        answered = {r.client for r in responses}
        return SecAggResult(
            total=exact,
            sum=quantizer.dequantize_sum(exact, len(survivors)),
            survivors=survivors,
            dropouts=tuple(sorted(self._u2 - self._u3)),
            left_out=tuple(sorted(set(setup.clients) - self._u2)),
            silent=tuple(sorted(self._u3 - answered)),
            error_bound=quantizer.error_bound(len(survivors)),
        )

    def _enough(self, shares: list[Share], client: int, kind: str) -> list[Share]:
        if len(shares) < self.setup.threshold:
            raise ProtocolError(
                f"secagg: {len(shares)} {kind} shares of client {client} arrived, fewer than "
                f"the threshold t = {self.setup.threshold}: too many of its neighbours "
                f"dropped out to unmask the sum"
            )
        return shares


# --- one round in process -------------------------------------------------------------

#: stage name → client → bytes sent up (client → server) and down (server → client)
Traffic = dict[str, dict[int, dict[str, int]]]


@dataclass
class RoundOutcome:
    """A round run in process: the server's result, the bytes each client sent and
    received at each stage, and the parties (for inspection)."""

    result: SecAggResult
    traffic: Traffic
    server: SecAggServer
    clients: dict[int, SecAggClient] = field(default_factory=dict)

    def mean_bytes(self, stage: str) -> tuple[float, float]:
        """Mean (up, down) bytes per client that took part in ``stage``."""
        rows = list(self.traffic[stage].values())
        if not rows:
            return 0.0, 0.0
        return (
            float(np.mean([r["up"] for r in rows])),
            float(np.mean([r["down"] for r in rows])),
        )


def run_round(
    inputs: Mapping[int, ArrayLike],
    config: SecAggConfig,
    round_: int = 0,
    dropouts: Mapping[int, int] | None = None,
    rng: np.random.Generator | None = None,
    graph_seed: bytes | None = None,
    transport: Callable[[Any], Any] | None = None,
) -> RoundOutcome:
    """Run one round among the clients of ``inputs`` (client id → float vector), every
    message passing through the server. ``dropouts`` maps a client to the stage (0 to 3,
    :data:`STAGES`) from which it sends nothing more: 0 never advertises keys, 1 does not
    share them, 2 sends no masked input, 3 does not answer the unmasking. A refusal, by
    the server or by a client (a neighbourhood with fewer than t holders), ends the round
    with its :class:`ProtocolError`; a deployment would count such a client as dropped.
    ``transport`` carries every message (e.g. to its bytes and back,
    :func:`fedloom.secagg.wire.pack` and ``unpack``); by default, the object itself."""
    send: Callable[[Any], Any] = transport or (lambda message: message)
    dropouts = dict(dropouts or {})
    if bad := {c: s for c, s in dropouts.items() if c not in inputs or not 0 <= s <= 3}:
        raise ValueError(f"secagg: drop-outs {bad} (clients of the round, at stages 0 to 3)")
    vectors = {c: np.asarray(x, dtype=np.float64).reshape(-1) for c, x in inputs.items()}
    dims = {v.shape[0] for v in vectors.values()}
    if len(dims) != 1:
        raise ValueError(f"secagg: inputs of different lengths {sorted(dims)}")
    setup = setup_round(config, sorted(vectors), round_, dims.pop(), graph_seed)
    parent = np.random.default_rng() if rng is None else rng
    streams = parent.spawn(len(setup.clients))
    server = SecAggServer(setup)
    traffic: Traffic = {name: {} for name in STAGES}

    def alive(stage: int) -> list[int]:
        return [c for c in setup.clients if dropouts.get(c, 4) > stage]

    def count(stage: int, client: int, up: int = 0, down: int = 0) -> None:
        row = traffic[STAGES[stage]].setdefault(client, {"up": 0, "down": 0})
        row["up"] += up
        row["down"] += down

    for c in setup.clients:
        count(0, c, down=setup.nbytes())
    setup_sent = send(setup)
    clients = {c: SecAggClient(c, setup_sent, g) for c, g in zip(setup.clients, streams)}
    adverts = [send(clients[c].advertise()) for c in alive(0)]
    for a in adverts:
        count(0, a.client, up=a.nbytes())
    peer_keys = server.collect_keys(adverts)
    for c, keys in peer_keys.items():
        count(0, c, down=keys.nbytes())
    shared = [send(clients[c].share_keys(send(peer_keys[c]))) for c in alive(1) if c in peer_keys]
    for m in shared:
        count(1, m.client, up=m.nbytes())
    forwarded = server.route_shares(shared)
    for c, relayed in forwarded.items():
        count(1, c, down=relayed.nbytes())
    masked = [
        send(clients[c].masked_input(send(forwarded[c]), vectors[c]))
        for c in alive(2)
        if c in forwarded
    ]
    for y in masked:
        count(2, y.client, up=y.nbytes())
    requests = server.collect_masked(masked)
    for c, request in requests.items():
        count(3, c, down=request.nbytes())
    responses = [send(clients[c].unmask(send(requests[c]))) for c in alive(3) if c in requests]
    for r in responses:
        count(3, r.client, up=r.nbytes())
    return RoundOutcome(server.finish(responses), traffic, server, clients)

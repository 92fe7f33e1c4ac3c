"""A client's side of SecAgg / SecAgg+ (:mod:`fedloom.secagg.protocol` says the protocol
and what a client checks rather than trust the server): :class:`SecAggClient`."""

from __future__ import annotations

import secrets

import numpy as np
from numpy.typing import ArrayLike

from fedloom.secagg.keys import (
    KeyPair,
    decrypt,
    encrypt,
    encryption_key,
    pair_seed,
)
from fedloom.secagg.masks import (
    UInts,
    mask_input,
    modulus_mask,
)
from fedloom.secagg.messages import (
    ClientRefusal,
    EncryptedShares,
    Forwarded,
    KeyAdvert,
    MaskedInput,
    PeerKeys,
    ProtocolError,
    RoundSetup,
    UnmaskRequest,
    UnmaskResponse,
    share_id,
)
from fedloom.secagg.shamir import Share, split


def _pack(b_share: Share, key_share: Share) -> bytes:
    return b_share.to_bytes() + key_share.to_bytes()


def _unpack(data: bytes) -> tuple[Share, Share]:
    if len(data) % 2:
        raise ProtocolError(f"secagg: a share bundle of {len(data)} bytes is malformed")
    half = len(data) // 2
    return Share.from_bytes(data[:half]), Share.from_bytes(data[half:])


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
        ids = [share_id(c) for c in holders]
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
            if b_share.x != share_id(self.id) or key_share.x != share_id(self.id):
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

"""The server's side of SecAgg / SecAgg+ (:mod:`fedloom.secagg.protocol` says the
protocol): :class:`SecAggServer` routes the clients' messages and unmasks the sum
(:class:`SecAggResult`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from fedloom.secagg.keys import (
    KeyPair,
    pair_seed,
)
from fedloom.secagg.masks import (
    PAIR_MASK,
    SELF_MASK,
    UInts,
    add_signed,
    expand,
    modulus_mask,
    pair_sign,
)
from fedloom.secagg.messages import (
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
from fedloom.secagg.shamir import Share, combine


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
                    if share.x != share_id(r.client):
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

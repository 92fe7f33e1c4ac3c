"""The server's side of a round under secure aggregation: the four stages of SecAgg /
SecAgg+ (:mod:`fedloom.secagg.protocol`), or the three of homomorphic aggregation
(:mod:`fedloom.homomorphic.protocol`), as message rounds with the clients' hosts.

After local training each client holds its update on its host (its :class:`SecureClient`;
only the number of examples and the training metrics came back). The server announces the
round (:meth:`SecureSum.setup`), then every stage is one call of the hosts' ``exchange``
(in process, on each Ray actor for the clients it owns, or a Flower message round): the keys
advertised, the encrypted shares routed, the masked inputs summed, the shares needed to
unmask collected. What the server holds at the end is the sum (:class:`SecAggResult`);
the byte counts are those of the protocol's wire encoding, per client and direction.

A client that stops answering at a stage is a drop-out of the protocol: before sharing
its keys it is left out cleanly; after, its pairwise masks are rebuilt from its
neighbours' shares (``dropouts``). The simulated faults' mid-round drop-outs
(``faults.dropout``) stop after sharing keys, the case the recovery exists for. Too few
survivors for the threshold end the round's secure sum with the protocol's error, which
leaves every client of the round out.

Homomorphic aggregation: the key holder is asked for the round's public key ("keys"),
every client encrypts its input under it ("encrypt"), the server adds what arrived and the
key holder decrypts the sum ("decrypt"). A client that sends no ciphertexts is a drop-out
that is simply not summed (``dropouts``, nothing to recover); a key holder that stops
answering ends the round's secure sum, naming it.

The client's step of both protocols is :class:`SecureClient`, written here once: a runtime
implements the exchange (``Clients.exchange``: the stage's messages delivered, each
client's :meth:`SecureClient.answer` returned), not secure aggregation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedloom.homomorphic import HomomorphicServer, HomomorphicSetup, KeyHolder, encrypt_input
from fedloom.params import Params
from fedloom.secagg import (
    ProtocolError,
    RoundSetup,
    SecAggClient,
    SecAggResult,
    SecAggServer,
    ShareAuthenticationError,
)
from fedloom.secagg.messages import STAGES

if TYPE_CHECKING:
    from fedloom.runtime.clients import Clients
    from fedloom.transforms.secure_sum import SecureSum


@dataclass
class SecureRound:
    """One round's secure sum: the result (None when the protocol failed), the setup, the
    clients missing from the sum and why, and the protocol's bytes per client."""

    setup: RoundSetup | HomomorphicSetup
    result: SecAggResult | None
    missing: dict[int, str] = field(default_factory=dict)
    bytes_up: dict[int, int] = field(default_factory=dict)
    bytes_down: dict[int, int] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The train row's entries: ``secagg_dropouts`` (the clients that dropped out
        mid-protocol: SecAgg recovered their masks, homomorphic aggregation left them out of
        the sum) and the protocol's counts (SecAgg's k and t, or the key holder and
        Paillier's key size)."""
        r, setup = self.result, self.setup
        if isinstance(setup, RoundSetup):
            params: dict[str, Any] = {"neighbours": setup.neighbours, "threshold": setup.threshold}
        else:
            params = {"key_holder": setup.key_holder}
            if setup.protocol == "paillier":
                params["key_bits"] = setup.key_bits
        return {
            "secagg_dropouts": len(r.dropouts) if r else 0,
            "secagg": {
                "protocol": setup.protocol,
                "clients": len(setup.clients),
                "summed": len(r.survivors) if r else 0,
                "dropouts": list(r.dropouts) if r else [],
                "left_out": list(r.left_out) if r else [],
                **params,
                "quant_bits": setup.quant_bits,
                "bytes_up": sum(self.bytes_up.values()),
                "bytes_down": sum(self.bytes_down.values()),
            },
        }


def _count(messages: Mapping[int, Any], into: dict[int, int]) -> None:
    """Add each message's wire bytes to its client's count in ``into``."""
    for cid, message in messages.items():
        into[cid] = into.get(cid, 0) + message.nbytes()


def run(
    host: Clients, secure: SecureSum, weights: Mapping[int, int], round_: int, dim: int
) -> SecureRound:
    """The protocol among the clients of ``weights`` (client → w_k), each holding its
    update on ``host``."""
    setup = secure.setup(weights, round_, dim)
    if isinstance(setup, HomomorphicSetup):
        return _homomorphic(host, setup)
    out = SecureRound(setup, None)
    server = SecAggServer(setup)
    for cid in setup.clients:
        out.bytes_down[cid] = setup.nbytes()
    try:
        adverts = host.exchange(round_, STAGES[0], {c: setup for c in setup.clients})
        _count(adverts, out.bytes_up)
        peer_keys = server.collect_keys(list(adverts.values()))
        _count(peer_keys, out.bytes_down)
        shared = host.exchange(round_, STAGES[1], peer_keys)
        _count(shared, out.bytes_up)
        forwarded = server.route_shares(list(shared.values()))
        _count(forwarded, out.bytes_down)
        masked = host.exchange(round_, STAGES[2], forwarded)
        _count(masked, out.bytes_up)
        requests = server.collect_masked(list(masked.values()))
        _count(requests, out.bytes_down)
        responses = host.exchange(round_, STAGES[3], requests)
        _count(responses, out.bytes_up)
        out.result = server.finish(list(responses.values()))
    except ProtocolError as err:
        out.missing = {cid: f"secure aggregation failed: {err}" for cid in setup.clients}
        return out
    result = out.result
    for cid in result.left_out:
        out.missing[cid] = "left out of secure aggregation (stopped before sharing its keys)"
    for cid in result.dropouts:
        out.missing[cid] = (
            "dropped out of secure aggregation after sharing its keys (its masks recovered)"
        )
    return out


def _homomorphic(host: Clients, setup: HomomorphicSetup) -> SecureRound:
    """Homomorphic aggregation among the clients of ``setup``, each holding its update on
    ``host``."""
    out = SecureRound(setup, None)
    server, holder, round_ = HomomorphicServer(setup), setup.key_holder, setup.round
    out.bytes_down[holder] = setup.nbytes()
    try:
        keys = host.exchange(round_, "keys", {holder: setup})
        _count(keys, out.bytes_up)
        requests = server.announce(keys)
        _count(requests, out.bytes_down)
        encrypted = host.exchange(round_, "encrypt", requests)
        _count(encrypted, out.bytes_up)
        to_decrypt = server.add(list(encrypted.values()))
        _count(to_decrypt, out.bytes_down)
        decrypted = host.exchange(round_, "decrypt", to_decrypt)
        _count(decrypted, out.bytes_up)
        out.result = server.finish(decrypted)
    except ProtocolError as err:
        out.missing = {cid: f"secure aggregation failed: {err}" for cid in setup.clients}
        return out
    for cid in out.result.dropouts:
        out.missing[cid] = (
            "dropped out of homomorphic aggregation before sending its ciphertexts (not in the sum)"
        )
    return out


@dataclass
class SecureClient:
    """One client's side of a round's secure sum: the update it holds until it leaves
    masked or encrypted (its update, the start it trained from, its examples), its side of
    SecAgg or the key pair it draws as homomorphic aggregation's key holder, and the stage
    from which it answers nothing (a simulated drop-out, or a message it refused)."""

    secure: SecureSum
    client_id: int
    held: tuple[Params, Params, int] | None = None
    stops_at: int | None = None
    secagg: SecAggClient | None = None
    keys: KeyHolder | None = None

    def answer(self, stage: str, message: Any) -> Any | None:
        """The client's answer to ``message`` at ``stage``; None when it answers no more.
        SecAgg: at "advertise" it opens its side of the round (:class:`SecAggClient`, fresh
        keys) from the announced setup; at "mask" it encodes the update it holds
        (:meth:`SecureSum.encode`) and masks it. Homomorphic aggregation: at "keys" the key
        holder draws the round's key pair (:class:`KeyHolder`); at "encrypt" the client
        encodes its update and encrypts it; at "decrypt" the key holder decrypts the sum. A
        message the client refuses (:class:`ProtocolError`) stops it there."""
        stages = self.secure.stages
        if stage not in stages:
            raise ValueError(f"secagg: {stage!r} is not a stage of {list(stages)}")
        if self.stops_at is not None and self.stops_at <= stages.index(stage):
            return None
        try:
            return self._answer(stage, message)
        except (ProtocolError, ShareAuthenticationError):
            self.stops_at = stages.index(stage)
            return None

    def _answer(self, stage: str, message: Any) -> Any:
        cid = self.client_id
        if stage == "advertise":
            self.secagg = SecAggClient(cid, message)
            return self.secagg.advertise()
        if stage == "keys":
            self.keys = KeyHolder(cid, message)
            return self.keys.public_context()
        if stage == "decrypt":
            if self.keys is None:
                raise ProtocolError(f"homomorphic: client {cid} holds no key to decrypt with")
            return self.keys.decrypt(message)
        if stage == "encrypt":
            return encrypt_input(cid, message, self._input(message.setup))
        if self.secagg is None:
            raise ProtocolError(f"secagg: client {cid} was sent {stage!r} before the setup")
        if stage == "share":
            return self.secagg.share_keys(message)
        if stage == "mask":
            return self.secagg.masked_integers(message, self._input(self.secagg.setup))
        return self.secagg.unmask(message)

    def _input(self, setup: RoundSetup | HomomorphicSetup) -> Any:
        """x_k, the encoding of the update the client holds (which leaves it only now)."""
        if self.held is None:
            raise ProtocolError(f"secagg: client {self.client_id} holds no update to send")
        (update, start, examples), self.held = self.held, None
        return self.secure.encode(
            update, start, self.secure.weight(examples), self.client_id, setup
        )

"""Downlink compression: the server sends each client the difference between its payload
and what that client already holds, through a compression operator, as bytes.

Both sides keep client k's reference x̂_k, the last payload it rebuilt (the server in its
state, the client in its local state). In a round the server sends C(x_k − x̂_k); both
set x̂_k ← x̂_k + C(x_k − x̂_k), and the client trains from x̂_k. What compression dropped
stays in the next difference x_k − x̂_k: the server's error feedback, in the form of
EF21-P (Gruntkowska, Tyurin & Richtárik 2023, "EF21-P and Friends": the broadcast model is
a compressed, error-compensated estimate of the server's). A client without a reference
(its first round, or a payload whose tensors changed) receives its payload in full.

Per client, because payloads are per client (relevance-weighted and clustered methods),
and because a sampled client missed every round it was not sampled for: a reference per
client is the only one both sides know. Both references change only when the round is
kept with the client's update (:meth:`CompressDown.commit`, when the runtime commits the
client's local state): a client left out of a round keeps its old reference on both
sides. The references are the server's state, in every resumable checkpoint.

Only floating-point tensors are compressed (the shared adapter, a method's extras such as
SCAFFOLD's c); the update is decoded against x̂_k, what the client trained from. The
recursion needs a contractive operator: an unbiased one is used as C/(ω + 1)
(:mod:`fedloom.comm.message`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fedloom.comm import message
from fedloom.comm.settings import CompressionSettings
from fedloom.params import Params
from fedloom.transforms.base import Broadcast, Stage, Transform
from fedloom.transforms.compress import NAMES, compress_generator, masked_names, names_mask

#: keeps the broadcast's random draws apart from the clients' uplink ones
DOWNLINK_SALT = 0xD0C0DE
#: where the client keeps its reference in this transform's part of its state
REFERENCE = "reference"


def _floats(params: Params) -> list[str]:
    return sorted(n for n, t in params.items() if t.is_floating_point())


def _fits(reference: Params, payload: Params, names: list[str]) -> bool:
    return sorted(reference) == names and all(reference[n].shape == payload[n].shape for n in names)


@dataclass(frozen=True)
class CompressDown(CompressionSettings, Transform):
    name: ClassVar[str] = "compress_down"
    stage: ClassVar[Stage] = "compress"
    #: the experiment's seed (set by the chain, not a key)
    seed: int = 0

    def __post_init__(self) -> None:
        self.operator  # noqa: B018 - built now: a mistake names its key

    @property
    def keeps_client_state(self) -> bool:
        """The client keeps its reference x̂_k."""
        return True

    def init_state(self) -> Mapping[str, Any]:
        return {"references": {}, "pending": {}}

    def check_model(self, shared: Params, personal: Sequence[str]) -> None:
        """k no larger than the number of values sent, a rank that compresses a matrix."""
        message.check(shared, _floats(shared), self.operator)

    def broadcast(
        self, payloads: dict[int, Params], round_: int, state: Mapping[str, Any]
    ) -> Broadcast:
        compressor = self.operator
        references: Mapping[str, Params] = state.get("references", {})
        sent: dict[int, Params] = {}
        starts: dict[int, Params] = {}
        pending: dict[str, Params] = {}
        for cid, payload in payloads.items():
            names = _floats(payload)
            reference = references.get(str(cid))
            if reference is None or not _fits(reference, payload, names):
                sent[cid], starts[cid] = payload, payload
            else:
                delta = {n: payload[n].float() - reference[n].float() for n in names}
                generator = compress_generator(self.seed, round_, cid, DOWNLINK_SALT)
                wire = message.encode(delta, compressor, generator, contractive=True)
                rebuilt = _add(reference, message.decode(wire, delta, compressor))
                rest = {n: t for n, t in payload.items() if n not in delta}
                sent[cid] = {**rest, **wire, NAMES: names_mask(names, names)}
                starts[cid] = {**rest, **rebuilt}
            pending[str(cid)] = {n: starts[cid][n] for n in names}
        return Broadcast(sent, starts, {"references": dict(references), "pending": pending})

    def down(self, payload: Params, client_id: int, round_: int, state: dict[str, Any]) -> Params:
        if NAMES not in payload:  # sent in full
            state[REFERENCE] = {n: payload[n] for n in _floats(payload)}
            return payload
        reference: Params = state[REFERENCE]
        names = masked_names(sorted(reference), payload[NAMES])
        delta = message.decode(payload, {n: reference[n] for n in names}, self.operator)
        rebuilt = _add(reference, delta)
        state[REFERENCE] = rebuilt
        rest = {n: t for n, t in payload.items() if not n.startswith(message.WIRE)}
        return {**rest, **rebuilt}

    def commit(self, state: Mapping[str, Any], accepted: Sequence[int]) -> Mapping[str, Any]:
        pending = state.get("pending", {})
        references = dict(state.get("references", {}))
        for cid in accepted:
            if str(cid) in pending:
                references[str(cid)] = pending[str(cid)]
        return {"references": references, "pending": {}}


def _add(reference: Params, delta: Params) -> Params:
    """x̂ + C(x − x̂), in the reference's dtype."""
    return {
        n: (reference[n].float() + delta[n].float().to(reference[n].device)).to(reference[n].dtype)
        for n in delta
    }

"""The transform chain: middleware on the ``Params`` that cross the client/server boundary.

One round, where a transform acts (DESIGN.md's data flow)::

    server  payload ─────────────────────────────► client  down(payload)
                                                           local_train
    server  server(updates) ◄─────────────────────  client  up(update)

A transform belongs to one stage, and the chain holds them in the stages' order
(:data:`STAGES`: clip ► compress ► noise ► mask; docs/privacy.md says why this order).
``up`` runs on the client in the chain's order; what it returns is what travels and what
``bytes_up`` counts. ``server`` runs on the server in the reverse order, on all of a
round's updates at once (secure aggregation unmasks a sum), before the update checks and
the aggregation: each stage undoes its own encoding, and the clip stage, last, is where a
trusted server clips and noises (DP-FedAvg's server half, after every update is decoded).
``down`` turns a payload into what the client trains from.

State, as TensorFlow Federated's aggregation processes keep it:

* server state (:meth:`Transform.init_state`): a few numbers the server carries from one
  round to the next (the adaptive clipping norm), passed to ``server`` and returned new;
  the run keeps the state of the round it accepted, in its checkpoints;
* client state: ``up``'s ``state`` is the transform's own part of the client's local state
  (error-feedback residuals), kept with the client's other state (committed with the round,
  saved in checkpoints);
* measurements: what ``server`` reports of a round (the norm it clipped to, the noise it
  added), for the round's row of ``metrics.jsonl``.

A stage that cannot take a client's update (an encoding that does not decode) leaves it
out of the updates it passes on and says why (``Served.rejected``); the runtime logs the
client as rejected, like an update that fails the server's checks.

The chain lives in the experiment, so the local, Ray and Flower runtimes run it alike: the
client half in :class:`~fedloom.runtime.clients.ClientHost`, the server half in
:func:`fedloom.runtime.local._train_round`. The empty chain is the identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fedloom.params import Params

Stage = Literal["clip", "compress", "noise", "mask"]
#: the stages in the order they act on the way up
STAGES: tuple[Stage, ...] = ("clip", "compress", "noise", "mask")
#: where a transform keeps its part of a client's local state
STATE_KEY = "transforms"


@dataclass(frozen=True)
class Served:
    """The server half's answer: the updates as the next stage (and at the end the
    aggregation) sees them, the transform's new server state, its measurements, and the
    clients whose update it could not take (an undecodable encoding), each with why."""

    updates: dict[int, Params]
    state: Mapping[str, Any] = field(default_factory=dict)
    measurements: Mapping[str, Any] = field(default_factory=dict)
    rejected: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Transform:
    """The identity; a transform overrides the hooks it needs."""

    name: ClassVar[str] = "identity"
    stage: ClassVar[Stage] = "compress"

    def down(self, payload: Params, client_id: int, round_: int) -> Params:
        """What the client trains from, given the ``payload`` it received."""
        return payload

    def up(
        self,
        update: Params,
        payload: Params,
        client_id: int,
        round_: int,
        state: dict[str, Any],
    ) -> Params:
        """What the client sends for ``update`` (it was sent ``payload``); ``state`` is
        this transform's part of the client's local state, to read and change in place."""
        return update

    def init_state(self) -> Mapping[str, Any]:
        """The server state before the first round (numbers; empty when stateless)."""
        return {}

    def check_model(self, shared: Params, personal: Sequence[str]) -> None:
        """Refuse settings the model cannot satisfy, given the tensors the method sends
        (``shared``, as built) and the names of those it keeps ``personal``: a
        ``ValueError`` starting with the key. Nothing to check by default."""

    def server(
        self,
        updates: dict[int, Params],
        payloads: dict[int, Params],
        round_: int,
        state: Mapping[str, Any],
    ) -> Served:
        """The round's updates as the aggregation sees them, from what arrived."""
        return Served(updates, state)


@dataclass(frozen=True)
class Chain:
    """Transforms applied in order on the way up and in reverse on the way back."""

    transforms: Sequence[Transform] = ()

    def down(self, payload: Params, client_id: int, round_: int) -> Params:
        for t in reversed(self.transforms):
            payload = t.down(payload, client_id, round_)
        return payload

    def up(
        self,
        update: Params,
        payload: Params,
        client_id: int,
        round_: int,
        state: dict[str, Any] | None = None,
    ) -> Params:
        """The client half; ``state`` is the client's whole local state (None: a scratch
        one), whose ``transforms`` entry holds each transform's part by name."""
        kept = (state or {}).get(STATE_KEY, {})
        new: dict[str, Any] = {}
        for t in self.transforms:
            own = dict(kept.get(t.name, {}))
            update = t.up(update, payload, client_id, round_, own)
            if own:
                new[t.name] = own
        if state is not None and (new or STATE_KEY in state):
            state[STATE_KEY] = new
        return update

    def init_state(self) -> tuple[Mapping[str, Any], ...]:
        return tuple(t.init_state() for t in self.transforms)

    def server(
        self,
        updates: dict[int, Params],
        payloads: dict[int, Params],
        round_: int,
        states: Sequence[Mapping[str, Any]] | None = None,
    ) -> Served:
        """The server half; ``states`` the transforms' server states (None: the initial
        ones). The answer's ``state`` is ``{"states": [...]}`` in the chain's order and its
        measurements are keyed by transform name."""
        states = list(self.init_state() if states is None else states)
        measurements: dict[str, Any] = {}
        rejected: dict[int, str] = {}
        for i in reversed(range(len(self.transforms))):
            t = self.transforms[i]
            served = t.server(updates, payloads, round_, states[i])
            updates, states[i] = served.updates, served.state
            rejected.update(served.rejected)
            if served.measurements:
                measurements[t.name] = dict(served.measurements)
        return Served(updates, {"states": states}, measurements, rejected)

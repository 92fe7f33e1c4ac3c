"""The transform chain: middleware on the ``Params`` that cross the client/server boundary.

One round, where a transform acts (docs/architecture.md, "One round")::

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
A simulated attacker sends its forgery through the client half like any update
(:func:`fedloom.server.round.send_forgeries`), so every stage acts on it as on a real
attacker's message. ``down`` turns a payload into what the client trains from.

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
:func:`fedloom.server.round.train_round`. The empty chain is the identity.
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
class Broadcast:
    """The server half's answer on the way down: ``sent`` travels to each client,
    ``starts`` is what each client rebuilds from it and trains from (the reference its
    update is decoded against), ``state`` the server state after sending."""

    sent: dict[int, Params]
    starts: dict[int, Params]
    state: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Transform:
    """The identity; a transform overrides the hooks it needs."""

    name: ClassVar[str] = "identity"
    stage: ClassVar[Stage] = "compress"
    #: its server half releases a differentially private mechanism's output, and its
    #: measurements of a round are that round's DP event (a ``noise_multiplier``), which
    #: the run's privacy ledger accounts (:mod:`fedloom.privacy.ledger`)
    releases_dp_event: ClassVar[bool] = False

    # --- what it promises and needs, checked by fedloom.composition ---------------------
    #: after this stage the server holds only the sum of the round's updates, never one
    #: client's (secure aggregation)
    hides_individual_updates: ClassVar[bool] = False
    #: what its client half sends is an encoding of the update as bytes, not its values:
    #: only its own server half reads it
    encodes_bytes: ClassVar[bool] = False
    #: its client half computes on the values of the update it is given (adds noise to
    #: them, quantizes them), so no stage before it may have encoded them as bytes
    needs_values: ClassVar[bool] = False
    #: what it promises holds only when the aggregation is a mean of the updates (DP's
    #: noise is calibrated to a mean; a secure sum gives the server a sum and nothing more)
    needs_a_mean: ClassVar[bool] = False
    #: its client half bounds the norm of each update it sends
    bounds_norm: ClassVar[bool] = False

    @property
    def needs_each_update(self) -> bool:
        """Whether its server half works on each client's update (decodes it, casts it
        back, clips it), so no later stage may hide the individual updates."""
        return False

    @property
    def keeps_client_state(self) -> bool:
        """Whether the client half needs the client's persistent local state (error
        feedback, a downlink reference): without one, :class:`Chain` refuses to run it."""
        return False

    def broadcast(
        self, payloads: dict[int, Params], round_: int, state: Mapping[str, Any]
    ) -> Broadcast:
        """The server half on the way down: what travels to each client for its
        ``payloads``, what the client will rebuild from it, and the new server state."""
        return Broadcast(payloads, payloads, state)

    def down(self, payload: Params, client_id: int, round_: int, state: dict[str, Any]) -> Params:
        """What the client trains from, given the ``payload`` it received; ``state`` is
        this transform's part of the client's local state, to read and change in place."""
        return payload

    def up(
        self,
        update: Params,
        payload: Params,
        client_id: int,
        round_: int,
        state: dict[str, Any],
    ) -> Params:
        """What the client sends for ``update`` (it trained from ``payload``); ``state`` is
        this transform's part of the client's local state, to read and change in place."""
        return update

    def init_state(self) -> Mapping[str, Any]:
        """The server state before the first round (empty when stateless)."""
        return {}

    def commit(self, state: Mapping[str, Any], accepted: Sequence[int]) -> Mapping[str, Any]:
        """The server state once the round is kept with the updates of ``accepted``: the
        clients whose local states the runtime commits too (none when the round was
        skipped). Server and client states that track each other change together here."""
        return state

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

    @property
    def mask(self) -> Transform | None:
        """The mask stage (secure aggregation), whose client half the runtime drives as
        message rounds after training: the clients' updates then reach the server only
        as a sum."""
        return next((t for t in self.transforms if t.stage == "mask"), None)

    def broadcast(
        self,
        payloads: dict[int, Params],
        round_: int,
        states: Sequence[Mapping[str, Any]] | None = None,
    ) -> Broadcast:
        """The server half on the way down: what travels, what the clients rebuild from it
        (one stage at most encodes the broadcast), and ``{"states": [...]}``."""
        states = list(self.init_state() if states is None else states)
        sent, starts = payloads, payloads
        for i, t in enumerate(self.transforms):
            cast = t.broadcast(sent, round_, states[i])
            if cast.sent is not sent:
                starts = cast.starts
            sent, states[i] = cast.sent, cast.state
        return Broadcast(sent, starts, {"states": states})

    def down(
        self,
        payload: Params,
        client_id: int,
        round_: int,
        state: dict[str, Any] | None = None,
    ) -> Params:
        """The client half on the way down; ``state`` is the client's whole local state
        (None: a scratch one), whose ``transforms`` entry holds each transform's part."""
        parts = _parts(state, self.transforms)
        for t in reversed(self.transforms):
            payload = t.down(payload, client_id, round_, parts.setdefault(t.name, {}))
        _keep(state, parts)
        return payload

    def commit(
        self, states: Sequence[Mapping[str, Any]], accepted: Sequence[int]
    ) -> list[Mapping[str, Any]]:
        """Each transform's :meth:`Transform.commit`."""
        return [t.commit(s, accepted) for t, s in zip(self.transforms, states)]

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
        parts = _parts(state, self.transforms)
        for t in self.transforms:
            update = t.up(update, payload, client_id, round_, parts.setdefault(t.name, {}))
        _keep(state, parts)
        return update

    def init_state(self) -> tuple[Mapping[str, Any], ...]:
        return tuple(t.init_state() for t in self.transforms)

    def dp_events(self, measurements: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
        """The round's DP events in the server half's ``measurements``: those of each
        stage that :attr:`~Transform.releases_dp_event` and released this round."""
        return {
            t.name: measurements[t.name]
            for t in self.transforms
            if t.releases_dp_event and t.name in measurements
        }

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


def _parts(
    state: dict[str, Any] | None, transforms: Sequence[Transform]
) -> dict[str, dict[str, Any]]:
    """A copy of each transform's part of a client's local ``state``, by name; a
    ``ValueError`` without a state when one of ``transforms`` keeps client state."""
    if state is None and (needy := [t.name for t in transforms if t.keeps_client_state]):
        raise ValueError(
            f"{needy[0]} keeps state on the client (error feedback, a downlink reference), "
            f"and was given none: pass the client's persistent local state"
        )
    return {name: dict(part) for name, part in (state or {}).get(STATE_KEY, {}).items()}


def _keep(state: dict[str, Any] | None, parts: dict[str, dict[str, Any]]) -> None:
    """The transforms' non-empty parts written back into ``state`` (when there is one)."""
    kept = {name: part for name, part in parts.items() if part}
    if state is not None and (kept or STATE_KEY in state):
        state[STATE_KEY] = kept

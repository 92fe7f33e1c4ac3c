"""The transform chain: middleware on the ``Params`` that cross the client/server boundary.

One round, where a transform acts (DESIGN.md's data flow)::

    server  payload ─────────────────────────────► client  down(payload)
                                                           local_train
    server  server(updates) ◄─────────────────────  client  up(update)

``up`` runs on the client in the chain's order (clip ► compress ► noise ► mask), what it
returns is what travels and what ``bytes_up`` counts; ``server`` undoes it on the server in
the reverse order, on all of a round's updates at once (secure aggregation unmasks a sum),
before the update checks and the aggregation; ``down`` turns a payload into what the
client trains from. The chain lives in the experiment, so the local, Ray and Flower
runtimes run it alike: the client half in :class:`~fedloom.runtime.clients.ClientHost`,
the server half in :func:`fedloom.runtime.local._train_round`. The empty chain is the
identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fedloom.params import Params


@dataclass(frozen=True)
class Transform:
    """The identity; a transform overrides the hooks it needs."""

    name: ClassVar[str] = "identity"

    def down(self, payload: Params, client_id: int, round_: int) -> Params:
        """What the client trains from, given the ``payload`` it received."""
        return payload

    def up(self, update: Params, payload: Params, client_id: int, round_: int) -> Params:
        """What the client sends for ``update`` (it was sent ``payload``)."""
        return update

    def server(
        self, updates: dict[int, Params], payloads: dict[int, Params], round_: int
    ) -> dict[int, Params]:
        """The round's updates as the aggregation sees them, from what arrived."""
        return updates


@dataclass(frozen=True)
class Chain:
    """Transforms applied in order on the way up and in reverse on the way back."""

    transforms: Sequence[Transform] = ()

    def down(self, payload: Params, client_id: int, round_: int) -> Params:
        for t in reversed(self.transforms):
            payload = t.down(payload, client_id, round_)
        return payload

    def up(self, update: Params, payload: Params, client_id: int, round_: int) -> Params:
        for t in self.transforms:
            update = t.up(update, payload, client_id, round_)
        return update

    def server(
        self, updates: dict[int, Params], payloads: dict[int, Params], round_: int
    ) -> dict[int, Params]:
        for t in reversed(self.transforms):
            updates = t.server(updates, payloads, round_)
        return updates

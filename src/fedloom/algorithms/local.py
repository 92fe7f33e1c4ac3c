"""Local training: every client trains its own adapter alone, nothing is shared.

The lower reference of any federated method: a client's score here is what it gets
without collaborating. The server only keeps each client's adapter between rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedloom.algorithms.base import Algorithm, ClientResult, ServerState
from fedloom.algorithms.registry import register
from fedloom.params import Params


@register("local")
@dataclass(frozen=True)
class Local(Algorithm):
    personalized = True
    has_global = False

    def payload(self, state: ServerState, client_id: int) -> Params:
        return state.personal.get(client_id, state.global_params)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        personal = dict(state.personal)
        personal.update({r.client_id: r.params for r in results})
        return self.next_state(state, personal=personal)

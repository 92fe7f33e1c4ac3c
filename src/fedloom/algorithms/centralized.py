"""Centralized training: one party holds every client's training data.

The upper reference of any federated method. The runtime pools the clients' training
splits into a single party (``pools_data``); the server step adopts that party's adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedloom.algorithms.base import Algorithm, ClientResult, ServerState
from fedloom.algorithms.registry import register


@register("centralized")
@dataclass(frozen=True)
class Centralized(Algorithm):
    pools_data = True
    sends = "nothing"

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        (only,) = results
        return self.next_state(state, global_params=only.params)

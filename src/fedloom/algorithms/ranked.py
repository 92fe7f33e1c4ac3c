"""The base of the methods defined on per-client LoRA ranks (``[[model.ranks]]``).

The model is built once at the largest rank r_max; client k of rank r_k holds the first
r_k components of every factor pair, zero beyond
(:func:`~fedloom.algorithms.lora_factors.truncated`). The server keeps every client's rank
in ``ServerState.extra`` and cuts each client's payload to it; a method without a
mixed-rank federation sees no ranks and sends the adapter whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from fedloom.algorithms.base import Algorithm, ServerState
from fedloom.algorithms.lora_factors import RANKS, check_factors, ranks_of, truncated
from fedloom.params import Params


@dataclass(frozen=True)
class RankedLoRA(Algorithm):
    """Payloads cut to each client's LoRA rank; a model without LoRA factors refused."""

    mixed_ranks: ClassVar[bool] = True

    def check_model(self, params: Params) -> None:
        check_factors(params, self.name)

    def init_ranked(self, global_params: Params, ranks: Mapping[int, int]) -> ServerState:
        return ServerState(0, global_params, {RANKS: dict(ranks)})

    def cut(self, state: ServerState, params: Params, client_id: int) -> Params:
        """``params`` cut to client ``client_id``'s rank (whole without one)."""
        rank = ranks_of(state.extra).get(client_id)
        return params if rank is None else truncated(params, rank)

    def payload(self, state: ServerState, client_id: int) -> Params:
        return self.cut(state, state.global_params, client_id)

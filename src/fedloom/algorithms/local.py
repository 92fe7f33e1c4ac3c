"""Local training: every client trains its own adapter alone, nothing is shared.

The lower reference of any federated method: a client's score here is what it gets
without collaborating. Each client starts from the initial adapter the server hands out
and keeps its adapter in its local state (``ctx.state["adapter"]``); it sends nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedloom.algorithms.base import Algorithm, ClientContext, ClientResult, ServerState
from fedloom.algorithms.registry import register
from fedloom.params import Params
from fedloom.train.local import train_locally


@register("local")
@dataclass(frozen=True)
class Local(Algorithm):
    personalized = True
    has_global = False

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        ctx.model.set_params(ctx.state.get("adapter", payload))
        metrics = train_locally(ctx)
        ctx.state["adapter"] = ctx.model.get_params()
        return ClientResult(ctx.client_id, {}, len(ctx.train), metrics)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        return self.next_state(state)

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        return ctx.state.get("adapter", payload)

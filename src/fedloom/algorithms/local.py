"""Local training: every client trains its own adapter alone, nothing is shared.

The lower reference of any federated method: a client's score here is what it gets
without collaborating. Each client starts from the initial adapter the server hands out
and keeps its adapter in its local state (``ctx.state["adapter"]``); it sends nothing.
The server hands the initial adapter to a client only until one of its rounds is accepted
(the clients it has accepted a round from are kept in ``state.extra["holders"]``, so a
resumed run knows them too); after that a client holds its adapter and is sent an empty
payload, and the bytes down count only the first hand-out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fedloom.algorithms.base import Algorithm, ClientContext, ClientResult, ServerState
from fedloom.algorithms.registry import register
from fedloom.params import Params
from fedloom.train.local import train_locally

#: ``ServerState.extra`` entry: the clients that hold an adapter of their own (sorted ids)
HOLDERS = "holders"


@register("local")
@dataclass(frozen=True)
class Local(Algorithm):
    per_example_client_step: ClassVar[bool] = True
    personalized = True
    has_global = False
    sends = "nothing"

    def payload(self, state: ServerState, client_id: int) -> Params:
        return {} if client_id in state.extra.get(HOLDERS, ()) else state.global_params

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        ctx.model.set_params(self.client_adapter(ctx, payload))
        metrics = train_locally(ctx)
        ctx.state["adapter"] = ctx.model.get_params()
        return ClientResult(ctx.client_id, {}, len(ctx.train), metrics)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        holders = {*state.extra.get(HOLDERS, ()), *(r.client_id for r in results)}
        return self.next_state(state, extra={**state.extra, HOLDERS: sorted(holders)})

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        if "adapter" in ctx.state:
            return ctx.state["adapter"]
        if not payload:
            raise RuntimeError(
                f"client {ctx.client_id}: the server counts it as holding its adapter, "
                "but its local state has none (was its state lost?)"
            )
        return payload

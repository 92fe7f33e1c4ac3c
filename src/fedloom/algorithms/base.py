"""The core protocol every algorithm follows (see DESIGN.md).

    state   = alg.init(global_params)            # ServerState
    payload = alg.payload(state, client_id)      # Params the client receives
    result  = alg.local_train(ctx, payload)      # ClientResult
    state   = alg.aggregate(state, results)      # next ServerState (a pure function)

An algorithm is a frozen dataclass whose fields are its hyperparameters; the server step
never touches models, only ``Params``, which keeps checkpoint/resume exact and lets the
same algorithm run unchanged in every runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from fedloom.config import TrainConfig
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature
from fedloom.params import Params


@dataclass(frozen=True)
class ServerState:
    """Everything the server carries from one round to the next."""

    round: int
    global_params: Params
    personal: Mapping[int, Params] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientResult:
    client_id: int
    params: Params
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass
class ClientContext:
    """What a client's local training sees: the shared model, its own data, its
    persistent local state (e.g. optimizer moments) and a seed for this round."""

    client_id: int
    model: FedModel
    train: Sequence[Feature]
    settings: TrainConfig
    round: int
    total_rounds: int
    state: dict[str, Any]
    seed: int


@dataclass(frozen=True)
class Algorithm:
    """Base class: FedAvg-style payload and local training; subclasses define aggregate."""

    name: ClassVar[str] = "base"
    #: keeps an adapter per client (scored on the client's own test split)
    personalized: ClassVar[bool] = False
    #: has a meaningful global adapter (scored on the dev set and every client)
    has_global: ClassVar[bool] = True
    #: trains one party on all clients' data (the centralized reference)
    pools_data: ClassVar[bool] = False

    def init(self, global_params: Params) -> ServerState:
        return ServerState(round=0, global_params=global_params)

    def payload(self, state: ServerState, client_id: int) -> Params:
        return state.global_params

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        from fedloom.train.local import train_locally

        ctx.model.set_params(payload)
        metrics = train_locally(ctx)
        return ClientResult(ctx.client_id, ctx.model.get_params(), len(ctx.train), metrics)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        raise NotImplementedError

    def personal_params(self, state: ServerState, client_id: int) -> Params | None:
        return state.personal.get(client_id)

    @staticmethod
    def next_state(state: ServerState, **changes: Any) -> ServerState:
        return replace(state, round=state.round + 1, **changes)

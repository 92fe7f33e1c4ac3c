"""Partial personalization on one shared base: part of the adapter is shared, the rest
stays on the client (FedPer, LG-FedAvg, FedRep and FedSA-LoRA are this rule with
different splits).

The ``personal`` name patterns (:mod:`fedloom.algorithms.sharing`; ``head`` is every
non-LoRA tensor) split an adapter into a shared part θ_s and a personal part θ_k. In
round t client k

    merges   w_k = (θ_s^t, θ_k)           θ_s^t from the payload, θ_k from ctx.state
    trains   w_k ← local training of w_k
    keeps    θ_k ← the personal part of w_k            (never sent)
    sends    θ_s,k = the shared part of w_k

and the server takes FedAvg's step over the shared names only:
θ_s^{t+1} = combine_k(θ_s,k) (weighted mean, or the robust rule of ``[aggregation] rule``). The
server holds and sends only θ_s; the adapter client k uses is (θ_s^t, θ_k).

A client's personal part starts, on its first participation, from the model's initial
values of those tensors (:attr:`FedModel.initial_params`): every client builds the same
model from the same config and seed, so it knows them without any communication, and
the server's initial θ_s comes from the same build. A shared base with a head nobody
trained is no model, so there is no global adapter to score (``has_global = False``).

``personal`` is overridable from the config: ``[algorithm] personal = ["lora_B", "head"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedloom.algorithms import sharing
from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.params import Params
from fedloom.train.local import train_locally

#: where a client keeps its personal tensors in ctx.state
PERSONAL = "personal"


@dataclass(frozen=True)
class PartialFedAvg(FedAvg):
    """FedAvg over the shared tensors; the tensors ``personal`` selects stay on the client."""

    personalized = True
    has_global = False
    #: name patterns of the personal tensors (a list in the config; kept as a tuple)
    personal: Sequence[str] = ("head",)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "personal", tuple(self.personal))
        if not self.personal:
            raise ValueError("algorithm.personal: name at least one pattern (or use fedavg)")
        sharing.check_patterns(self.personal)

    def split(self, params: Params) -> tuple[Params, Params]:
        """(shared, personal) parts of ``params``."""
        return sharing.split(params, self.personal)

    def check_model(self, params: Params) -> None:
        """``personal`` must select some of the adapter's tensors, and not all of them."""
        shared, mine = self.split(params)
        if not mine:
            raise ValueError(
                f"algorithm.personal: {list(self.personal)} selects no tensor of the adapter "
                f"(names look like {', '.join(map(repr, sample_names(params)))}; "
                f"'{sharing.HEAD}' selects the head)"
            )
        if not shared:
            raise ValueError(
                f"algorithm.personal: {list(self.personal)} selects every tensor, nothing is "
                "shared (that is the local algorithm)"
            )

    def init(self, global_params: Params) -> ServerState:
        return ServerState(round=0, global_params=self.split(global_params)[0])

    def personal_part(self, ctx: ClientContext) -> Params:
        """The client's personal tensors: its own, or the model's initial values."""
        if PERSONAL in ctx.state:
            return ctx.state[PERSONAL]
        return self.split(ctx.model.initial_params)[1]

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        ctx.model.set_params(sharing.merge(payload, self.personal_part(ctx)))
        metrics = self.train(ctx)
        shared, mine = self.split(ctx.model.get_params())
        ctx.state[PERSONAL] = mine
        return ClientResult(ctx.client_id, shared, len(ctx.train), metrics)

    def train(self, ctx: ClientContext) -> dict[str, float]:
        """Local training of the merged adapter set on ``ctx.model`` (FedRep splits it)."""

        return train_locally(ctx)

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        return sharing.merge(payload, self.personal_part(ctx))


def sample_names(params: Params) -> list[str]:
    """The first head tensor's name and the first LoRA factor's, as examples to match."""
    names = sorted(params)
    head = [n for n in names if sharing.is_head(n)][:1]
    return head + [n for n in names if not sharing.is_head(n)][:1]

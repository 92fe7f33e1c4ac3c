"""FedLocal-Global: a global LoRA averaged by FedAvg and a local LoRA that never leaves the
client, both in every adapted layer, mixed per example by a learned gate. This is FedDPA
(Yang, Long, Shen, Jiang & Blumenstein, NeurIPS 2024, "Dual-Personalizing Adapter for
Federated Foundation Models"), its iterative variant FedDPA-T.

Model (:mod:`fedloom.models.dual`, ``[model] adapters = "dual"``, chosen automatically):

    y = W x + g(x) (α/r) B_g A_g x + (1 − g(x)) (α/r) B_l A_l x,    g(x) = σ(v · ê(x) + b)

θ_g = (global LoRA, head) is shared; θ_k = (local LoRA, gate v, b) is client k's own.
In round t, client k receiving θ_g^t:

    personal:  θ_k ← ``personal_steps`` steps on F_k(θ_g^t, θ_k), θ_g^t frozen  (kept in ctx.state)
    global:    θ_g,k ← the round's steps on F_k(θ_g) of the global adapter alone (g ≡ 1),
               from θ_g^t                                                       (sent)
    server:    θ_g^{t+1} = FedAvg.combine(θ_g,k)   (weighted mean, or ``[aggregation] rule``)

As in FedDPA-T, both phases start from the received θ_g^t and take the full local budget
(2x FedAvg's local compute); the global phase is FedAvg's local training of the
single-LoRA model (the pinned gate zeroes the local branch exactly). Client k uses
(θ_g^t, θ_k) for the θ_g^t it holds, and the global adapter alone before it has trained.
The global adapter alone is a model, the one FedDPA reports for its global adapter
(``has_global``): the server scores θ_g with the local LoRA zeroed and the gate pinned to
g ≡ 1 (v = 0, b = +∞), which equals the single-LoRA model with θ_g (tests/test_dual_adapter.py).

Differences from the paper, all about its LLM setting: (1) FedDPA's instance-wise weight
is not learned; its released code weights the local adapter by λ · mean_i cos(h(x), h(x_i))
(λ = 0.5, h the last hidden state, N = 5 random local training inputs x_i) at inference
and trains at a fixed mix of 1/2. Here g is a learned sigmoid gate over the normalized mean
token embedding (:mod:`fedloom.models.gate`; a causal LM's gate reads the prompt, never
the answer it scores), trained with the local adapter and used in training and scoring
alike; it starts at g = 1/2. (2) An encoder's classifier head (FedDPA's LLM head is
frozen, as a decoder's is here) is trained in the global phase and shared with the global
adapter, so θ_g alone is a complete model. (3) FedDPA-T starts local training in round 2; here a
client trains both from its first round.

``personal_steps`` (None: the round's step budget, ``train.local_steps`` or
``local_epochs``, as FedDPA trains both adapters for the same local epochs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.models.dual import global_only, is_dual, is_local
from fedloom.params import Params
from fedloom.train.local import train_locally

#: where a client keeps its local LoRA and gate in ctx.state
LOCAL = "local_adapter"


@register("fedlocal_global")
@dataclass(frozen=True)
class FedLocalGlobal(FedAvg):
    personalized = True
    adapter_model = "dual"
    personal_steps: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.personal_steps is not None and self.personal_steps < 1:
            raise ValueError(f"algorithm.personal_steps: must be >= 1 (got {self.personal_steps})")

    def check_model(self, params: Params) -> None:
        """The adapter must be the dual model's (a local part and a gate)."""
        if not is_dual(params):
            raise ValueError(
                'model.adapters: fedlocal_global needs the dual-adapter model ([model] adapters = "dual")'
            )

    def init(self, global_params: Params) -> ServerState:
        return ServerState(round=0, global_params=global_only(global_params))

    def payload(self, state: ServerState, client_id: int) -> Params:
        return {n: t for n, t in state.global_params.items() if not is_local(n)}

    def local_part(self, ctx: ClientContext) -> Params:
        """Client k's local LoRA and gate: its own, or the model's initial values."""
        if LOCAL in ctx.state:
            return ctx.state[LOCAL]
        return {n: t for n, t in ctx.model.initial_params.items() if is_local(n)}

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        local = self.local_part(ctx)
        ctx.model.set_params({**payload, **local})
        personal = train_locally(
            ctx, only=local.keys(), state_key="optimizer_local", steps=self.personal_steps
        )
        trained = ctx.model.get_params()
        ctx.state[LOCAL] = {n: trained[n] for n in local}
        ctx.model.set_params(global_only(trained))
        metrics = train_locally(ctx, only=payload.keys())
        trained = ctx.model.get_params()
        shared = {n: trained[n] for n in payload}
        return ClientResult(
            ctx.client_id,
            shared,
            len(ctx.train),
            {**metrics, "personal_loss": personal["train_loss"]},
        )

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        shared, extra = self.combine(state, results)
        return self.next_state(
            state,
            global_params={**state.global_params, **shared},
            extra={**state.extra, **extra},
        )

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        if LOCAL not in ctx.state:
            return global_only({**payload, **self.local_part(ctx)})
        return {**payload, **ctx.state[LOCAL]}

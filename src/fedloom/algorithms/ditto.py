"""Ditto (Li, Hu, Beirami & Smith, ICML 2021, "Ditto: Fair and Robust Federated Learning
Through Personalization", Algorithm 1).

Client k, receiving the global adapter w^t, runs two local trainings each round:

    global:    w_k ← FedAvg's local training from w^t                  (sent to the server)
    personal:  v_k ← v_k − η ∇[F_k(v_k) + (λ/2) ||v_k − w^t||²]        (kept in ctx.state)

both with the configured optimizer and the round's step budget (train.local_steps or
local_epochs), the personal one with moments of its own (``optimizer_personal``). v_k
starts from the payload of the client's first round and never leaves the client; it is
the adapter the client uses and is scored with. The server step is FedAvg's (weighted
mean, or the robust rule of ``[aggregation] rule``).

Compute. As defined, Ditto costs 2x FedAvg's local compute: two trainings of S steps (S
the round's budget; ``train_passes`` counts 2·S·grad_accum passes). ``equal_compute =
true`` compares it with FedAvg at equal compute: the two trainings share the one budget,
the global one taking ⌈S/2⌉ steps and the personal one ⌊S/2⌋, so a client's round costs
exactly S steps, FedAvg's at the same ``train.local_steps`` (each training's schedule runs
on its own shorter clock). A budget of one step cannot be split: ``train.local_steps = 1``
is refused, and a client whose ``local_epochs`` come to one step takes one of each.

λ = 0 is purely local training (v_k never looks at w), λ → ∞ pulls v_k onto the global
adapter (tests/test_personal_regularized.py checks both ends). ``lam`` defaults to 1, the
paper's recommendation without strong attacks: it picks λ per device from {0.1, 1, 2} on
validation data, and fixes λ = 1 for devices with too little of it (λ = 0.1 under strong
poisoning attacks; set ``partition.val_fraction`` and sweep ``lam`` to choose per run).
With AdamW the pull is strong: on tiny-bert over MRPC (3 clients, Dirichlet 0.1, lr 5e-3,
3 rounds) ||v_k − w^t|| was 1.01, 0.77, 0.36, 0.29 for λ = 0, 0.1, 1, 10 (client 0; AdamW's
steps of about lr per coordinate leave a floor near 0.3).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fedloom.algorithms.base import ClientContext, ClientResult
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.fedprox import proximal_term
from fedloom.algorithms.registry import register
from fedloom.config import TrainConfig
from fedloom.params import Params
from fedloom.train.local import steps_per_round, train_locally

PERSONAL = "personal"


@register("ditto")
@dataclass(frozen=True)
class Ditto(FedAvg):
    personalized = True
    lam: float = 1.0
    #: the global and the personal training share one round's step budget (FedAvg's
    #: compute) instead of taking one each (the paper's Ditto, 2x FedAvg's)
    equal_compute: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lam < 0:
            raise ValueError(f"algorithm.lam: must be >= 0 (got {self.lam})")

    def check_training(self, settings: TrainConfig) -> None:
        """With ``equal_compute`` a budget of one local step cannot be split."""
        super().check_training(settings)
        if self.equal_compute and settings.local_steps == 1:
            raise ValueError(
                "algorithm.equal_compute: train.local_steps = 1 cannot be split between "
                "Ditto's global and personal trainings (set train.local_steps >= 2)"
            )

    def step_budgets(self, ctx: ClientContext) -> tuple[int | None, int | None]:
        """(global, personal) steps of the round: (None, None), the round's budget each,
        or with ``equal_compute`` ⌈S/2⌉ and ⌊S/2⌋ of the round's budget S (at least 1)."""
        if not self.equal_compute:
            return None, None
        total = steps_per_round(ctx.settings, len(ctx.train))
        return max(1, (total + 1) // 2), max(1, total // 2)

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        global_steps, personal_steps = self.step_budgets(ctx)
        ctx.model.set_params(payload)  # FedAvg's local training from w^t
        metrics = train_locally(ctx, steps=global_steps)
        result = ClientResult(ctx.client_id, ctx.model.get_params(), len(ctx.train), metrics)
        ctx.model.set_params(ctx.state.get(PERSONAL, payload))
        named = ctx.model.trainable_parameters()
        personal = train_locally(
            ctx,
            extra_loss=lambda: proximal_term(named, payload, self.lam),
            state_key="optimizer_personal",
            steps=personal_steps,
        )
        ctx.state[PERSONAL] = ctx.model.get_params()
        return replace(result, metrics={**result.metrics, "personal_loss": personal["train_loss"]})

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        return ctx.state.get(PERSONAL, payload)

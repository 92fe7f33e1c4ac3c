"""pFedMe (Dinh, Tran & Nguyen, NeurIPS 2020, "Personalized Federated Learning with Moreau
Envelopes", Algorithm 1).

Client k minimizes the Moreau envelope F_k(w) = min_θ f_k(θ) + (λ/2) ||θ − w||² of its
loss. Receiving the global adapter w, it sets its local copy w_k ← w, and for each of
the round's R local steps (train.local_steps or local_epochs):

    draw a batch D;  θ_k ≈ argmin_θ f_k(θ; D) + (λ/2) ||θ − w_k||²
                     (K gradient steps of size ``personal_learning_rate``)
    w_k ← w_k − η λ (w_k − θ_k)          (λ (w_k − θ_k) is ∇F_k(w_k) at the exact θ_k)

and sends w_k. Server:  w ← (1 − β) w + β mean_k(w_k), the mean being FedAvg's (weighted
by examples, as the authors' code weights it). θ_k is the personal adapter: it stays in
``ctx.state`` and is what the client uses and is scored with, the one of its last local
step (the authors' code evaluates this ``persionalized_model_bar``; it is not re-solved
against later payloads).

Choices. The inner solve starts from the previous θ_k (from w at the round's start), as
in the authors' code. The outer step is the configured optimizer fed with λ (w_k − θ_k):
η is ``train.lr`` (``train.head_lr`` for the head), on the run's schedule, clipped to
``train.clip_norm``; with SGD it is the paper's update exactly. Defaults: λ = 15 and
K = 5 are the paper's; β = 1 (plain averaging; the paper also runs β = 2);
``personal_learning_rate`` s = 0.05 keeps s λ < 1, so the proximal pull alone contracts
without overshooting, and gradient descent on the inner problem (curvature ≤ L + λ) stays
stable for losses of curvature L up to 2/s − λ = 25 (the authors' MNIST runs use s = 0.09,
s λ = 1.35: an oscillating pull, stable only for L < 7.2). Each local step costs K
forward/backward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedloom.algorithms.base import Algorithm, ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.params import Params
from fedloom.train.functional import ConfiguredOptimizer, Step, loss_and_grad, step_batches

PERSONAL = "personal"


@register("pfedme")
@dataclass(frozen=True)
class PFedMe(Algorithm):
    personalized = True
    lam: float = 15.0
    K: int = 5
    personal_learning_rate: float = 0.05
    beta: float = 1.0

    def __post_init__(self) -> None:
        if self.lam <= 0:
            raise ValueError(f"algorithm.lam: must be > 0 (got {self.lam})")
        if self.K < 1:
            raise ValueError(f"algorithm.K: must be >= 1 (got {self.K})")
        if self.personal_learning_rate <= 0:
            raise ValueError(
                f"algorithm.personal_learning_rate: must be > 0 (got {self.personal_learning_rate})"
            )
        if self.beta <= 0:
            raise ValueError(f"algorithm.beta: must be > 0 (got {self.beta})")

    def solve_inner(
        self, ctx: ClientContext, theta: Params, w: Params, step: Step
    ) -> tuple[Params, float]:
        """K gradient steps on f_k(θ; step) + (λ/2) ||θ − w||² from ``theta``; returns θ
        and the objective at the last iterate evaluated."""
        value = 0.0
        for _ in range(self.K):
            loss, grads = loss_and_grad(ctx.model, theta, step, bf16=ctx.settings.bf16)
            prox = sum(float((theta[n] - w[n]).square().sum()) for n in w)
            value = loss + 0.5 * self.lam * prox
            s = self.personal_learning_rate
            theta = {n: theta[n] - s * (grads[n] + self.lam * (theta[n] - w[n])) for n in theta}
        return theta, value

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        outer = ConfiguredOptimizer(ctx, payload)
        batches = step_batches(ctx)
        theta = {n: t.detach().clone() for n, t in payload.items()}
        losses = []
        for _ in range(outer.steps):
            w = outer.params
            theta, value = self.solve_inner(ctx, theta, w, next(batches))
            outer.step({n: self.lam * (w[n] - theta[n]) for n in w})
            losses.append(value)
        ctx.state[PERSONAL] = theta
        metrics = {
            "train_loss": float(np.mean(losses)),
            "local_steps": float(outer.steps),
            **outer.finish(),
        }
        return ClientResult(ctx.client_id, outer.params, len(ctx.train), metrics)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        mean, _ = FedAvg().combine(state, results)
        w = state.global_params
        mixed = {
            n: ((1 - self.beta) * w[n].double() + self.beta * mean[n].double()).to(w[n].dtype)
            for n in w
        }
        return self.next_state(state, global_params=mixed)

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        return ctx.state.get(PERSONAL, payload)

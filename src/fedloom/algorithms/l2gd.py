"""L2GD, loopless local gradient descent (Hanzely & Richtárik 2020, "Federated Learning
of a Mixture of Global and Local Models").

Every client k has a personal model x_k; with x̄ = (1/n) Σ_k x_k the objective is

    min  F(x) = (1/n) Σ_k f_k(x_k) + λ (1/2n) Σ_k ||x_k − x̄||²

and each iteration flips one coin shared by all clients: with probability 1 − p a local
step x_k ← x_k − α/(n(1−p)) ∇f_k(x_k), with probability p an aggregation step
x_k ← x_k − αλ/(np) (x_k − x̄). Since Σ_j (x_j − x̄) = 0, ∂F/∂x_k = (1/n)[∇f_k(x_k) +
λ (x_k − x̄)]: the 1/n drops out and the solution solves, for every k,

    ∇f_k(x_k) + λ (x_k − x̄) = 0

(λ → 0: the local optima; λ → ∞: every x_k at the minimizer of Σ_k f_k).

Rounds. Aggregation steps leave x̄ unchanged and local steps need no communication, so
one round is a run of m ≥ 1 aggregation coins then a run of K ≥ 1 local coins: from the
server's x̄ the client applies the m aggregation steps at once,

    x_k ← x̄ + (1 − θ)^m (x_k − x̄),      θ = αλ/(np),

takes K local steps and sends x_k (the server needs it for x̄; it is FedAvg's mean,
``uniform`` as in the paper). Run lengths of a Bernoulli(p) sequence: m ~ Geometric(1−p)
and K ~ Geometric(p) on {1, 2, ...} (E[K] = 1/p). They are drawn from a stream seeded by
(``seed``, round), the same on every client (the shared coin; a client's own seed differs
from its neighbours'). A client keeps x_k in its state (``l2gd_x``), starting from the
first payload it receives; the adapter it uses is x_k after the pending aggregation
steps. x̄ is the paper's global model and is scored as one. With partial participation
x̄ is the mean over the round's clients (the paper has every client in every round).

Step sizes. A local step is the local optimizer's: plain SGD at learning rate η is
η = α/(n(1−p)), hence θ = ηλ(1−p)/p, per tensor group with its own rate (``train.lr``
for LoRA factors, ``train.head_lr`` for the head), and θ ∈ (0, 1] is required (θ > 1
overshoots x̄). θ uses the base rate: the paper's constant steps are
``schedule = "constant"``; with AdamW a local step is not η∇f_k and the objective holds
only in spirit. ``p`` unset is 1 / ``train.local_steps``, so the expected local steps per
round are the configured budget (the coin is shared: a budget in epochs, which differs
between clients, needs ``p`` set). Both requirements depend on the config alone:
:meth:`L2GD.check_training` refuses them before the run starts. ``lam = 1.0`` is the
paper's λ in units of the loss: with SGD at η = 0.1 and p = 0.1 it gives θ = 0.9; with
AdamW at 1e-3, θ = 0.009 (little coupling): the metrics report θ, pick λ for the pull you
want.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedloom.algorithms.base import ClientContext, ClientResult
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.config import TrainConfig
from fedloom.params import Params
from fedloom.train.local import group_lr, lr_group, train_locally

#: where a client keeps its personal model x_k
X = "l2gd_x"


@register("l2gd")
@dataclass(frozen=True)
class L2GD(FedAvg):
    personalized = True
    has_global = True
    weighting: Literal["examples", "uniform", "capped"] = "uniform"
    lam: float = 1.0
    #: probability of an aggregation coin (None: 1 / train.local_steps)
    p: float | None = None
    #: seeds the coin stream shared by all clients
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.lam > 0:
            raise ValueError(f"algorithm.lam: must be > 0 (got {self.lam})")
        if self.p is not None and not 0 < self.p < 1:
            raise ValueError(f"algorithm.p: must be in (0, 1) (got {self.p})")

    def check_training(self, settings: TrainConfig) -> None:
        """p known and θ ∈ (0, 1] at every rate ``settings`` give (``train.lr``, and
        ``train.head_lr`` when set, whether or not the model has tensors outside the LoRA
        factors): both follow from the config alone, so they are checked before the run."""
        rates = {("train.lr", settings.lr)}
        if settings.head_lr is not None:
            rates.add(("train.head_lr", settings.head_lr))
        for key, lr in sorted(rates):
            self.theta_at(key, lr, settings)

    def coin_p(self, settings: TrainConfig) -> float:
        if self.p is not None:
            return self.p
        if settings.local_steps is None:
            raise ValueError(
                "algorithm.p: unset, it is 1 / train.local_steps, but the budget is "
                f"train.local_epochs = {settings.local_epochs:g} (epochs are different numbers "
                "of steps on different clients; the coin is shared); set algorithm.p, or "
                "train.local_steps >= 2"
            )
        if settings.local_steps < 2:
            raise ValueError(
                "algorithm.p: unset, it is 1 / train.local_steps, which needs "
                f"train.local_steps >= 2 (got {settings.local_steps}); set algorithm.p"
            )
        return 1.0 / settings.local_steps

    @staticmethod
    def rate(name: str, settings: TrainConfig) -> tuple[str, float]:
        """(config key, learning rate) of tensor ``name``: the LoRA factors train at
        ``train.lr``, the rest at ``train.head_lr`` (``train.lr`` when unset), PQ-LoRA's
        P and Q at ``train.lr`` times ``train.pq_lr_scale`` (:func:`group_lr`)."""
        return group_lr(lr_group(name), settings)

    def theta_at(self, key: str, lr: float, settings: TrainConfig) -> float:
        """θ = ηλ(1−p)/p at learning rate ``lr`` (the config's ``key``), checked ≤ 1."""
        p = self.coin_p(settings)
        theta = lr * self.lam * (1 - p) / p
        if theta > 1:
            raise ValueError(
                f"algorithm.lam: the aggregation step θ = lr·λ(1−p)/p = {theta:.3g} > 1 "
                f"overshoots x̄ ({key} {lr:g}, λ {self.lam:g}, p {p:.3g}); lower algorithm.lam "
                f"or {key}, or raise algorithm.p"
            )
        return theta

    def theta(self, name: str, settings: TrainConfig) -> float:
        """θ = ηλ(1−p)/p for tensor ``name``, checked to be in (0, 1]."""
        return self.theta_at(*self.rate(name, settings), settings)

    def coins(self, round_: int, settings: TrainConfig) -> tuple[int, int]:
        """(m, K): round ``round_``'s aggregation and local steps, the same on every client."""
        p = self.coin_p(settings)
        rng = np.random.default_rng([self.seed, round_, 0x126D])
        return int(rng.geometric(1 - p)), int(rng.geometric(p))

    def aggregated(self, ctx: ClientContext, x: Params, x_bar: Params, m: int) -> Params:
        """x_k after m aggregation steps towards x̄: x̄ + (1 − θ)^m (x_k − x̄)."""
        return {n: x_bar[n] + (1 - self.theta(n, ctx.settings)) ** m * (x[n] - x_bar[n]) for n in x}

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        m, k = self.coins(ctx.round, ctx.settings)
        ctx.model.set_params(self.aggregated(ctx, ctx.state.get(X, payload), payload, m))
        metrics = train_locally(ctx, steps=k)
        x = ctx.model.get_params()
        ctx.state[X] = x
        thetas = {self.theta(n, ctx.settings) for n in x}
        return ClientResult(
            ctx.client_id,
            x,
            len(ctx.train),
            {**metrics, "aggregation_steps": float(m), "theta": max(thetas)},
        )

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        m, _ = self.coins(ctx.round, ctx.settings)
        return self.aggregated(ctx, ctx.state.get(X, payload), payload, m)

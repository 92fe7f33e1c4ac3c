"""FedNova (Wang, Liu, Liang, Joshi & Poor 2020, "Tackling the Objective Inconsistency
Problem in Heterogeneous Federated Optimization").

Clients may run different numbers of local steps τ_i (e.g. ``local_epochs`` over data sets
of different sizes); FedAvg then over-weights the clients that run more steps and
converges to a minimizer of the wrong objective. FedNova normalizes each client's update
by its step count before averaging:

    d_i     = (x_t - y_i) / ||a_i||_1            (normalized cumulative gradient)
    τ_eff   = sum_i p_i ||a_i||_1                 (p_i: FedAvg's weights, by examples)
    x_{t+1} = x_t - η_g τ_eff sum_i p_i d_i       (η_g = ``eta_g``, 1 in the paper's FedNova)

For local SGD, ||a_i||_1 = τ_i; for SGD with momentum ρ,
||a_i||_1 = (τ_i - ρ (1 - ρ^τ_i) / (1 - ρ)) / (1 - ρ) (Wang et al., Appendix). The client
computes it from its settings and reports it as ``fednova_a`` in its metrics. Both assume
a constant learning rate within the round (and, with momentum, a buffer that starts at 0:
``train.optimizer_state = "reset"``); with AdamW, τ_i is used (an approximation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedloom.algorithms.aggregation_rule import MEAN
from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg, aggregation_weights
from fedloom.algorithms.registry import register
from fedloom.config import TrainConfig
from fedloom.params import Params, flatten, stack, unflatten


def normalizer(settings: TrainConfig, steps: int) -> float:
    """||a||_1 of the local solver for ``steps`` steps."""
    rho = settings.momentum if settings.optimizer == "sgd" else 0.0
    if rho == 0.0:
        return float(steps)
    return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)


@register("fednova")
@dataclass(frozen=True)
class FedNova(FedAvg):
    not_a_mean = "its server step normalizes each client's update by its local steps"
    eta_g: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rule != MEAN:
            raise ValueError("aggregation.rule: fednova normalizes a weighted mean (only 'mean')")
        if self.eta_g <= 0:
            raise ValueError(f"algorithm.eta_g: must be > 0 (got {self.eta_g})")

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        result = super().local_train(ctx, payload)
        a = normalizer(ctx.settings, int(result.metrics["local_steps"]))
        return ClientResult(
            result.client_id, result.params, result.num_examples, {**result.metrics, "fednova_a": a}
        )

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        if not results:
            raise ValueError("aggregate of no clients")
        x_params = state.global_params
        names = sorted(x_params)
        x = flatten(x_params, names).double()
        w = torch.tensor(
            aggregation_weights([r.num_examples for r in results], self.weighting, self.cap),
            dtype=torch.float64,
        )
        p = w / w.sum()
        a = torch.tensor([float(r.metrics["fednova_a"]) for r in results], dtype=torch.float64)
        d = (x - stack([r.params for r in results], names).double()) / a[:, None]
        x_new = x - self.eta_g * float(p @ a) * (p @ d)
        return self.next_state(state, global_params=unflatten(x_new, x_params, names))

"""FedAvgM: FedAvg with server momentum (Hsu et al. 2019, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification").

With x_t the global adapter and x̄_t FedAvg's aggregation step (weighted mean, or the
robust rule of ``[aggregation] rule``):

    g_t = x_t - x̄_t                         (pseudo-gradient)
    u_t = β u_{t-1} + g_t                    (u_{-1} = 0; β = ``server_momentum``)
    x_{t+1} = x_t - η_s u_t                  (η_s = ``server_learning_rate``)

Defaults are Flower's ``FedAvgM``: η_s = 1, β = 0, which is exactly FedAvg; Hsu et al.
use β around 0.9 (with η_s = 1 - β as a common pairing). The momentum buffer u lives in
``ServerState.extra["momentum"]`` (float32 ``Params``); the step is computed in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from fedloom.algorithms.base import ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.params import flatten, unflatten


@register("fedavgm")
@dataclass(frozen=True)
class FedAvgM(FedAvg):
    per_example_client_step: ClassVar[bool] = True
    server_learning_rate: float = 1.0
    server_momentum: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server_learning_rate <= 0:
            raise ValueError(
                f"algorithm.server_learning_rate: must be > 0 (got {self.server_learning_rate})"
            )
        if not 0.0 <= self.server_momentum < 1.0:
            raise ValueError(
                f"algorithm.server_momentum: must be in [0, 1) (got {self.server_momentum})"
            )

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        x_params = state.global_params
        names = sorted(x_params)
        x = flatten(x_params, names).double()
        point, rule_extra = self.combine_flat(state, results, names)
        g = x - point
        previous = state.extra.get("momentum")
        u = g if previous is None else self.server_momentum * flatten(previous, names).double() + g
        x_new = x - self.server_learning_rate * u
        momentum = unflatten(u, x_params, names, torch.float32)
        extra = {**state.extra, **rule_extra, "momentum": momentum}
        return self.next_state(state, global_params=unflatten(x_new, x_params, names), extra=extra)

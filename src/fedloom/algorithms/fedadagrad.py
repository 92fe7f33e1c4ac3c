"""FedAdagrad (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2).

FedOpt (see :mod:`fedloom.algorithms.fedopt`) with the Adagrad accumulator

    v_t = v_{t-1} + Δ_t²
    x_{t+1} = x_t + η m_t / (sqrt(v_t) + τ),   m_t = β1 m_{t-1} + (1 - β1) Δ_t

Defaults are Flower's ``FedAdagrad``: η = 0.1, τ = 1e-3 and β1 = 0 (Flower fixes β1 = 0;
the paper's Algorithm 2 allows momentum, so ``beta_1`` may be set here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedloom.algorithms.fedopt import FedOpt
from fedloom.algorithms.registry import register


@register("fedadagrad")
@dataclass(frozen=True)
class FedAdagrad(FedOpt):
    per_example_client_step: ClassVar[bool] = True

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return v + delta.square()

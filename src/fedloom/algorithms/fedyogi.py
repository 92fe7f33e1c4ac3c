"""FedYogi (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2; Yogi is
Zaheer et al. 2018).

FedOpt (see :mod:`fedloom.algorithms.fedopt`) with Yogi's additive second moment

    v_t = v_{t-1} - (1 - β2) Δ_t² sign(v_{t-1} - Δ_t²)
    x_{t+1} = x_t + η m_t / (sqrt(v_t) + τ),   m_t = β1 m_{t-1} + (1 - β1) Δ_t

Defaults are Flower's ``FedYogi``: η = 1e-2, β1 = 0.9, β2 = 0.99, τ = 1e-3 (Flower's
eta_l = 0.0316 is never used by Flower; here ``eta_l`` unset keeps ``train.lr``).

No bias correction, as in both Flower and Algorithm 2 of Reddi et al. (Zaheer et al.'s
Yogi has Adam's correction: ``bias_correction = "adam"`` gives η_t = η sqrt(1 - β2^t) /
(1 - β1^t) with t the 1-based round). Departure from the paper by default (matching
Flower): v_{-1} = 0, where Algorithm 2 asks for v_{-1} >= τ²; ``variant = "paper"`` starts
from τ².
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from fedloom.algorithms.fedadam import bias_corrected
from fedloom.algorithms.fedopt import FedOpt, check_beta_2
from fedloom.algorithms.registry import register


@register("fedyogi")
@dataclass(frozen=True)
class FedYogi(FedOpt):
    per_example_client_step: ClassVar[bool] = True
    eta: float = 1e-2
    beta_1: float = 0.9
    beta_2: float = 0.99
    bias_correction: Literal["none", "adam"] = "none"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_beta_2(self.beta_2)
        if self.bias_correction not in ("none", "adam"):
            raise ValueError(
                f"algorithm.bias_correction: must be none or adam (got {self.bias_correction!r})"
            )

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        d2 = delta.square()
        return v - (1.0 - self.beta_2) * d2 * torch.sign(v - d2)

    def step_size(self, round_: int) -> float:
        if self.bias_correction == "adam":
            return bias_corrected(self.eta, self.beta_1, self.beta_2, round_ + 1)
        return self.eta

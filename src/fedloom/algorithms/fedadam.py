"""FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2).

FedOpt (see :mod:`fedloom.algorithms.fedopt`) with Adam's second moment

    v_t = β2 v_{t-1} + (1 - β2) Δ_t²
    x_{t+1} = x_t + η_t m_t / (sqrt(v_t) + τ),   m_t = β1 m_{t-1} + (1 - β1) Δ_t

Defaults are Flower's ``FedAdam``: η = 0.1, β1 = 0.9, β2 = 0.99, τ = 1e-3.

Departure from the paper (matching Flower): Algorithm 2 of Reddi et al. has no bias
correction (η_t = η), but Flower scales the step by Adam's correction evaluated one round
late, η_t = η sqrt(1 - β2^(s+1)) / (1 - β1^(s+1)) with s = Flower's 1-based server round,
i.e. exponent t + 2 for fedloom's 0-based round t. ``bias_correction`` picks:

* ``"flower"`` (default): exponent t + 2, as Flower;
* ``"adam"``: exponent t + 1, Adam's own correction (Kingma & Ba 2015, in the form of
  their Section 2 that Flower uses too: τ is not rescaled);
* ``"none"``: η_t = η, the paper's Algorithm 2 (also implied by ``variant = "paper"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from fedloom.algorithms.fedopt import FedOpt, check_beta_2
from fedloom.algorithms.registry import register


def bias_corrected(eta: float, beta_1: float, beta_2: float, t: int) -> float:
    """η sqrt(1 - β2^t) / (1 - β1^t) (t >= 1)."""
    return eta * math.sqrt(1.0 - beta_2**t) / (1.0 - beta_1**t)


@register("fedadam")
@dataclass(frozen=True)
class FedAdam(FedOpt):
    per_example_client_step: ClassVar[bool] = True
    beta_1: float = 0.9
    beta_2: float = 0.99
    bias_correction: Literal["flower", "adam", "none"] = "flower"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_beta_2(self.beta_2)
        if self.bias_correction not in ("flower", "adam", "none"):
            raise ValueError(
                f"algorithm.bias_correction: must be flower, adam or none "
                f"(got {self.bias_correction!r})"
            )
        if self.variant == "paper" and self.bias_correction != "flower":
            raise ValueError("algorithm.bias_correction: variant = 'paper' already means none")

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.beta_2 * v + (1.0 - self.beta_2) * delta.square()

    def step_size(self, round_: int) -> float:
        if self.variant == "paper" or self.bias_correction == "none":
            return self.eta
        t = round_ + (2 if self.bias_correction == "flower" else 1)
        return bias_corrected(self.eta, self.beta_1, self.beta_2, t)

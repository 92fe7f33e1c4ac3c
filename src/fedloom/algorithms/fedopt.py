"""FedOpt: FedAvg's aggregation step followed by an adaptive server optimizer step
(Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2).

With x_t the global adapter and x̄_t the aggregation step of FedAvg (the weighted mean of
the clients, or the robust rule of ``[aggregation] rule``), the pseudo-gradient is

    Δ_t = x̄_t - x_t
    m_t = β1 m_{t-1} + (1 - β1) Δ_t                     (m_{-1} = 0)
    v_t = second moment (FedAdagrad / FedAdam / FedYogi) (v_{-1} = 0; τ² with variant "paper")
    x_{t+1} = x_t + η_t m_t / (sqrt(v_t) + τ)

η_t = η except for FedAdam's bias correction. m and v live in ``ServerState.extra`` (as
float32 ``Params``) so the step is a pure function of (state, results); the step itself
is computed in float64. ``eta_l`` (Flower's client learning rate, which Flower stores but
never uses) overrides ``train.lr`` in local training when set.

``variant = "flower"`` (default) reproduces ``flwr.serverapp.strategy.FedAdagrad/FedAdam/
FedYogi``; ``variant = "paper"`` follows Algorithm 2 of Reddi et al. as written: v_{-1} = τ²
and no bias correction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.params import Params, flatten, unflatten


@dataclass(frozen=True)
class FedOpt(FedAvg):
    """Base of FedAdagrad, FedAdam and FedYogi (not registered itself)."""

    eta: float = 1e-1
    eta_l: float | None = None
    beta_1: float = 0.0
    tau: float = 1e-3
    variant: Literal["flower", "paper"] = "flower"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eta <= 0:
            raise ValueError(f"algorithm.eta: must be > 0 (got {self.eta})")
        if self.eta_l is not None and self.eta_l <= 0:
            raise ValueError(f"algorithm.eta_l: must be > 0 (got {self.eta_l})")
        if not 0.0 <= self.beta_1 < 1.0:
            raise ValueError(f"algorithm.beta_1: must be in [0, 1) (got {self.beta_1})")
        if self.tau <= 0:
            raise ValueError(f"algorithm.tau: must be > 0 (got {self.tau})")
        if self.variant not in ("flower", "paper"):
            raise ValueError(f"algorithm.variant: must be flower or paper (got {self.variant!r})")

    # --- what subclasses define --------------------------------------------------------
    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step_size(self, round_: int) -> float:
        """η_t for the step that ends round ``round_`` (0-based; Flower's server_round - 1)."""
        return self.eta

    # --- client ------------------------------------------------------------------------
    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        if self.eta_l is not None:
            ctx = replace(ctx, settings=ctx.settings.model_copy(update={"lr": self.eta_l}))
        return super().local_train(ctx, payload)

    # --- server ------------------------------------------------------------------------
    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        x_params = state.global_params
        names = sorted(x_params)
        x = flatten(x_params, names).double()
        point, rule_extra = self.combine_flat(state, results, names)
        delta = point - x
        m_prev, v_prev = state.extra.get("m"), state.extra.get("v")
        m = torch.zeros_like(x) if m_prev is None else flatten(m_prev, names).double()
        if v_prev is not None:
            v = flatten(v_prev, names).double()
        else:
            v = torch.full_like(x, self.tau**2 if self.variant == "paper" else 0.0)
        m = self.beta_1 * m + (1.0 - self.beta_1) * delta
        v = self.second_moment(v, delta)
        x_new = x + self.step_size(state.round) * m / (v.sqrt() + self.tau)
        extra = {
            **state.extra,
            **rule_extra,
            "m": unflatten(m, x_params, names, torch.float32),
            "v": unflatten(v, x_params, names, torch.float32),
        }
        return self.next_state(state, global_params=unflatten(x_new, x_params, names), extra=extra)


def check_beta_2(beta_2: float) -> None:
    if not 0.0 <= beta_2 < 1.0:
        raise ValueError(f"algorithm.beta_2: must be in [0, 1) (got {beta_2})")

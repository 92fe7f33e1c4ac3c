"""q-FedAvg (Li, Sanjabi, Beirami & Smith 2020, "Fair Resource Allocation in Federated
Learning", Algorithm 2): minimizes the q-fair objective sum_k F_k^(q+1) / (q+1), which
weights clients with a high loss more as q grows (q = 0 is FedAvg with uniform weights).

With L = 1 / ``client_learning_rate`` (the paper's Lipschitz estimate; L = 1/η_local as
in its experiments), x_t the global adapter, x_k client k's trained adapter and F_k its
loss:

    Δw_k = L (x_t - x_k)
    Δ_k  = (F_k + 1e-10)^q Δw_k
    h_k  = q (F_k + 1e-10)^(q-1) ||Δw_k||² + L (F_k + 1e-10)^q
    x_{t+1} = x_t - sum_k Δ_k / sum_k h_k

Departure from the paper (matching Flower's ``QFedAvg``): F_k should be client k's loss
at x_t before training; like Flower, the server uses the loss the client reports,
``train_loss`` in the result's metrics, which fedloom computes as the mean over the
round's local steps (the first of which starts at x_t). The 1e-10 guard is Flower's.
Flower requires ``client_learning_rate`` (no default); so does fedloom. q defaults to 0.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedloom.algorithms.base import Algorithm, ClientResult, ServerState
from fedloom.algorithms.registry import register
from fedloom.params import flatten, unflatten

LOSS_EPS = 1e-10


@register("qfedavg")
@dataclass(frozen=True)
class QFedAvg(Algorithm):
    client_learning_rate: float | None = None
    q: float = 0.1

    def __post_init__(self) -> None:
        if self.client_learning_rate is None:
            raise ValueError(
                "algorithm.client_learning_rate: required for qfedavg "
                "(the Lipschitz estimate is L = 1 / client_learning_rate)"
            )
        if self.client_learning_rate <= 0:
            raise ValueError(
                f"algorithm.client_learning_rate: must be > 0 (got {self.client_learning_rate})"
            )
        if self.q < 0:
            raise ValueError(f"algorithm.q: must be >= 0 (got {self.q})")

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        if not results:
            raise ValueError("aggregate of no clients")
        assert self.client_learning_rate is not None
        lipschitz = 1.0 / self.client_learning_rate
        x_params = state.global_params
        names = sorted(x_params)
        x = flatten(x_params, names).double()
        sum_delta = torch.zeros_like(x)
        sum_h = 0.0
        for r in results:
            if "train_loss" not in r.metrics:
                raise ValueError(f"qfedavg: client {r.client_id} reported no train_loss")
            loss = float(r.metrics["train_loss"]) + LOSS_EPS
            dw = lipschitz * (x - flatten(r.params, names).double())
            sum_delta += loss**self.q * dw
            sum_h += (
                self.q * loss ** (self.q - 1) * float(dw.square().sum()) + lipschitz * loss**self.q
            )
        x_new = x - sum_delta / sum_h
        return self.next_state(state, global_params=unflatten(x_new, x_params, names))

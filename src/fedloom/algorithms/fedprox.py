"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith 2020, "Federated Optimization in
Heterogeneous Networks").

Client k starting from the global adapter w_t minimizes its loss plus a proximal term

    h_k(w; w_t) = F_k(w) + (μ/2) ||w - w_t||²        (μ = ``proximal_mu``)

over the trainable tensors (LoRA factors and head), through the ``extra_loss`` hook of
:func:`fedloom.train.local.train_locally`; the reported ``train_loss`` is h_k (the objective
actually minimized). The server step is FedAvg's (weighted mean, or the robust rule of
``[aggregation] rule``), which is also what Flower's ``FedProx`` aggregates.

``proximal_mu`` keeps Flower's name and default, 0.0, which is FedAvg (Flower warns about
it); Li et al. tune μ in {0.001, 0.01, 0.1, 1}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedloom.algorithms.base import ClientContext, ClientResult
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.params import Params
from fedloom.train.local import train_locally


def proximal_term(params: dict[str, torch.nn.Parameter], anchor: Params, mu: float) -> torch.Tensor:
    """(μ/2) sum_n ||params[n] - anchor[n]||²."""
    total = sum(((p - anchor[n]).square().sum() for n, p in params.items()), torch.zeros(()))
    return 0.5 * mu * total


@register("fedprox")
@dataclass(frozen=True)
class FedProx(FedAvg):
    proximal_mu: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.proximal_mu < 0:
            raise ValueError(f"algorithm.proximal_mu: must be >= 0 (got {self.proximal_mu})")

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        ctx.model.set_params(payload)
        named = ctx.model.trainable_parameters()
        anchor = {n: p.detach().clone() for n, p in named.items()}
        hook = (
            (lambda: proximal_term(named, anchor, self.proximal_mu)) if self.proximal_mu else None
        )
        metrics = train_locally(ctx, extra_loss=hook)
        return ClientResult(ctx.client_id, ctx.model.get_params(), len(ctx.train), metrics)

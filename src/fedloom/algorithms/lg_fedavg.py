"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov & Morency 2020,
"Think Locally, Act Globally: Federated Learning with Local and Global Representations").

FedPer's reverse: each client keeps a local representation and only the global top layers
are federated. With LoRA the representation is the LoRA factors and the top the task
head: ``personal = ("lora_",)``. Round t, client k:

    w_k = (A_k, h^t)  →  local training  →  keeps A_k, sends h_k
    server:  h^{t+1} = Σ_k n_k h_k / Σ_k n_k          (FedAvg over the head only)

The LoRA factors never leave the client; the rule is :class:`PartialFedAvg`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fedloom.algorithms.partial import PartialFedAvg
from fedloom.algorithms.registry import register


@register("lg_fedavg")
@dataclass(frozen=True)
class LGFedAvg(PartialFedAvg):
    """LG-FedAvg (Liang et al. 2020): the LoRA factors (the local representation) stay
    personal, the head is federated."""

    per_example_client_step: ClassVar[bool] = True

    personal: Sequence[str] = ("lora_",)

"""FedPer (Arivazhagan, Aggarwal, Singh & Choudhary 2019, "Federated Learning with
Personalization Layers").

The base layers are federated, the personalization layers stay on each client. With LoRA
the base is the LoRA adapters and the personalization layer the task head:
``personal = ("head",)`` (every non-LoRA tensor). Round t, client k:

    w_k = (A^t, h_k)  →  local training  →  keeps h_k, sends A_k
    server:  A^{t+1} = Σ_k n_k A_k / Σ_k n_k          (FedAvg over the LoRA factors only)

The head never leaves the client; the rule is :class:`PartialFedAvg`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fedloom.algorithms.partial import PartialFedAvg
from fedloom.algorithms.registry import register


@register("fedper")
@dataclass(frozen=True)
class FedPer(PartialFedAvg):
    """FedPer (Arivazhagan et al. 2019): LoRA adapters federated, the head personal."""

    per_example_client_step: ClassVar[bool] = True

    personal: Sequence[str] = ("head",)

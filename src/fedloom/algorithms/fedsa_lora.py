"""FedSA-LoRA (Guo et al., ICLR 2025, "Selective Aggregation for Low-Rank Adaptation in
Federated Learning").

Both LoRA factors train on every client, but only A is aggregated: the paper finds A
learns general knowledge and B client-specific knowledge, so B stays personal, and so
does the task head: ``personal = ("lora_B", "head")``. Round t, client k:

    w_k = (A^t, B_k, h_k)  →  local training  →  keeps B_k, h_k, sends A_k
    server:  A^{t+1} = Σ_k n_k A_k / Σ_k n_k          (FedAvg over the A factors only)

The server sees only LoRA A factors; the rule is :class:`PartialFedAvg`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fedloom.algorithms.partial import PartialFedAvg
from fedloom.algorithms.registry import register


@register("fedsa_lora")
@dataclass(frozen=True)
class FedSALoRA(PartialFedAvg):
    """FedSA-LoRA (Guo et al. 2025): only LoRA A is aggregated; B and the head stay personal."""

    per_example_client_step: ClassVar[bool] = True

    personal: Sequence[str] = ("lora_B", "head")

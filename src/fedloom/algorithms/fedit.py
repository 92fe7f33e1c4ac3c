"""FedIT (Zhang et al., ICASSP 2024, "Towards Building the Federated GPT: Federated
Instruction Tuning"): FedAvg over LoRA adapters, each factor averaged on its own,

    A^{t+1} = Σ_k p_k A_k,    B^{t+1} = Σ_k p_k B_k,    p_k = n_k / Σ_j n_j,

the baseline the LoRA-aware methods are measured against. The server's weight change is
B^{t+1} A^{t+1}, not the clients' mean Σ_k p_k B_k A_k (BENCHMARKS.md, "Averaging LoRA
factors"). fedloom's ``fedit`` is ``fedavg`` under the name the federated-LoRA literature
uses, with every FedAvg hyperparameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register


@register("fedit")
@dataclass(frozen=True)
class FedIT(FedAvg):
    """FedAvg of the LoRA factors A and B (and the head), each averaged separately."""

    per_example_client_step: ClassVar[bool] = True

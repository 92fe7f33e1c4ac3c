"""FedEx-LoRA (Singhal et al., ACL 2025, "FedEx-LoRA: Exact Aggregation for Federated and
Efficient Fine-Tuning of Foundation Models"): FedIT's averaged factors plus the error they
make, folded into the frozen weight. For every adapted module, with p_k the clients'
aggregation weights,

    A^{t+1} = Σ_k p_k A_k,     B^{t+1} = Σ_k p_k B_k,
    M^{t+1} = M^t + Σ_k p_k B_k A_k − B^{t+1} A^{t+1}

and the layer computes (W_0 + s M^{t+1}) x + s B^{t+1} A^{t+1} x (s = alpha / r;
:mod:`fedloom.models.merged`). The global weight W_0 + s (M^{t+1} + B^{t+1} A^{t+1}) is
then exactly Σ_k p_k (W_0 + s M^t + s B_k A_k), the mean of the clients' full weights.
The head (non-LoRA tensors) is averaged as in FedAvg.

Cost: the residual is a dense d_out × d_in matrix per module sent down every round (the
paper sends it so; its rank is at most (K + 1) r, so a factored form would be smaller for
few clients). fedloom differs from the paper in keeping M in B·A units and the scale s in
the model, and in computing the residual in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fedloom.algorithms.base import Algorithm, ClientResult, ServerState
from fedloom.algorithms.fedavg import check_weighting
from fedloom.algorithms.lora_factors import (
    A_SUFFIX,
    B_SUFFIX,
    check_factors,
    client_weights,
    factor_modules,
    mean_product,
    merged_of,
)
from fedloom.algorithms.registry import register
from fedloom.models.merged import merged_name
from fedloom.params import Params, weighted_average


@register("fedex_lora")
@dataclass(frozen=True)
class FedExLoRA(Algorithm):
    """FedAvg of A and B with the residual mean(BA) − mean(B) mean(A) merged into W."""

    weighting: Literal["examples", "uniform"] = "examples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)

    def check_model(self, params: Params) -> None:
        check_factors(params, self.name)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        p = client_weights(results, self.weighting)
        mean = weighted_average([r.params for r in results], p.tolist())
        merged = {}
        for module in factor_modules(mean):
            product_of_means = mean[module + B_SUFFIX].double() @ mean[module + A_SUFFIX].double()
            residual = mean_product(results, module, p) - product_of_means
            merged[merged_name(module)] = (
                merged_of(state.global_params, module) + residual
            ).float()
        return self.next_state(state, global_params={**mean, **merged})

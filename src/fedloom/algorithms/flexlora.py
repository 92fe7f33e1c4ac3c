"""FlexLoRA (Bai et al., NeurIPS 2024, "Federated Fine-tuning of Large Language Models
under Heterogeneous Tasks and Client Resources"): clients of different LoRA ranks r_k
are aggregated in weight space, and every client gets back the best approximation of
the aggregate its rank can hold. For every adapted module,

    ΔW^{t+1} = Σ_k p_k B_k A_k                       (full size, any rank)
    ΔW^{t+1} = U Σ Vᵀ (thin SVD),   client k:  B_k = U_{r_k} Σ_{r_k},  A_k = V_{r_k}ᵀ

so B_k A_k is the rank-r_k truncation of ΔW^{t+1}, the best rank-r_k approximation in
Frobenius norm (Eckart–Young). The global model is W_0 + s ΔW^{t+1} itself, kept as a
merged update (:mod:`fedloom.models.merged`; the global adapter's factors are zero), and
scored on the dev set; each client scores the truncation it receives as its personal
adapter. The head (non-LoRA tensors) is averaged with the same p_k.

fedloom differs from the paper in two stated ways: the singular values go to B (the
paper's split of Σ between the factors is not fixed by the product); and every client's
scaling is ``model.lora.alpha / r``, whatever its rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import check_weighting
from fedloom.algorithms.lora_factors import (
    A_SUFFIX,
    B_SUFFIX,
    client_weights,
    factor_modules,
    mean_product,
)
from fedloom.algorithms.ranked import RankedLoRA
from fedloom.algorithms.registry import register
from fedloom.models.merged import MERGED, merged_name
from fedloom.params import Params, weighted_average

#: ``ServerState.extra`` key of the top-r_max SVD factors of every module's ΔW
FACTORS = "factors"


def svd_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U_r Σ_r, V_rᵀ) of ``delta``'s thin SVD (float64), zero-padded to ``rank``
    components when ``delta`` has fewer."""
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    b = torch.zeros(delta.shape[0], rank, dtype=delta.dtype)
    a = torch.zeros(rank, delta.shape[1], dtype=delta.dtype)
    k = min(rank, s.numel())
    b[:, :k], a[:k] = u[:, :k] * s[:k], vh[:k]
    return b, a


@register("flexlora")
@dataclass(frozen=True)
class FlexLoRA(RankedLoRA):
    """Weight-space averaging of mixed-rank LoRA, redistributed by truncated SVD."""

    personalized: ClassVar[bool] = True
    weighting: Literal["examples", "uniform"] = "examples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)

    def payload(self, state: ServerState, client_id: int) -> Params:
        params = {n: t for n, t in state.global_params.items() if not n.endswith(MERGED)}
        for module, (b, a) in state.extra.get(FACTORS, {}).items():
            params[module + B_SUFFIX], params[module + A_SUFFIX] = b, a
        return self.cut(state, params, client_id)

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params | None:
        return payload

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        p = client_weights(results, self.weighting)
        out = weighted_average([r.params for r in results], p.tolist())
        factors = {}
        for module in factor_modules(out):
            a, b = module + A_SUFFIX, module + B_SUFFIX
            delta = mean_product(results, module, p)
            new_b, new_a = svd_factors(delta, out[a].shape[0])
            factors[module] = (new_b.to(out[b].dtype), new_a.to(out[a].dtype))
            out[merged_name(module)] = delta.float()
            out[a], out[b] = torch.zeros_like(out[a]), torch.zeros_like(out[b])
        return self.next_state(state, global_params=out, extra={**state.extra, FACTORS: factors})

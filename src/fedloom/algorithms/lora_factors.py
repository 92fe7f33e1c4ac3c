"""The LoRA factor pairs of an adapter's ``Params`` and the weighted products the LoRA-aware
methods aggregate.

An adapted module ``m`` holds A = ``m.lora_A.weight`` (r × d_in) and B = ``m.lora_B.weight``
(d_out × r); its weight change is s B A (s = alpha / r, applied by the model, never by the
server), optionally plus a merged update ``m.merged.weight`` (:mod:`fedloom.models.merged`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from fedloom.algorithms.base import ClientResult
from fedloom.algorithms.fedavg import aggregation_weights
from fedloom.models.merged import merged_name
from fedloom.params import Params, aggregation_weight_vector, num_bytes

A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"
#: where a rank-aware method keeps the clients' ranks in ``ServerState.extra``
RANKS = "ranks"


def factor_modules(params: Params) -> list[str]:
    """The adapted modules holding both a LoRA A and a LoRA B, sorted."""
    return sorted(
        n.removesuffix(A_SUFFIX)
        for n in params
        if n.endswith(A_SUFFIX) and n.removesuffix(A_SUFFIX) + B_SUFFIX in params
    )


def check_factors(params: Params, method: str) -> None:
    """Refuse an adapter without plain LoRA factor pairs (a dual or mosaic adapter names
    its factors per adapter): the method is defined on one A and one B per module."""
    if not factor_modules(params):
        raise ValueError(
            f"algorithm.name: {method} aggregates LoRA factor pairs "
            "(*.lora_A.weight, *.lora_B.weight); the model has none "
            '(it needs model.adapters = "lora")'
        )


def client_weights(results: Sequence[ClientResult], weighting: str) -> torch.Tensor:
    """The clients' aggregation weights p_k (float64, summing to 1): n_k or uniform."""
    w = aggregation_weight_vector(aggregation_weights([r.num_examples for r in results], weighting))
    return w / w.sum()


def mean_product(results: Sequence[ClientResult], module: str, p: torch.Tensor) -> torch.Tensor:
    """Σ_k p_k B_k A_k of ``module`` (float64, d_out × d_in)."""
    products = (
        p[k] * (r.params[module + B_SUFFIX].double() @ r.params[module + A_SUFFIX].double())
        for k, r in enumerate(results)
    )
    return cast(torch.Tensor, sum(products))  # never the empty sum's 0: results is not empty


def merged_of(params: Params, module: str) -> torch.Tensor:
    """The merged update M of ``module`` in ``params`` (float64), zero where none yet."""
    name = merged_name(module)
    if name in params:
        return params[name].double()
    b, a = params[module + B_SUFFIX], params[module + A_SUFFIX]
    return torch.zeros(b.shape[0], a.shape[1], dtype=torch.float64)


def truncated(params: Params, rank: int) -> Params:
    """``params`` with every LoRA factor pair cut to its first ``rank`` components, zero
    beyond (A's rows, B's columns): what a client of that rank holds in the model built at
    the largest rank. Zero components get zero gradients (each multiplies the other
    factor's zero), so they stay zero through local training."""
    out = dict(params)
    for module in factor_modules(params):
        a, b = module + A_SUFFIX, module + B_SUFFIX
        if rank < params[a].shape[0]:
            out[a] = params[a].clone()
            out[a][rank:] = 0
            out[b] = params[b].clone()
            out[b][:, rank:] = 0
    return out


def ranks_of(state_extra: Mapping[str, Any]) -> Mapping[int, int]:
    """Every client's rank in a mixed-rank federation's state (empty: one rank for all)."""
    return state_extra.get(RANKS, {})


def wire_bytes(params: Params, rank: int | None = None) -> int:
    """The bytes of ``params`` as they travel: every tensor in full, except that a client
    of LoRA ``rank`` (below the model's) sends and receives only its first ``rank``
    components of each factor pair (the rest are the padding's zeros)."""
    total = num_bytes(params)
    if rank is None:
        return total
    for module in factor_modules(params):
        for name, axis in ((module + A_SUFFIX, 0), (module + B_SUFFIX, 1)):
            t = params[name]
            total -= max(0, t.shape[axis] - rank) * (t.numel() // t.shape[axis]) * t.element_size()
    return total

"""FLoRA (Wang et al., NeurIPS 2024, "FLoRA: Federated Fine-Tuning Large Language Models
with Heterogeneous Low-Rank Adaptations"): the server stacks the clients' factors,

    B = [p_1 B_1, …, p_K B_K],   A = [A_1; …; A_K],   B A = Σ_k p_k B_k A_k,

a rank-Σ_k r_k update that is merged into the frozen weight, M^{t+1} = M^t + Σ_k p_k B_k A_k
(the layer computes (W_0 + s M) x + s B A x; :mod:`fedloom.models.merged`), and every
client starts the next round from a fresh adapter: A drawn anew (PEFT's Kaiming-uniform
initialization), B = 0. The update is noise-free for any mix of ranks, since no factor is
averaged: in a mixed-rank federation ([[model.ranks]]) client k's fresh A is cut to its
first r_k rows, and the stacked update has rank Σ_k r_k. The head (non-LoRA tensors) is
averaged as in FedAvg.

fedloom differs from the paper in three stated ways: the fresh A of round t is drawn from
a generator seeded by (``seed``, t), so a run is reproducible; the merged update travels
as one dense d_out × d_in matrix per module instead of the stacked factors (the same
product, more bytes for few clients); and a client's optimizer moments are reset each
round, as its fresh adapter has nothing in common with the last one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import check_weighting
from fedloom.algorithms.lora_factors import (
    A_SUFFIX,
    B_SUFFIX,
    client_weights,
    factor_modules,
    mean_product,
    merged_of,
)
from fedloom.algorithms.ranked import RankedLoRA
from fedloom.algorithms.registry import register
from fedloom.models.merged import merged_name
from fedloom.params import Params, weighted_average


def fresh_factors(a: torch.Tensor, b: torch.Tensor, generator: torch.Generator) -> Params:
    """A new A (Kaiming-uniform with a = √5, PEFT's LoRA initialization) and B = 0, shaped
    and typed like ``a`` and ``b``."""
    new_a = torch.empty(a.shape, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(new_a, a=math.sqrt(5), generator=generator)
    return {"A": new_a.to(a.dtype), "B": torch.zeros_like(b)}


@register("flora")
@dataclass(frozen=True)
class FLoRA(RankedLoRA):
    """The clients' stacked LoRA updates merged into W each round; adapters start afresh."""

    weighting: Literal["examples", "uniform"] = "examples"
    #: seeds the fresh A of every round
    seed: int = 0

    def __post_init__(self) -> None:
        check_weighting(self.weighting)

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        ctx.state.pop("optimizer", None)
        return super().local_train(ctx, payload)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        p = client_weights(results, self.weighting)
        out = weighted_average([r.params for r in results], p.tolist())  # the head's mean
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + state.round + 1)
        for module in factor_modules(out):
            a, b = module + A_SUFFIX, module + B_SUFFIX
            out[merged_name(module)] = (
                merged_of(state.global_params, module) + mean_product(results, module, p)
            ).float()
            fresh = fresh_factors(out[a], out[b], generator)
            out[a], out[b] = fresh["A"], fresh["B"]
        return self.next_state(state, global_params=out)

"""HetLoRA (Cho et al., EMNLP 2024, "Heterogeneous LoRA for Federated Fine-tuning of
On-Device Foundation Models"): clients of different LoRA ranks r_k share one global
adapter of the largest rank r_max.

* Distribution: client k receives the global adapter truncated to its first r_k components
  (A's rows, B's columns; zero beyond, :func:`~fedloom.algorithms.lora_factors.truncated`).
* Rank self-pruning: with ``gamma`` < 1, client k adds λ Σ_m ‖B_m[:, q:r_k] A_m[q:r_k]‖_F
  (q = ⌊γ r_k⌋, ``lam`` = λ) to its loss; when that tail's norm after local training is
  below the one it had after its previous round, the client prunes its rank to
  max(1, q), zeroes the tail and reports its new rank, which the server's truncation
  follows from then on.
* Sparsity-weighted aggregation with zero-padding: every client's factors padded to r_max
  (they already are), and module m's factors averaged with weights
  p_k ∝ ‖B_{k,m} A_{k,m}‖_F, so that clients whose update is near zero count little. The
  head (non-LoRA tensors) is averaged by n_k.

Each client uses the adapter it receives (its truncation of the global one): scored as
its personal adapter; the global adapter, at r_max, is scored on the dev set.

The pruning rule above is fedloom's reading of the paper's description (no reference
code was at hand to check the exact regularizer and test against). fedloom differs from
the paper in three stated ways: the weights are per module (the
paper's norm is the client's whole update); pruning is off by default (γ = 1) because its
γ and λ are unmeasured here; and every client's scaling is ``model.lora.alpha / r``,
whatever its rank, so that padded factors of every rank mean the same weight change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.lora_factors import (
    A_SUFFIX,
    B_SUFFIX,
    RANKS,
    client_weights,
    factor_modules,
    ranks_of,
    truncated,
)
from fedloom.algorithms.ranked import RankedLoRA
from fedloom.algorithms.registry import register
from fedloom.params import Params, weighted_average
from fedloom.train.local import train_locally


def tail_norm(params: Mapping[str, torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Σ_m ‖B_m[:, start:stop] A_m[start:stop]‖_F over the adapted modules (differentiable
    when ``params`` are live parameters)."""
    norms = [
        torch.linalg.matrix_norm(
            params[m + B_SUFFIX][:, start:stop] @ params[m + A_SUFFIX][start:stop]
        )
        for m in factor_modules(dict(params))
    ]
    return torch.stack(norms).sum()


@register("hetlora")
@dataclass(frozen=True)
class HetLoRA(RankedLoRA):
    """Zero-padded, norm-weighted aggregation of mixed-rank LoRA, with rank self-pruning."""

    personalized: ClassVar[bool] = True
    #: γ: a pruning client keeps ⌊γ r_k⌋ components (1: no pruning)
    gamma: float = 1.0
    #: λ: the weight of the tail's norm in the local loss
    lam: float = 0.01

    def __post_init__(self) -> None:
        if not 0 < self.gamma <= 1:
            raise ValueError(f"algorithm.gamma: must be in (0, 1] (got {self.gamma})")
        if self.lam < 0:
            raise ValueError(f"algorithm.lam: must be >= 0 (got {self.lam})")

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params | None:
        return payload

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        ctx.model.set_params(payload)
        full = payload[factor_modules(payload)[0] + A_SUFFIX].shape[0]
        rank = ctx.state.get("rank", ctx.rank or full)
        keep = max(1, math.floor(self.gamma * rank))
        live = ctx.model.trainable_parameters()
        pruning = keep < rank
        regularizer = (
            (lambda: self.lam * tail_norm(live, keep, rank)) if pruning and self.lam > 0 else None
        )
        metrics = train_locally(ctx, regularizer)
        params = ctx.model.get_params()
        if pruning:
            tail = float(tail_norm(params, keep, rank))
            previous = ctx.state.get("tail_norm")
            ctx.state["tail_norm"] = tail
            if previous is not None and tail < previous:
                rank = keep
                params = truncated(params, rank)
                del ctx.state["tail_norm"]
        ctx.state["rank"] = rank
        return ClientResult(ctx.client_id, params, len(ctx.train), {**metrics, "rank": float(rank)})

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        out = weighted_average(
            [r.params for r in results], client_weights(results, "examples").tolist()
        )
        for module in factor_modules(out):
            a, b = module + A_SUFFIX, module + B_SUFFIX
            norms = torch.tensor(
                [
                    float(torch.linalg.matrix_norm(r.params[b].double() @ r.params[a].double()))
                    for r in results
                ],
                dtype=torch.float64,
            )
            if norms.sum() > 0:
                p = norms / norms.sum()
                zero_a = torch.zeros_like(results[0].params[a], dtype=torch.float64)
                zero_b = torch.zeros_like(results[0].params[b], dtype=torch.float64)
                out[a] = sum(
                    (p[k] * r.params[a].double() for k, r in enumerate(results)), zero_a
                ).float()
                out[b] = sum(
                    (p[k] * r.params[b].double() for k, r in enumerate(results)), zero_b
                ).float()
        ranks = dict(ranks_of(state.extra))
        ranks.update({r.client_id: int(r.metrics["rank"]) for r in results if "rank" in r.metrics})
        return self.next_state(state, global_params=out, extra={**state.extra, RANKS: ranks})

    def round_rows(self, state: ServerState) -> list[dict]:
        ranks = ranks_of(state.extra)
        return (
            [{"scope": "ranks", "ranks": {str(c): r for c, r in sorted(ranks.items())}}]
            if ranks
            else []
        )

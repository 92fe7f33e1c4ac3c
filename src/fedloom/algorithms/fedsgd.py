"""FedSGD (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data", the E = 1, B = ∞ baseline).

Every sampled client takes exactly one plain gradient step on its whole local data set,
y_k = x_t - η ∇F_k(x_t) (all n_k examples, accumulated over micro-batches of
``train.batch_size`` so that memory stays bounded; SGD without momentum, weight decay or
clipping, fresh optimizer every round); the server averages by examples, so

    x_{t+1} = sum_k n_k y_k / sum_k n_k = x_t - η sum_k (n_k / n) ∇F_k(x_t),

one full-batch gradient step on the federated objective per round. η is ``train.lr``
(``train.head_lr`` for the head) on the schedule of ``train.schedule``. The server step
is FedAvg's (so ``weighting`` and ``[aggregation] rule`` apply).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fedloom.algorithms.base import ClientContext, ClientResult
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.params import Params


@register("fedsgd")
@dataclass(frozen=True)
class FedSGD(FedAvg):
    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        micro_batch = max(1, min(len(ctx.train), ctx.settings.batch_size))
        one_step = ctx.settings.model_copy(
            update={
                "local_steps": 1,
                "local_epochs": None,
                "batch_size": micro_batch,
                # one epoch of the bucketed stream is exactly ceil(n / b) micro-batches
                "grad_accum": max(1, math.ceil(len(ctx.train) / micro_batch)),
                "optimizer": "sgd",
                "momentum": 0.0,
                "weight_decay": 0.0,
                "clip_norm": 0.0,
                "optimizer_state": "reset",
            }
        )
        return super().local_train(replace(ctx, settings=one_step), payload)

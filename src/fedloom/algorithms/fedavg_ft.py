"""FedAvg + local fine-tuning (FedAvg-FT): the baseline every personalized method must beat.

Training is FedAvg's (:class:`FedAvg`: the global adapter θ^t is the weighted mean of the
clients' locally trained adapters, and it is scored as a global model too). To score its
personal model, client k fine-tunes a copy of the current global adapter on its own data:

    holdout H_k = a ``ft_holdout`` fraction of its training data (seeded), T_k the rest
    θ_k ← θ^t;  for up to ``ft_epochs`` passes over T_k (local optimizer, constant lr,
    fresh moments): every ``ft_eval_every`` steps (default: every pass) measure the loss
    on H_k; keep the fine-tuned adapter with the lowest holdout loss, stop after
    ``ft_patience`` measurements without improvement

Matsuda, Sasaki, Xiao & Onizuka (2022, "An Empirical Study of Personalized Federated
Learning") find this simple baseline competitive with dedicated personalized methods.

The global adapter itself is not a candidate: H_k was part of the data FedAvg trained it
on, so its holdout loss is optimistic and would favour it by construction (a fair choice
between the two needs data neither trained on, which the client does not spare).
The fine-tuning runs on a copy of the client's context with an empty state (its
optimizer moments live there under ``ft_optimizer``), so it never changes the client's
persistent state or its FedAvg training. With ``ft_holdout = 0`` (or a client of one
example) there is no holdout: the client fine-tunes ``ft_epochs`` passes and keeps the
result.

Defaults, chosen on the clients' validation splits of two federations no table reports
(``benchmarks/fedavg_ft_defaults.py``, seed 1, MiniLM + LoRA, FedAvg 8 rounds x 4 steps of
batch 8, lr 1e-3; one FedAvg run per federation, every grid point fine-tuned from its final
global adapter; mean validation accuracy over the clients):

    (ft_epochs, ft_patience, ft_holdout)   (2,1,0.2)  (3,1,0.2)  (1,1,0.2)  (2,1,0)  (3,1,0)  (1,1,0)
    MRPC, 3 of 10 clients swap labels        59.2 %     59.2 %     59.2 %    66.2 %   63.1 %   58.5 %
    four GLUE tasks, 2 clients each          66.4 %     65.6 %     61.7 %    57.0 %   60.2 %   55.5 %
    mean of the two                          62.8 %     62.4 %     60.5 %    61.6 %   61.7 %   57.0 %

The two federations disagree (without early stopping the label-swapped clients gain, the
64-example task clients lose); the mean picks ``ft_epochs = 2``, ``ft_patience = 1``,
``ft_holdout = 0.2``, the values first read off the clients' test losses, now chosen on
validation. Patience 2 scored as patience 1 everywhere. On the four GLUE tasks the global
adapter itself scored 69.5 % on validation, above every fine-tuned variant: with 64
examples of a task, fine-tuning gives back what the federation taught (on MRPC with swaps
the global adapter scored 62.3 %).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedloom.algorithms.base import ClientContext
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.data.holdout import hold_out
from fedloom.evaluation.score import evaluate
from fedloom.params import Params
from fedloom.train.local import train_locally

#: salt of the fine-tuning holdout's permutation (kept apart from the validation split's)
HOLDOUT_SALT = 0xF7


@register("fedavg_ft")
@dataclass(frozen=True)
class FedAvgFT(FedAvg):
    """FedAvg, then each client fine-tunes the global adapter on its own data (early
    stopping on a local holdout) to get its personal adapter."""

    per_example_client_step: ClassVar[bool] = True

    personalized = True
    has_global = True
    ft_epochs: float = 2.0
    ft_holdout: float = 0.2
    ft_patience: int = 1
    #: local steps between two holdout measurements (None: one pass over the data)
    ft_eval_every: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.ft_epochs > 0:
            raise ValueError(f"algorithm.ft_epochs: must be > 0 (got {self.ft_epochs})")
        if not 0 <= self.ft_holdout < 1:
            raise ValueError(f"algorithm.ft_holdout: must be in [0, 1) (got {self.ft_holdout})")
        if self.ft_patience < 1:
            raise ValueError(f"algorithm.ft_patience: must be >= 1 (got {self.ft_patience})")
        if self.ft_eval_every is not None and self.ft_eval_every < 1:
            raise ValueError(f"algorithm.ft_eval_every: must be >= 1 (got {self.ft_eval_every})")

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        """The global adapter fine-tuned on the client's data (``ctx.state`` untouched)."""

        train, holdout = hold_out(ctx.train, self.ft_holdout, (ctx.seed, HOLDOUT_SALT))
        settings = ctx.settings.model_copy(
            update={"optimizer_state": "persist", "schedule": "constant", "warmup_ratio": 0.0}
        )
        ft = ClientContext(
            ctx.client_id,
            ctx.model,
            train,
            settings,
            ctx.round,
            ctx.total_rounds,
            state={},
            seed=ctx.seed,
        )
        per_step = settings.batch_size * settings.grad_accum
        total = max(1, math.ceil(self.ft_epochs * len(train) / per_step))
        every = self.ft_eval_every or max(1, math.ceil(len(train) / per_step))

        def holdout_loss(params: Params) -> float:
            loss = evaluate(ctx.model, params, holdout, settings.batch_size)["loss"]
            if loss is None:  # only an empty holdout has none, and this path has one
                raise ValueError(f"client {ctx.client_id}: fedavg_ft's holdout has no loss")
            return loss

        best, best_loss = payload, math.inf
        ctx.model.set_params(payload)
        done, stale = 0, 0
        while done < total and stale < self.ft_patience:
            steps = min(every, total - done)
            ft.seed = int(np.random.default_rng([ctx.seed, done]).integers(2**31 - 1))
            train_locally(ft, state_key="ft_optimizer", steps=steps)
            done += steps
            current = ctx.model.get_params()
            if not holdout:
                best = current
                continue
            loss = holdout_loss(current)
            if loss < best_loss:
                best, best_loss, stale = current, loss, 0
            else:
                stale += 1
        return best

"""Local training by hand: gradients at any parameter values and hand-written update rules.

Methods whose local step is not "minimize one loss with the optimizer" (pFedMe's inner
problem, Per-FedAvg's meta-gradient, APFL's mixed model) build it from three pieces that
behave exactly like :func:`fedloom.train.local.train_locally`'s loop:

    batches = step_batches(ctx)                     # the seeded stream train_locally draws
    opt = ConfiguredOptimizer(ctx, start)           # train.optimizer, lr, head_lr, clip_norm,
    for _ in range(opt.steps):                      # schedule (same global clock), moments
        loss, grads = loss_and_grad(ctx.model, opt.params, next(batches))  # persisted
        opt.step(grads)                             # under state_key
    metrics = opt.finish()

That loop reproduces ``train_locally(ctx)`` (tests/test_personal_regularized.py checks
it on tiny-bert); a method changes what it feeds ``opt.step``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedloom.models.heads import feature_length
from fedloom.params import Params
from fedloom.train.batching import client_batches
from fedloom.train.local import build_optimizer, schedule_clock, schedule_step, steps_per_round
from fedloom.train.passes import count

if TYPE_CHECKING:
    from fedloom.client_context import ClientContext

#: one optimizer step's micro-batches (``train.grad_accum`` of them), each with its share
#: of the step's examples (the step's loss is the example-weighted mean)
Step = Sequence[tuple[float, Any]]


def step_batches(ctx: ClientContext) -> Iterator[Step]:
    """The client's endless stream of steps, drawn exactly as train_locally draws them
    (``train.batching``, seeded by ``ctx.seed``, which also seeds dropout; the model is put
    in training mode when the stream starts)."""
    settings, model = ctx.settings, ctx.model
    torch.manual_seed(ctx.seed)
    model.head.train()
    indices = client_batches(
        settings.batching,
        [feature_length(f) for f in ctx.train],
        settings.batch_size,
        np.random.default_rng(ctx.seed),
    )
    while True:
        micro = [next(indices) for _ in range(settings.grad_accum)]
        total = sum(len(ix) for ix in micro)
        yield [(len(ix) / total, model.head.collate([ctx.train[i] for i in ix])) for ix in micro]


def loss_and_grad(
    model: Any, params: Params, step: Step, *, seed: int | None = None, bf16: bool = False
) -> tuple[float, Params]:
    """The step's loss at ``params`` and its gradient over the trainable tensors.

    ``seed`` fixes the dropout masks for this call alone (the global RNG is left as it
    was): two calls with one seed differentiate the same function, as a finite
    difference of gradients needs. Raises FloatingPointError on a non-finite loss (the
    runtime then drops the client for the round, as it does for train_locally)."""
    if model.precision == "fp16":
        raise ValueError(
            'model.precision = "fp16": this method\'s hand-written update rule '
            'computes gradients without loss scaling; use "bf16" or "fp32"'
        )
    model.set_params(params)
    named = model.trainable_parameters()
    tensors = list(named.values())
    grads = [torch.zeros_like(t) for t in tensors]
    value = 0.0
    with torch.random.fork_rng(enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        for share, batch in step:
            with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model.loss(batch)
            parts = torch.autograd.grad(loss * share, tensors, allow_unused=True)
            count()
            for g, part in zip(grads, parts):
                if part is not None:
                    g += part
            value += loss.item() * share
    if not math.isfinite(value):
        raise FloatingPointError("non-finite loss in a local step")
    return value, dict(zip(named, grads))


def combine(a: Params, b: Params, scale_a: float = 1.0, scale_b: float = 1.0) -> Params:
    """scale_a · a + scale_b · b, name by name (e.g. ``combine(w, g, 1, -alpha)``)."""
    return {n: scale_a * a[n] + scale_b * b[n] for n in a}


class ConfiguredOptimizer:
    """The configured optimizer (:func:`~fedloom.train.local.build_optimizer`: LoRA
    factors at ``train.lr``, PQ-LoRA's P and Q at ``train.lr`` times
    ``train.pq_lr_scale``, the head at ``train.head_lr``) over leaf copies of ``start``,
    stepped with gradients the caller computes.

    Each :meth:`step` clips the gradient to ``train.clip_norm`` and sets the rates from
    the schedule at the next position of the round's clock (the one train_locally
    uses). With ``optimizer_state = "persist"`` the moments are loaded from and
    :meth:`finish` saves them to ``ctx.state[state_key]``."""

    def __init__(
        self,
        ctx: ClientContext,
        start: Params,
        state_key: str = "optimizer",
        steps: int | None = None,
    ) -> None:
        self.ctx, self.state_key = ctx, state_key
        self.settings = settings = ctx.settings
        self.steps = steps if steps is not None else steps_per_round(settings, len(ctx.train))
        self.total, self.offset, self.warmup = schedule_clock(
            settings, self.steps, ctx.round, ctx.total_rounds
        )
        # in the model's order, whatever ``start``'s: the persisted moments are by position
        self.leaves = {
            n: start[n].detach().clone().requires_grad_(True)
            for n in ctx.model.trainable_parameters()
        }
        self.optimizer = build_optimizer(settings, self.leaves)
        if settings.optimizer_state == "persist" and state_key in ctx.state:
            # a copy, as train_locally's: the saved moments wait for the server's acceptance
            self.optimizer.load_state_dict(copy.deepcopy(ctx.state[state_key]))
        self.taken = 0
        self.lr_sums = [0.0] * len(self.optimizer.param_groups)

    @property
    def params(self) -> Params:
        """A detached copy of the current values."""
        return {n: t.detach().clone() for n, t in self.leaves.items()}

    def step(self, grads: Params) -> None:
        schedule_step(
            self.optimizer,
            self.settings,
            self.offset + self.taken,
            self.total,
            self.warmup,
            self.lr_sums,
        )
        for n, t in self.leaves.items():
            t.grad = grads[n].detach().to(t.dtype).clone()
        if self.settings.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(self.leaves.values()), self.settings.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.taken += 1

    def finish(self) -> dict[str, float]:
        """Persist the moments (if configured); the learning-rate sums, as train_locally
        reports them (``lr_sum_adapters``, ``lr_sum_pq``, ``lr_sum_head``)."""
        if self.settings.optimizer_state == "persist":
            self.ctx.state[self.state_key] = self.optimizer.state_dict()
        return {f"lr_sum_{g['kind']}": s for g, s in zip(self.optimizer.param_groups, self.lr_sums)}

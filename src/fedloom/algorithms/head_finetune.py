"""Fine-tuning an adapter on one client's own training data before it is scored: the
personalization step of FedBABU (its head, or the whole adapter) and of the label-prior
oracle's ``head_finetune`` variant.

    θ_k ← θ;   ``epochs`` passes over the client's training data D_k, i.e.
               ⌈epochs · |D_k| / (batch_size · grad_accum)⌉ steps of local training
               (:func:`fedloom.train.local.train_locally`) on the head alone (every
               non-LoRA tensor, :data:`fedloom.algorithms.sharing.HEAD`) or on the whole
               adapter; the local optimizer at its learning rates (``train.lr``, the head
               at ``train.head_lr``), constant, with fresh moments

It runs on a copy of the client's context with an empty state, so it never changes the
client's persistent state (optimizer moments, personal tensors) or its next round of
training. The copy has no sample-level DP (as FedAvg-FT's fine-tuning): the adapter never
leaves the client, only its scores do. Its passes are counted where they are taken, and
the client host reports them as the scored adapter's ``adapt_passes``
(:mod:`fedloom.train.passes`).
"""

from __future__ import annotations

import dataclasses
import math

from fedloom.algorithms import sharing
from fedloom.client_context import ClientContext
from fedloom.params import Params
from fedloom.train.local import train_locally


def head_names(names: list[str]) -> list[str]:
    """The head's tensors among ``names``: every one that is not a LoRA factor."""
    return sharing.select(names, (sharing.HEAD,))


def fine_tune_steps(ctx: ClientContext, epochs: float) -> int:
    """The optimizer steps of ``epochs`` passes over the client's training data."""
    per_step = ctx.settings.batch_size * ctx.settings.grad_accum
    return max(1, math.ceil(epochs * len(ctx.train) / per_step))


def fine_tune(ctx: ClientContext, adapter: Params, epochs: float, *, head_only: bool) -> Params:
    """``adapter`` fine-tuned for ``epochs`` passes over ``ctx.train``: only the head with
    ``head_only``, else every tensor (``ctx.state`` untouched)."""

    settings = ctx.settings.model_copy(
        update={"optimizer_state": "reset", "schedule": "constant", "warmup_ratio": 0.0}
    )
    copy = dataclasses.replace(ctx, settings=settings, state={}, privacy=None)
    ctx.model.set_params(adapter)
    only = head_names(ctx.model.param_names) if head_only else None
    train_locally(copy, only=only, state_key="ft_optimizer", steps=fine_tune_steps(ctx, epochs))
    return ctx.model.get_params()

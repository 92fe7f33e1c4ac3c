"""The local-training step shared by every algorithm.

One client round = ``steps_per_round`` optimizer steps over the client's shuffled data
(``local_steps``, or ``local_epochs`` passes of ``batch_size * grad_accum`` examples),
with AdamW or SGD, separate learning rates for LoRA factors, PQ-LoRA's P and Q and the
head, gradient clipping, gradient accumulation, optional bf16 autocast and a
learning-rate schedule on the global clock of :mod:`fedloom.train.schedules`.

With ``optimizer_state = "persist"`` the optimizer's moments live in the client's local
state and carry over to its next round (re-creating AdamW every round restarts its bias
correction and throws away the second-moment estimates, which made early local steps
far too large).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from fedloom.config import TrainConfig
from fedloom.models.heads import feature_length
from fedloom.models.pqlora import is_pq
from fedloom.train.batching import client_batches
from fedloom.train.dp_sgd import run_dp_steps
from fedloom.train.passes import count
from fedloom.train.scaler import keep_scale, loss_scaler
from fedloom.train.schedules import lr_factor

if TYPE_CHECKING:
    from fedloom.client_context import ClientContext

LossHook = Callable[[], torch.Tensor]
LrGroup = Literal["adapters", "pq", "head"]


def steps_per_round(settings: TrainConfig, num_examples: int) -> int:
    if settings.local_steps is not None:
        return settings.local_steps
    per_step = settings.batch_size * settings.grad_accum
    epochs = settings.local_epochs
    assert epochs is not None  # the config sets exactly one of local_steps, local_epochs
    return max(1, math.ceil(epochs * num_examples / per_step))


def schedule_clock(
    settings: TrainConfig, steps: int, round_: int, total_rounds: int
) -> tuple[int, int, int]:
    """(total, offset, warmup) of the schedule's clock for a round of ``steps`` steps: the
    round's first step is at ``offset`` of ``total`` (the whole run with
    ``schedule_scope = "run"``, the round alone with ``"round"``)."""
    per_run = settings.schedule_scope == "run"
    total = steps * total_rounds if per_run else steps
    offset = round_ * steps if per_run else 0
    return total, offset, int(settings.warmup_ratio * total)


#: the learning-rate groups of local training, in the optimizer's order
GROUPS: tuple[LrGroup, ...] = ("adapters", "pq", "head")


def lr_group(name: str) -> LrGroup:
    """The learning-rate group of tensor ``name``: "pq" for PQ-LoRA's P and Q (FedMosaic's
    mosaic model, :mod:`fedloom.models.pqlora`), "adapters" for every other LoRA tensor
    (factors, gates), "head" for the rest."""
    if is_pq(name):
        return "pq"
    return "adapters" if "lora_" in name else "head"


def group_lr(group: LrGroup, settings: TrainConfig) -> tuple[str, float]:
    """(config key, learning rate) of ``group``: the adapters at ``train.lr``, P and Q at
    ``train.lr`` times ``train.pq_lr_scale``, the head at ``train.head_lr`` (``train.lr``
    when unset)."""
    if group == "pq":
        return "train.pq_lr_scale", settings.lr * settings.pq_lr_scale
    if group == "head" and settings.head_lr is not None:
        return "train.head_lr", settings.head_lr
    return "train.lr", settings.lr


def build_optimizer(
    settings: TrainConfig, named: Mapping[str, torch.Tensor]
) -> torch.optim.Optimizer:
    """One parameter group per :func:`lr_group` at its :func:`group_lr`, in the order of
    :data:`GROUPS`, each tagged ``kind`` = its group (empty groups are left out)."""
    members: dict[LrGroup, list[torch.Tensor]] = {g: [] for g in GROUPS}
    for n, p in named.items():
        members[lr_group(n)].append(p)
    groups = [
        {"params": params, "lr": group_lr(kind, settings)[1], "kind": kind}
        for kind, params in members.items()
        if params
    ]
    for g in groups:
        g["initial_lr"] = g["lr"]
    if settings.optimizer == "sgd":
        return torch.optim.SGD(
            groups, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay
        )
    return torch.optim.AdamW(groups, lr=settings.lr, weight_decay=settings.weight_decay)


def schedule_step(
    optimizer: torch.optim.Optimizer,
    settings: TrainConfig,
    position: int,
    total: int,
    warmup: int,
    lr_sums: list[float],
) -> None:
    """Set every group's learning rate for the step at ``position`` of the schedule's clock
    (its ``initial_lr`` times :func:`lr_factor`) and add it to the group's ``lr_sums``."""
    factor = lr_factor(settings.schedule, position, total, warmup)
    for i, group in enumerate(optimizer.param_groups):
        group["lr"] = group["initial_lr"] * factor
        lr_sums[i] += group["lr"]


@contextmanager
def training_only(
    everything: dict[str, torch.nn.Parameter], chosen: Collection[str]
) -> Iterator[None]:
    """Freeze every trainable tensor outside ``chosen`` for the block (no gradient is
    computed for it), then restore."""
    frozen = [p for n, p in everything.items() if n not in chosen and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def train_locally(
    ctx: ClientContext,
    extra_loss: LossHook | None = None,
    *,
    only: Collection[str] | None = None,
    state_key: str = "optimizer",
    steps: int | None = None,
    example_weights: Sequence[float] | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Run one round of local training in place on ``ctx.model``; return metrics:
    ``train_loss`` (mean over steps), ``local_steps``, and the sums of the learning rates
    applied to each :func:`lr_group` that trains (``lr_sum_adapters``, ``lr_sum_pq``,
    ``lr_sum_head``: the K * eta_l of methods that normalize by the local progress, e.g.
    SCAFFOLD).

    ``extra_loss`` lets an algorithm add a term to the objective (e.g. a proximal term);
    ``only`` restricts training to those tensors (the others stay frozen, e.g. FedRep's
    head phase); ``state_key`` names where the optimizer's moments persist in
    ``ctx.state`` (a method training two adapters keeps two); ``steps`` overrides the
    round's step budget; ``example_weights`` (one per training example) makes a batch's
    loss the weighted mean (1/|B|) Σ_i w_i ℓ_i of the examples' losses (e.g. FedEM's
    M-step, weighted by the E-step's responsibilities); ``extra_tensors`` are tensors
    outside the model that the objective reads (through a hook or ``extra_loss``, e.g.
    FedDBE's representation bias), trained by the same optimizer beside the model's (in
    the :func:`lr_group` of their names) and updated in place, their moments persisted
    under ``state_key`` with the model's.
    """
    settings, model = ctx.settings, ctx.model
    n = len(ctx.train)
    if n == 0:
        raise ValueError(f"client {ctx.client_id}: no training examples")
    if example_weights is not None and len(example_weights) != n:
        raise ValueError(
            f"client {ctx.client_id}: {len(example_weights)} example weights "
            f"for {n} training examples"
        )
    if steps is None:
        steps = steps_per_round(settings, n)
    total, offset, warmup = schedule_clock(settings, steps, ctx.round, ctx.total_rounds)
    named = model.trainable_parameters()
    if only is not None:
        named = {n: p for n, p in named.items() if n in only}
        if not named:
            raise ValueError(f"client {ctx.client_id}: nothing to train (no tensor selected)")
    if ctx.privacy is not None:  # sample-level DP: DP-SGD through Opacus
        if extra_loss is not None or example_weights is not None or extra_tensors:
            raise ValueError(
                f"client {ctx.client_id}: DP-SGD clips each example's gradient, so the "
                f"objective must be a mean of per-example losses (no extra loss term, no "
                f"example weights, no tensor outside the model)"
            )
        with training_only(model.trainable_parameters(), named):
            return run_dp_steps(
                ctx,
                named,
                steps,
                lambda opt, step, sums: schedule_step(
                    opt, settings, offset + step, total, warmup, sums
                ),
                state_key,
            )
    with training_only(model.trainable_parameters(), named):
        tensors: dict[str, torch.Tensor] = {**named, **(extra_tensors or {})}
        return _run_steps(
            ctx,
            tensors,
            steps,
            total,
            offset,
            warmup,
            extra_loss,
            state_key,
            None
            if example_weights is None
            else torch.as_tensor(example_weights, dtype=torch.float32),
        )


def _run_steps(
    ctx: ClientContext,
    named: dict[str, torch.Tensor],
    steps: int,
    total: int,
    offset: int,
    warmup: int,
    extra_loss: LossHook | None,
    state_key: str,
    weights: torch.Tensor | None,
) -> dict[str, float]:
    settings, model = ctx.settings, ctx.model
    optimizer = build_optimizer(settings, named)
    if settings.optimizer_state == "persist" and state_key in ctx.state:
        # a copy: the optimizer steps the tensors it loads in place, and the saved moments
        # must stay as they were until the server accepts this round
        optimizer.load_state_dict(copy.deepcopy(ctx.state[state_key]))

    torch.manual_seed(ctx.seed)  # dropout masks
    batches = client_batches(
        settings.batching,
        [feature_length(f) for f in ctx.train],
        settings.batch_size,
        np.random.default_rng(ctx.seed),
    )
    model.head.train()
    scaler = loss_scaler(model, ctx.state, state_key)
    # every micro-batch's (loss, share): read once at the end, so that a device never waits
    # on the host between steps
    parts: list[list[tuple[torch.Tensor, float]]] = []
    lr_sums = [0.0] * len(optimizer.param_groups)
    params = list(named.values())
    if weights is not None:
        weights = weights.to(model.device)
    for step in range(steps):
        schedule_step(optimizer, settings, offset + step, total, warmup, lr_sums)
        optimizer.zero_grad(set_to_none=True)
        micro = [next(batches) for _ in range(settings.grad_accum)]
        step_examples = sum(len(indices) for indices in micro)
        parts.append([])
        for indices in micro:
            # example-weighted: the step's gradient is the mean over all its examples,
            # also when the last micro-batch of an epoch is smaller
            share = len(indices) / step_examples
            batch = model.head.collate([ctx.train[i] for i in indices])
            with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=settings.bf16):
                if weights is None:
                    loss = model.loss(batch)
                else:
                    loss = (model.example_losses(batch) * weights[indices]).mean()
                if extra_loss is not None:
                    loss = loss + extra_loss()
            scaler.scale(loss * share).backward()
            count()
            parts[-1].append((loss.detach(), share))
        if settings.clip_norm > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, settings.clip_norm)
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    losses = _step_losses(parts, ctx.client_id)
    if settings.optimizer_state == "persist":
        ctx.state[state_key] = optimizer.state_dict()
        keep_scale(scaler, ctx.state, state_key)
    metrics = {"train_loss": float(np.mean(losses)), "local_steps": float(steps)}
    for group, lr_sum in zip(optimizer.param_groups, lr_sums):
        metrics[f"lr_sum_{group['kind']}"] = lr_sum
    return metrics


def _step_losses(parts: list[list[tuple[torch.Tensor, float]]], client_id: int) -> list[float]:
    """Each step's loss, the share-weighted sum of its micro-batches' losses; a
    FloatingPointError naming the first step whose loss is not finite."""
    values = torch.stack([loss.float() for step in parts for loss, _ in step]).tolist()
    losses, at = [], 0
    for step, micro in enumerate(parts):
        step_loss = 0.0
        for _, share in micro:
            step_loss += values[at] * share
            at += 1
        if not math.isfinite(step_loss):
            raise FloatingPointError(f"client {client_id}: non-finite loss at local step {step}")
        losses.append(step_loss)
    return losses

"""Many clients, one pass: K clients' local rounds trained as one batched forward and
backward, equal to training them one by one (:func:`fedloom.train.local.train_locally`).

Each step stacks the clients' batches into one, client k's rows contiguous in block k
(``b`` rows each; a client with fewer examples in a step fills its block with copies
weighted 0). Every trainable tensor is held as a stacked leaf ``S[n]`` of shape
(K, *shape), and every linear layer that owns one (LoRA's A and B, the classifier) computes
block k with client k's slice:

    y_k = x_k W_k^T + b_k        (one batched matmul, ``torch.baddbmm``, for all k)

The loss is Σ_k L_k with L_k = (1/n_k) Σ_{i in block k} ℓ_i client k's mean loss over its
n_k real examples. No example's output depends on another's (attention, layer norm and
pooling act within an example), so ∂(Σ_j L_j)/∂S[n][k] = ∂L_k/∂θ_k[n]: one backward pass
gives every client its own gradient. AdamW and SGD update each element from its own
gradient and moments, so one optimizer over the stacked leaves is K independent
optimizers (the moments stack and split exactly); gradient clipping is per client, over
its slices (torch's ``clip_grad_norm_`` rule, coefficient max_norm / (‖g_k‖ + 1e-6) capped
at 1). The schedule is the same clock for clients of the same step count.

Exactly equal to one by one up to floating-point reassociation (a longer padded width,
batched matmuls) when nothing is random; with dropout the masks are drawn for the stacked
batch (the first client's seed), equal to one by one in distribution, not in value.

Why by hand: PEFT's mixed-adapter batches (``adapter_names``) are inference only, and
``torch.func.vmap`` over the stacked weights stops at Hugging Face's data-dependent
attention-mask code. Supported: an encoder with the classifier head whose every trainable
tensor is the weight or bias of an ``nn.Linear`` (LoRA as built by ``model.adapters =
"lora"``), ``train.grad_accum = 1``, and a method whose local step is plain local training
(:func:`supported`); everything else trains one by one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedloom.config import TrainConfig
from fedloom.models.fedmodel import FedModel, clean_name
from fedloom.models.heads import ClassifierHead, feature_length
from fedloom.params import Params
from fedloom.train.batching import client_batches
from fedloom.train.local import build_optimizer, schedule_clock, schedule_step, steps_per_round
from fedloom.train.passes import count

if TYPE_CHECKING:
    from fedloom.client_context import ClientContext


def linear_owners(model: FedModel) -> dict[str, tuple[nn.Linear, str]] | None:
    """Every trainable tensor's name -> (the ``nn.Linear`` owning it, "weight" or "bias"),
    or None when one is not owned by a linear layer (the model cannot train together)."""
    owners = {}
    for raw, param in model.head.named_parameters():
        if not param.requires_grad:
            continue
        path, attr = raw.rsplit(".", 1)
        module = model.head.get_submodule(path)
        if not isinstance(module, nn.Linear) or attr not in ("weight", "bias"):
            return None
        owners[clean_name(raw)] = (module, attr)
    return owners if set(owners) == set(model.param_names) else None


def supported(model: FedModel, settings: TrainConfig) -> str | None:
    """Why ``model`` under ``settings`` (``[train]``) cannot train clients together, or
    None when it can."""
    if not isinstance(model.head, ClassifierHead):
        return 'only the classifier head (model.head = "classifier")'
    if settings.grad_accum != 1:
        return "train.grad_accum > 1"
    if model.precision == "fp16":
        # one scaler over the stacked leaves would skip every client's step when one
        # client's gradient overflows
        return 'model.precision = "fp16" (its loss scale is per client)'
    if linear_owners(model) is None:
        return 'a trainable tensor outside a linear layer (model.adapters other than "lora")'
    return None


def group_key(ctx: ClientContext, state_key: str = "optimizer") -> tuple[int, Any]:
    """Clients train together only with the same step count this round and the same
    persisted optimizer step (AdamW's bias correction is one clock per stacked tensor)."""
    steps = steps_per_round(ctx.settings, len(ctx.train))
    saved = ctx.state.get(state_key) if ctx.settings.optimizer_state == "persist" else None
    clock = None
    if saved is not None:
        clock = tuple(float(s["step"]) if "step" in s else None for s in saved["state"].values())
    return steps, clock


@contextmanager
def stacked_linears(
    owners: dict[str, tuple[nn.Linear, str]], stacked: dict[str, torch.Tensor], k: int
) -> Iterator[None]:
    """Within the block each owning linear layer computes block j of its input with client
    j's slices of ``stacked`` (its own tensor where one is not trainable)."""
    by_module: dict[nn.Linear, dict[str, torch.Tensor]] = {}
    for name, (module, attr) in owners.items():
        by_module.setdefault(module, {})[attr] = stacked[name]

    def forward_of(module: nn.Linear, tensors: dict[str, torch.Tensor]):
        weight = tensors.get("weight")
        bias = tensors.get("bias")

        def forward(x: torch.Tensor) -> torch.Tensor:
            w = weight if weight is not None else module.weight.expand(k, *module.weight.shape)
            blocks = x.reshape(k, -1, x.shape[-1])
            out = torch.bmm(blocks, w.transpose(1, 2).to(blocks.dtype))
            if bias is not None:
                out = out + bias.unsqueeze(1).to(out.dtype)
            elif module.bias is not None:
                out = out + module.bias.to(out.dtype)
            return out.reshape(*x.shape[:-1], out.shape[-1])

        return forward

    for module, tensors in by_module.items():
        # patched on the instance and deleted below: mypy sees a method assigned
        module.forward = forward_of(module, tensors)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in by_module:
            del module.forward


def _stack_state(saved: Sequence[dict[str, Any] | None], optimizer: torch.optim.Optimizer) -> None:
    """Load the clients' persisted optimizer states, stacked, into ``optimizer``."""
    states = [s for s in saved if s is not None]
    if len(states) < len(saved):
        return
    merged: dict[str, Any] = {"param_groups": states[0]["param_groups"], "state": {}}
    for index, first in states[0]["state"].items():
        merged["state"][index] = {
            key: (
                torch.stack([s["state"][index][key] for s in states])
                if _stacked(value)
                else value.clone()
                if torch.is_tensor(value)
                else value
            )
            for key, value in first.items()
        }  # copies: the saved states stay as they were
    optimizer.load_state_dict(merged)


def _split_state(optimizer: torch.optim.Optimizer, j: int) -> dict[str, Any]:
    """Client j's optimizer state, as :func:`train_locally` would have saved it."""
    whole = optimizer.state_dict()
    return {
        "param_groups": whole["param_groups"],
        "state": {
            index: {
                key: (
                    value[j].clone()
                    if _stacked(value)
                    else value.clone()
                    if torch.is_tensor(value)
                    else value
                )
                for key, value in entry.items()
            }
            for index, entry in whole["state"].items()
        },
    }


def _stacked(value: Any) -> bool:
    """Whether an optimizer state entry is per element (moments), not a clock (``step``)."""
    return torch.is_tensor(value) and value.dim() > 0


def train_together(
    ctxs: Sequence[ClientContext],
    starts: Sequence[Params],
    state_key: str = "optimizer",
) -> list[tuple[Params | None, dict[str, float], str | None]]:
    """Train every client of ``ctxs`` from its ``starts`` adapter for one round, together;
    per client (its trained adapter, its metrics as :func:`train_locally` returns them,
    None) or (None, {}, the reason it failed: a non-finite loss). The clients share one
    model and one :func:`group_key`; their persisted optimizer moments are read from and
    written to their ``ctx.state`` as one by one. The model's own tensors are unchanged."""
    model, settings = ctxs[0].model, ctxs[0].settings
    k = len(ctxs)
    reason = supported(model, settings)
    if reason is not None:
        raise ValueError(f"clients cannot train together: {reason}")
    if len({group_key(c, state_key) for c in ctxs}) != 1:
        raise ValueError("clients train together only with the same steps and optimizer clock")
    owners = linear_owners(model)
    assert owners is not None
    names = model.param_names
    stacked = {n: torch.stack([s[n] for s in starts]).float().requires_grad_(True) for n in names}
    optimizer = build_optimizer(settings, stacked)
    if settings.optimizer_state == "persist":
        _stack_state([c.state.get(state_key) for c in ctxs], optimizer)

    steps = steps_per_round(settings, len(ctxs[0].train))
    total, offset, warmup = schedule_clock(settings, steps, ctxs[0].round, ctxs[0].total_rounds)
    streams = [
        client_batches(
            settings.batching,
            [feature_length(f) for f in c.train],
            settings.batch_size,
            np.random.default_rng(c.seed),
        )
        for c in ctxs
    ]
    torch.manual_seed(ctxs[0].seed)  # dropout masks, drawn for the stacked batch
    frozen = [p for p in model.trainable_parameters().values()]
    for p in frozen:
        p.requires_grad_(False)
    model.head.train()
    step_losses: list[torch.Tensor] = []
    lr_sums = [0.0] * len(optimizer.param_groups)
    try:
        with stacked_linears(owners, stacked, k):
            for step in range(steps):
                schedule_step(optimizer, settings, offset + step, total, warmup, lr_sums)
                optimizer.zero_grad(set_to_none=True)
                picks = [next(s) for s in streams]
                width = max(len(ix) for ix in picks)
                features, weights = [], []
                for ctx, ix in zip(ctxs, picks):
                    rows = list(ix) + [ix[0]] * (width - len(ix))
                    features += [ctx.train[i] for i in rows]
                    weights += [1.0 / len(ix)] * len(ix) + [0.0] * (width - len(ix))
                batch = model.head.collate(features)
                with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=settings.bf16):
                    per_example = model.example_losses(batch)
                shares = torch.tensor(weights, device=model.device)
                per_client = (per_example * shares).reshape(k, width).sum(1)
                per_client.sum().backward()
                count()  # one pass of each client: the group's count is each one's
                step_losses.append(per_client.detach())  # read once, after the last step
                if settings.clip_norm > 0:
                    _clip_per_client([stacked[n] for n in names], settings.clip_norm, k)
                optimizer.step()
    finally:
        for p in frozen:
            p.requires_grad_(True)
    optimizer.zero_grad(set_to_none=True)
    losses, failed = _client_losses(step_losses, ctxs)
    out: list[tuple[Params | None, dict[str, float], str | None]] = []
    for j, ctx in enumerate(ctxs):
        if j in failed:
            out.append((None, {}, failed[j]))
            continue
        if settings.optimizer_state == "persist":
            ctx.state[state_key] = _split_state(optimizer, j)
        metrics = {"train_loss": float(np.mean(losses[j])), "local_steps": float(steps)}
        for group, lr_sum in zip(optimizer.param_groups, lr_sums):
            metrics[f"lr_sum_{group['kind']}"] = lr_sum
        out.append(({n: stacked[n][j].detach().clone() for n in names}, metrics, None))
    return out


def _clip_per_client(tensors: Sequence[torch.Tensor], max_norm: float, k: int) -> None:
    """Each client's gradient (its slices of every stacked tensor) clipped to ``max_norm``
    as ``torch.nn.utils.clip_grad_norm_`` clips one client's."""
    grads = [t.grad for t in tensors if t.grad is not None]
    norms = torch.stack([g.reshape(k, -1).float().pow(2).sum(1) for g in grads]).sum(0).sqrt()
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.reshape(k, *([1] * (g.dim() - 1))).to(g.dtype))


def _client_losses(
    step_losses: Sequence[torch.Tensor], ctxs: Sequence[ClientContext]
) -> tuple[list[list[float]], dict[int, str]]:
    """Each client's loss at every step (from the (K,) loss of each step), and the clients
    whose loss was not finite, each with the first such step."""
    by_step = torch.stack(list(step_losses)).tolist() if step_losses else []
    losses: list[list[float]] = [[] for _ in ctxs]
    failed: dict[int, str] = {}
    for step, values in enumerate(by_step):
        for j, value in enumerate(values):
            losses[j].append(value)
            if not math.isfinite(value) and j not in failed:
                failed[j] = f"client {ctxs[j].client_id}: non-finite loss at local step {step}"
    return losses, failed

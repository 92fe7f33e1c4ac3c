"""Sample-level differential privacy in local training: DP-SGD (Abadi et al. 2016) through
Opacus.

Each step draws a Poisson sample of the client's examples (each with probability
q = batch_size / n), computes every example's gradient of the trainable tensors (the LoRA
factors and the head: PEFT's ``lora_A`` / ``lora_B`` and the classifier are ``nn.Linear``,
whose per-example gradients Opacus' ``GradSampleModule`` computes), clips each to L2 norm C,
sums them, adds N(0, (zC)²) and divides by the expected batch size (Opacus'
``DPOptimizer``), then takes the configured optimizer's step (AdamW or SGD: post-processing
of the noised gradient). fedloom writes no per-example gradient code of its own.

The client accounts its own steps: every step is a Poisson-subsampled Gaussian of
multiplier z at rate q, composed over every step the client has taken in the run (kept in
its local state, so a round the server rejects is not counted twice), with dp-accounting
(:mod:`fedloom.privacy.accountant`); ε at δ_k = n_k^-1.1 is reported with the client's
update. How fedloom differs from Opacus' ``PrivacyEngine``: the batches are fedloom's own
Poisson draws from the client's seeded stream (no DataLoader), and the accountant is
dp-accounting's rather than Opacus'.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedloom.privacy import accountant
from fedloom.train.passes import count

if TYPE_CHECKING:
    from fedloom.client_context import ClientContext

#: where a client keeps the count of its DP-SGD steps in its local state
STEPS_KEY = "dp_sgd_steps"


def poisson_batch(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """The indices of a Poisson sample: each of the n examples with probability ``rate``."""
    return np.flatnonzero(rng.random(n) < rate)


def client_delta(n: int) -> float:
    """δ_k = 1 / n_k^1.1 for a client of n_k examples."""
    return float(n**-1.1)


def client_epsilon(
    z: float, rate: float, steps: int, n: int, name: accountant.AccountantName
) -> float:
    release = accountant.release(z, rate, steps, "poisson")
    return accountant.epsilon_of([release], client_delta(n), name)


def run_dp_steps(
    ctx: ClientContext,
    named: dict[str, torch.nn.Parameter],
    steps: int,
    schedule: Any,
    state_key: str,
) -> dict[str, float]:
    """``steps`` DP-SGD steps on ``named``; the round's metrics with the client's ε and
    δ. ``schedule(optimizer, step, lr_sums)`` sets the learning rates of a step."""
    # Opacus costs 1.5 s to import: only a run with DP-SGD pays it
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    from fedloom.train.local import _step_losses, build_optimizer  # (it imports this module)

    privacy, settings, model = ctx.privacy, ctx.settings, ctx.model
    assert privacy is not None
    z = 1.0 if privacy.noise_multiplier is None else privacy.noise_multiplier
    n = len(ctx.train)
    rate = min(1.0, settings.batch_size / n)
    optimizer = build_optimizer(settings, named)
    if settings.optimizer_state == "persist" and state_key in ctx.state:
        optimizer.load_state_dict(copy.deepcopy(ctx.state[state_key]))
    private = DPOptimizer(
        optimizer,
        noise_multiplier=z,
        max_grad_norm=privacy.clip_norm,
        expected_batch_size=max(1, round(rate * n)),
        loss_reduction="mean",
    )
    torch.manual_seed(ctx.seed)  # dropout masks and the noise
    rng = np.random.default_rng(ctx.seed)
    model.head.train()
    wrapped = GradSampleModule(model.head, loss_reduction="mean")
    params = list(named.values())
    parts: list[list[tuple[torch.Tensor, float]]] = []
    lr_sums = [0.0] * len(optimizer.param_groups)
    try:
        for step in range(steps):
            schedule(optimizer, step, lr_sums)
            private.zero_grad(set_to_none=True)
            indices = poisson_batch(n, rate, rng)
            if len(indices) == 0:  # an empty draw still takes its noised step
                for p in params:  # Opacus reads per-example gradients from this attribute
                    none = torch.zeros((0, *p.shape), device=p.device, dtype=p.dtype)
                    p.grad_sample = none  # type: ignore[attr-defined]
                parts.append([])
            else:
                loss = model.loss(model.head.collate([ctx.train[i] for i in indices]))
                with warnings.catch_warnings():
                    # Opacus' hooks on modules whose inputs need no gradient (the frozen
                    # embeddings feed the first LoRA layer): torch says so, harmlessly
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    loss.backward()
                count()
                parts.append([(loss.detach(), 1.0)])
            private.step()
    finally:
        wrapped._close()  # the hooks off: scoring and other methods see the plain module
        for p in params:
            p.grad_sample = None  # type: ignore[attr-defined]
    private.zero_grad(set_to_none=True)
    losses = _step_losses([p for p in parts if p], ctx.client_id) or [float("nan")]
    if settings.optimizer_state == "persist":
        ctx.state[state_key] = optimizer.state_dict()
    taken = int(ctx.state.get(STEPS_KEY, 0)) + steps
    ctx.state[STEPS_KEY] = taken
    name = privacy.accountant or "pld"
    metrics: dict[str, float] = {
        "train_loss": float(np.mean(losses)),
        "local_steps": float(steps),
        "epsilon": client_epsilon(z, rate, taken, n, name),
        "delta": client_delta(n),
    }
    for group, lr_sum in zip(optimizer.param_groups, lr_sums):
        metrics[f"lr_sum_{group['kind']}"] = lr_sum
    return metrics


def summary(per_client: Mapping[int, float], privacy: Any) -> dict[str, Any]:
    """summary.json's ``privacy`` for sample-level DP: the largest client ε and each one."""
    return {
        "level": "sample",
        "epsilon": max(per_client.values()) if per_client else 0.0,
        "per_client_epsilon": {str(c): e for c, e in sorted(per_client.items())},
        "noise_multiplier": 1.0 if privacy.noise_multiplier is None else privacy.noise_multiplier,
        "clip_norm": privacy.clip_norm,
        "accountant": privacy.accountant or "pld",
        "delta": "1 / n_k^1.1 for a client of n_k examples",
    }

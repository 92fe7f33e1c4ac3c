"""Dynamic loss scaling for float16 training (``model.precision = "fp16"``, CUDA).

float16 flushes gradients below about 6e-8 to zero, so the loss is multiplied by a scale
S before the backward pass and the gradients divided by S before clipping and the step;
a step whose gradients overflow is skipped and S halved, and S doubles after 2000 clean
steps (Micikevicius et al. 2018, "Mixed Precision Training"; torch's ``GradScaler``, which
fedloom uses as it is). bfloat16 and float32 need no scaling: the scaler is then torch's
disabled one, which passes the loss, the unscale and the step through unchanged.

A client's scale persists in its local state beside its optimizer moments (under
``<state_key>/grad_scaler``), so it is not re-learnt, with skipped steps, every round.
"""

from __future__ import annotations

from typing import Any

import torch

from fedloom.models.fedmodel import FedModel


def _key(state_key: str) -> str:
    return f"{state_key}/grad_scaler"


def loss_scaler(model: FedModel, state: dict[str, Any], state_key: str) -> torch.amp.GradScaler:
    """The scaler of a client's local training on ``model``: enabled for "fp16" only, its
    scale restored from the client's ``state``."""
    scaler = torch.amp.GradScaler(model.device.type, enabled=model.precision == "fp16")
    if scaler.is_enabled() and _key(state_key) in state:
        scaler.load_state_dict(dict(state[_key(state_key)]))
    return scaler


def keep_scale(scaler: torch.amp.GradScaler, state: dict[str, Any], state_key: str) -> None:
    """Save the scaler's scale into the client's ``state`` (nothing when disabled)."""
    if scaler.is_enabled():
        state[_key(state_key)] = scaler.state_dict()

"""The gradient FedMosaic's RELA compares clients by (Seo et al., ICLR 2026, arXiv
2506.11024, Sec. 3.1): the gradient of a client's loss on its own data with respect to
one fixed, frozen weight of an anchor model the whole federation shares,

    G_k = mean over sampled batches b of  ∂L_k(b) / ∂W_probe,

W_probe being the last block's MLP output projection (BERT ``output.dense``, Llama
``mlp.down_proj``). The anchor is the backbone at its initial adapter (LoRA B = 0, PQ-LoRA
P = Q = 0: exactly the pretrained function) with the initial head, in evaluation mode (no
dropout, no gate noise), so G_k depends on the client's data only, never on its training
state, and every client of a backbone computes it on the same function. The batches are
``ceil(steps / grad_every)`` batches of the training batch size drawn from the client's
data: one per ``grad_every`` local steps, as the official code samples one every
``grad_freq`` steps.

The official code derives the gradient by hand from the anchor LM's logits (a closed form
through the final RMSNorm); here autograd computes it for any head, with every other
tensor frozen so that nothing else gets a gradient.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature
from fedloom.train.local import training_only
from fedloom.train.passes import count

#: the MLP output projection of a block, by model type (group 1: the block's index)
PROBES: dict[str, str] = {
    "bert": r"encoder\.layer\.(\d+)\.output\.dense$",
    "roberta": r"encoder\.layer\.(\d+)\.output\.dense$",
    "llama": r"layers\.(\d+)\.mlp\.down_proj$",
    "mistral": r"layers\.(\d+)\.mlp\.down_proj$",
    "qwen2": r"layers\.(\d+)\.mlp\.down_proj$",
    "gpt2": r"h\.(\d+)\.mlp\.c_proj$",
    "distilbert": r"transformer\.layer\.(\d+)\.ffn\.lin2$",
}


def probe_weight(model: FedModel) -> nn.Parameter:
    """The (frozen) weight of the last block's MLP output projection of ``model``'s backbone."""
    transformer = model.transformer
    model_type = getattr(getattr(transformer, "config", None), "model_type", "")
    if model_type not in PROBES:
        raise ValueError(
            f"algorithm fedmosaic: no probe weight known for model type {model_type!r} "
            f"(known: {', '.join(PROBES)})"
        )
    pattern = re.compile(PROBES[model_type])
    found: dict[int, nn.Module] = {}
    for name, module in transformer.named_modules():
        match = pattern.search(name)
        if match is not None:
            found[int(match.group(1))] = module
    if not found:
        raise ValueError(
            f"algorithm fedmosaic: the backbone has no module matching {pattern.pattern}"
        )
    module = found[max(found)]
    base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
    return cast(nn.Parameter, base.weight)


def sampled_batches(
    train: Sequence[Feature], steps: int, grad_every: int, batch_size: int, seed: int
) -> list[list[Feature]]:
    """``ceil(steps / grad_every)`` batches of ``batch_size`` examples (without replacement
    within a batch), drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    size = min(batch_size, len(train))
    return [
        [train[i] for i in rng.choice(len(train), size=size, replace=False)]
        for _ in range(math.ceil(steps / grad_every))
    ]


def anchor_gradient(model: FedModel, batches: Sequence[Sequence[Feature]]) -> torch.Tensor:
    """G = mean over ``batches`` of ∂L/∂W_probe at the anchor (``model`` at its initial
    adapter, evaluation mode). ``model``'s adapter and mode are restored afterwards."""
    if not batches:
        raise ValueError("anchor_gradient: no batches")
    weight = probe_weight(model)
    saved, was_training = model.get_params(), model.head.training
    model.set_params(model.initial_params)
    model.head.eval()
    total = torch.zeros_like(weight, dtype=torch.float32)
    try:
        with training_only(model.trainable_parameters(), ()):
            weight.requires_grad_(True)
            for batch in batches:
                loss = model.loss(model.head.collate(list(batch)))
                total += torch.autograd.grad(loss, weight)[0].float()
                count()
    finally:
        weight.requires_grad_(False)
        model.set_params(saved)
        model.head.train(was_training)
    return total / len(batches)

"""FedMosaic's client model (Seo et al., ICLR 2026, arXiv 2506.11024): a ``global`` and a
``local`` adapter in every adapted layer, mixed by a gate of that layer's own input, with
PQ-LoRA in ``pq_blocks`` blocks spread over the depth (by default one per six adapted
blocks, :func:`fedloom.models.pqlora.pq_block_count`):

    y = W x + g(x) s B_g((A_g x) P_g + Q_g) + (1 − g(x)) s B_l((A_l x) P_l + Q_l)   PQ layers
    y = W x + g(x) s B_g A_g x + (1 − g(x)) s B_l A_l x                             other layers
    g(x) = σ(mean_t [x_t · w + b (+ ε_t softplus(x_t · u) in training)])

A and B of the PQ layers are frozen (:mod:`fedloom.models.pqlora`); the gates are
:class:`fedloom.models.gate.NoisyTokenGate`, one per adapted layer, named
``<layer>.lora_gate.{proj,noise}.*``. The two adapters are PEFT LoRA adapters
(:func:`fedloom.models.dual.add_two_adapters`) weighted by forward hooks, as in the dual
model of FedDPA; :data:`fedloom.models.dual.LOCAL_PATTERNS` selects the local part (local
A, B, P, Q and the gates) here too, and :func:`fedloom.models.dual.global_only` pins
every gate to the global adapter.

PQ-LoRA starts at P = Q = 0, as in the official code (see :mod:`fedloom.models.pqlora`).
Differences from the official code: the gate pools over the non-padding (or, for a
causal LM scoring an answer, the prompt) positions instead of every position, has a
bias, and its noise weight trains (see :class:`NoisyTokenGate`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from torch import nn

from fedloom.config import LoraConfig as LoraSettings
from fedloom.models.blocks import num_blocks
from fedloom.models.dual import GATE, GLOBAL, LOCAL, add_two_adapters
from fedloom.models.gate import NoisyTokenGate, attach_layer_gate, attach_token_mask, weight_output
from fedloom.models.pqlora import layer_index, make_pq, pq_block_count, pq_layers

#: marks a mosaic model's adapter: its gates have a noise weight
GATE_NOISE = f"{GATE}.noise.weight"


def add_mosaic_adapters(model: nn.Module, settings: LoraSettings, seed: int) -> PeftModel:
    """Wrap ``model`` with FedMosaic's gated global and local adapters, PQ-LoRA in the
    :func:`pq_layers` of the adapted blocks (``settings.layers``, default all) for
    :func:`pq_block_count` of them (none when ``pq_blocks`` is 0: a backbone with fewer
    adapted blocks than ``pq_blocks`` gets PQ-LoRA in each); the frozen PQ factors follow
    ``seed``."""
    adapted_layers = settings.layers or list(range(num_blocks(model)))
    blocks = pq_block_count(settings.pq_blocks, len(adapted_layers))
    pq = set(pq_layers(sorted(adapted_layers), blocks)) if blocks else set()
    adapted = add_two_adapters(model, settings)
    mask = attach_token_mask(model)
    generator = torch.Generator().manual_seed(seed)
    for name, module in list(adapted.named_modules()):
        if not isinstance(module, LoraLayer):
            continue
        if module.in_features is None:  # PEFT sets it on every layer type LoRA wraps
            raise ValueError(f"algorithm fedmosaic: {name} has no input width to gate")
        gate = NoisyTokenGate(module.in_features)
        host: nn.Module = adapted.get_submodule(name)  # the same layer, typed as a module
        host.add_module(GATE, gate)
        signal = attach_layer_gate(host, gate, mask)
        weight_output(module.lora_B[GLOBAL], signal)
        weight_output(module.lora_B[LOCAL], signal, complement=True)
        if layer_index(name) in pq:
            make_pq(module, (GLOBAL, LOCAL), generator)
    return adapted


def is_mosaic(names: Iterable[str]) -> bool:
    """Whether adapter tensor ``names`` come from a mosaic model (its gates have noise)."""
    return any(n.endswith(GATE_NOISE) for n in names)

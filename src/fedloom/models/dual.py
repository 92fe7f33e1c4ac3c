"""Dual LoRA: a ``global`` and a ``local`` LoRA adapter in every adapted layer, mixed per
example by a learned gate (the model of FedDPA, Yang et al., NeurIPS 2024):

    y = W x + g(x) (α/r) B_g A_g x + (1 − g(x)) (α/r) B_l A_l x,

g from :class:`fedloom.models.gate.InputGate`. Both adapters are PEFT LoRA adapters with
the ``[model.lora]`` settings, both active at once through PEFT's multi-adapter API
(``add_adapter``, then ``set_adapter([global, local])``), so their initialization (A
Kaiming-uniform, B zero), dropout and scale α/r are PEFT's. The per-example weights are
hand-written: forward hooks on each adapter's B multiply its output by g(x) or 1 − g(x)
(:func:`fedloom.models.gate.weight_output`). PEFT cannot weight adapters per input: it
adds the active adapters with one fixed scale each, its mixed-batch inference
(``adapter_names=``) routes each example to a single adapter, and ``add_weighted_adapter``
mixes the weights once for all inputs. A dual model is never merged (``merge_adapter``
would bake in the unweighted sum).

Names, after :func:`fedloom.models.fedmodel.clean_name`: ``...query.lora_A.global.weight``,
``...query.lora_B.local.weight``, and the gate's ``encoder.lora_gate.proj.weight`` and
``.bias`` (``lm.`` on decoders). The gate is a ``lora_*`` tensor on purpose: it is adapter
machinery, not the task head, both for the ``head`` alias of
:mod:`fedloom.algorithms.sharing` and for the optimizer's learning-rate groups (it trains
at ``train.lr``). :data:`LOCAL_PATTERNS` selects the client's own part.
"""

from __future__ import annotations

import re
from typing import cast

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer, LoraModel
from torch import nn
from transformers import PreTrainedModel

from fedloom.config import LoraConfig as LoraSettings
from fedloom.models.gate import InputGate, attach_input_gate, weight_output
from fedloom.models.lora import add_lora
from fedloom.params import Params

GLOBAL, LOCAL, GATE = "global", "local", "lora_gate"
#: name patterns of the local part: the local LoRA factors (A, B, and PQ-LoRA's P, Q in
#: the mosaic model) and the gate(s)
LOCAL_PATTERNS = (r"\.lora_[ABPQ]\.local(\.|$)", rf"(^|\.){GATE}\.")
_LOCAL = re.compile("|".join(LOCAL_PATTERNS))
_GATE_BIAS = f"{GATE}.proj.bias"


def add_two_adapters(model: nn.Module, settings: LoraSettings) -> PeftModel:
    """Wrap ``model`` with two PEFT LoRA adapters, ``global`` and ``local``, both active
    (their outputs add up until a gate weights them)."""
    adapted = add_lora(model, settings, adapter_name=GLOBAL)
    adapted.add_adapter(LOCAL, adapted.peft_config[GLOBAL])
    # the tuner's set_adapter activates several adapters at once (PeftModel's takes one)
    cast(LoraModel, adapted.base_model).set_adapter([GLOBAL, LOCAL])
    return adapted


def add_dual_lora(model: PreTrainedModel, settings: LoraSettings) -> PeftModel:
    """Wrap ``model`` with the two gated LoRA adapters and the gate (see module docstring)."""
    adapted = add_two_adapters(model, settings)
    gate = InputGate(cast(nn.Embedding, model.get_input_embeddings()).embedding_dim)
    adapted.add_module(GATE, gate)
    signal = attach_input_gate(model, gate)
    for module in adapted.modules():
        if isinstance(module, LoraLayer):
            weight_output(module.lora_B[GLOBAL], signal)
            weight_output(module.lora_B[LOCAL], signal, complement=True)
    return adapted


def is_local(name: str) -> bool:
    """Whether ``name`` is a tensor of the local part (local LoRA or gate)."""
    return _LOCAL.search(name) is not None


def is_dual(params: Params) -> bool:
    """Whether ``params`` has a local part and a gate, i.e. comes from a dual model."""
    return any(n.endswith(_GATE_BIAS) for n in params) and any(map(is_local, params))


def global_only(params: Params) -> Params:
    """``params`` as the global adapter alone: the local LoRA zeroed and the gate pinned to
    the global adapter (v = 0, b = +∞, so g ≡ 1 exactly and the local branch is 0)."""
    out: Params = {}
    for name, tensor in params.items():
        if not is_local(name):
            out[name] = tensor
        elif name.endswith(_GATE_BIAS):
            out[name] = torch.full_like(tensor, float("inf"))
        else:
            out[name] = torch.zeros_like(tensor)
    return out

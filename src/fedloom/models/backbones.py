"""Backbones: the packaged offline models, any Hugging Face id or local path, and tiny
random configurations for unit tests.

A backbone is loaded once per process; clients differ only in their adapter ``Params``.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fedloom.models.catalog import BackboneSpec


def _tiny_config(spec: BackboneSpec, vocab_size: int) -> BertConfig | LlamaConfig | GPT2Config:
    if spec.name == "tiny-gpt2":  # GPT-2's attention and MLP are Conv1D layers
        return GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=512)
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


def load_backbone(
    spec: BackboneSpec, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
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

"""The model a whole simulation shares: one frozen backbone, LoRA, a head, and the
named trainable tensors (``Params``) that are all that differs between clients.

Switching the simulated client is ``set_params`` (an in-place copy into the existing
adapter tensors), never a model copy.

With ``precision = "bf16"`` every forward pass (loss, scoring, embeddings) runs under
``torch.autocast`` in bfloat16 while the adapters stay float32 tensors, so their
gradients, the optimizer state and everything a client sends stay float32 (mixed
precision as in Micikevicius et al. 2018, without loss scaling: bf16 has float32's range).
``precision = "auto"`` is bf16 on a CPU with native bf16 arithmetic (avx512_bf16 or AMX
tiles, as torch's CPU probes report them), where it was measured faster, and fp32
elsewhere, and fp32 with TF32 matmuls on CUDA (:func:`fedloom.device.resolve_precision`).
``"fp16"`` (CUDA) is float16 autocast, whose local training scales the loss
(:mod:`fedloom.train.scaler`), since float16's range is short.

The model lives on one device (``train.device``): its batches are built there and its
``Params`` are read and written there; :mod:`fedloom.device` moves what crosses the
client boundary.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import cast

import numpy as np
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from torch import nn

from fedloom.config import GenerationConfig, ModelConfig
from fedloom.data import Example, TaskSpec
from fedloom.device import CPU, autocast_dtype, resolve_precision
from fedloom.models.backbones import BackboneSpec, load_backbone
from fedloom.models.blocks import num_blocks
from fedloom.models.catalog import resolve_backbone
from fedloom.models.dual import add_dual_lora
from fedloom.models.generative import GenerativeHead
from fedloom.models.heads import Batch, ClassifierHead, Feature, VerbalizerHead, feature_length
from fedloom.models.lora import add_lora
from fedloom.models.merged import MERGED, MergedWeights
from fedloom.models.mosaic import add_mosaic_adapters
from fedloom.models.prefix import FrozenPrefix, first_adapted_block
from fedloom.params import Params

_PEFT_NOISE = re.compile(r"base_model\.model\.|\.default(?=\.)")


def clean_name(name: str) -> str:
    """PEFT's parameter name without its wrapper prefixes and adapter name:
    ``encoder.base_model.model.encoder.layer.0...query.lora_A.default.weight`` ->
    ``encoder.encoder.layer.0...query.lora_A.weight``."""
    return _PEFT_NOISE.sub("", name)


class FedModel:
    """Backbone + LoRA + head, with ``Params`` get/set and batched loss/prediction."""

    def __init__(
        self,
        head: ClassifierHead | VerbalizerHead | GenerativeHead,
        spec: BackboneSpec,
        precision: str = "fp32",
        device: torch.device | None = None,
    ) -> None:
        self.device = device or CPU
        self.head = head.to(self.device)
        self.spec = spec
        self.precision = resolve_precision(precision, self.device)
        self.task: TaskSpec = head.task
        self._trainable: dict[str, nn.Parameter] = {
            clean_name(n): p for n, p in head.named_parameters() if p.requires_grad
        }
        #: the frozen weights of the LoRA layers, which merged updates change (see merged.py)
        self.merged = MergedWeights(
            {clean_name(n): m for n, m in head.named_modules() if isinstance(m, LoraLayer)}
        )
        #: the adapter as built (a seeded function of the config): every client that builds
        #: the model knows it without communication, e.g. to start a personal head
        self.initial_params: Params = self.get_params()

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        task: TaskSpec,
        max_length: int,
        seed: int,
        device: torch.device | None = None,
        *,
        truncate_responses: bool = True,
        generation: GenerationConfig | None = None,
    ) -> FedModel:
        """The model of ``task`` on ``cfg``'s backbone: a classifier head on an encoder, a
        verbalizer head on a causal LM, or for a generative task a
        :class:`~fedloom.models.generative.GenerativeHead` (``truncate_responses`` and
        ``generation``: ``data.truncate_responses`` and ``eval.generation``)."""
        spec = resolve_backbone(cfg.backbone)
        if task.generative and spec.kind == "encoder":
            raise ValueError(
                f"model.backbone: {cfg.backbone} is an encoder; generative task {task.name} "
                f"needs a causal LM (e.g. smollm2-135m-instruct)"
            )
        backbone, tokenizer = load_backbone(spec, seed=seed)
        head_kind = cfg.head
        if task.generative and head_kind != "auto":
            raise ValueError(
                f"model.head: generative task {task.name} is trained on its responses "
                f'(model.head = "auto"), not with a {head_kind} head'
            )
        if head_kind == "auto":
            head_kind = "classifier" if spec.kind == "encoder" else "verbalizer"
        if head_kind == "classifier" and spec.kind == "decoder":
            raise ValueError("model.head: 'classifier' needs an encoder backbone")
        if head_kind == "verbalizer" and spec.kind == "encoder":
            raise ValueError("model.head: 'verbalizer' needs a causal-LM backbone")
        blocks = num_blocks(backbone)
        if cfg.lora.layers is not None and max(cfg.lora.layers) >= blocks:
            raise ValueError(
                f"model.lora.layers: block {max(cfg.lora.layers)} does not exist "
                f"({cfg.backbone} has blocks 0 to {blocks - 1})"
            )
        torch.manual_seed(seed)  # LoRA A's and the head's initial values follow the seed
        if cfg.adapters == "mosaic":
            adapted = add_mosaic_adapters(backbone, cfg.lora, seed)
        else:
            adapted = (add_dual_lora if cfg.adapters == "dual" else add_lora)(backbone, cfg.lora)
        if task.generative:
            head: ClassifierHead | VerbalizerHead | GenerativeHead = GenerativeHead(
                adapted, tokenizer, task, max_length, truncate_responses, generation, seed
            )
        elif head_kind == "classifier":
            head = ClassifierHead(
                adapted, tokenizer, task, cfg.pooling, cfg.head_dropout, max_length
            )
        else:
            head = VerbalizerHead(adapted, tokenizer, task, max_length)
        model = cls(head, spec, cfg.precision, device)
        if cfg.prefix_cache:
            first = first_adapted_block(model.param_names)
            first = blocks if first is None else first
            try:
                head.prefix = FrozenPrefix(model.transformer, blocks, first)
            except ValueError as err:
                raise ValueError(f"{err} ({cfg.backbone})") from None
        return model

    @property
    def transformer(self) -> PeftModel:
        """The PEFT-wrapped backbone (an encoder's or a causal LM's)."""
        head = self.head
        return cast(PeftModel, head.encoder if isinstance(head, ClassifierHead) else head.lm)

    @property
    def backbone_size(self) -> int:
        """The number of frozen (backbone) parameters: what "smallest backbone" compares."""
        return sum(p.numel() for p in self.head.parameters() if not p.requires_grad)

    # --- Params -------------------------------------------------------------------------
    @property
    def param_names(self) -> list[str]:
        return list(self._trainable)

    def get_params(self) -> Params:
        """A detached copy of every trainable tensor (LoRA factors and head)."""
        return {n: p.detach().clone() for n, p in self._trainable.items()}

    def set_params(self, params: Params) -> None:
        """Copy ``params`` into the adapter tensors in place (strict: same names, shapes);
        its merged updates (``*.merged.weight``, :mod:`fedloom.models.merged`) into the
        frozen weights they belong to, every other frozen weight back to its original."""
        merged = {n: t for n, t in params.items() if n.endswith(MERGED)}
        missing = self._trainable.keys() - params.keys()
        extra = params.keys() - self._trainable.keys() - merged.keys()
        if missing or extra:
            raise KeyError(
                f"adapter mismatch: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}"
            )
        for name, p in self._trainable.items():  # check everything before writing anything
            if params[name].shape != p.shape:
                raise ValueError(
                    f"adapter {name}: shape {tuple(params[name].shape)} != {tuple(p.shape)}"
                )
        self.merged.check(merged)
        with torch.no_grad():
            for name, p in self._trainable.items():
                p.copy_(params[name])
        self.merged.apply(merged)

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self._trainable)

    # --- data ---------------------------------------------------------------------------
    def encode(self, examples: Sequence[Example]) -> list[Feature]:
        return self.head.encode(examples)

    def batches(
        self, features: Sequence[Feature], batch_size: int, order: np.ndarray | None = None
    ) -> Iterator[Batch]:
        """Dynamically padded batches in ``order`` (default: sorted by length, for scoring)."""
        if order is None:
            order = np.argsort([feature_length(f) for f in features], kind="stable")
        for start in range(0, len(order), batch_size):
            yield self.head.collate([features[i] for i in order[start : start + batch_size]])

    # --- compute ------------------------------------------------------------------------
    def autocast(self) -> AbstractContextManager[None]:
        """The forward passes' precision on the model's device: bfloat16 or float16
        autocast, or a no-op for "fp32"."""
        dtype = autocast_dtype(self.precision)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def loss(self, batch: Batch) -> torch.Tensor:
        with self.autocast():
            return self.head.loss(batch).float()

    def example_losses(self, batch: Batch) -> torch.Tensor:
        with self.autocast():
            return self.head.example_losses(batch).float()

    @torch.no_grad()
    def log_probs(self, features: Sequence[Feature], batch_size: int) -> np.ndarray:
        """(n, classes) log p(y | x) for ``features`` in their original order, in eval mode
        with the adapters currently set (classification tasks)."""
        head = self.head
        if isinstance(head, GenerativeHead) or self.task.is_regression:
            raise ValueError(f"log_probs: task {self.task.name} is a {self.task.kind} task")
        was_training = self.head.training
        self.head.eval()
        order = np.argsort([feature_length(f) for f in features], kind="stable")
        with self.autocast():
            chunks = [
                head.class_log_probs(batch).float()
                for batch in self.batches(features, batch_size, order)
            ]
        self.head.train(was_training)
        out = torch.cat(chunks).cpu().numpy()
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return out[inverse]

    @torch.no_grad()
    def embed(self, features: Sequence[Feature], batch_size: int) -> np.ndarray:
        """(n, hidden) float32 representations of ``features`` in their original order,
        from the head's :meth:`embed` in eval mode with the adapters currently set (at
        initialization LoRA's B is zero, so this is the frozen backbone)."""
        was_training = self.head.training
        self.head.eval()
        order = np.argsort([feature_length(f) for f in features], kind="stable")
        with self.autocast():
            chunks = [
                self.head.embed([features[i] for i in order[start : start + batch_size]]).float()
                for start in range(0, len(order), batch_size)
            ]
        self.head.train(was_training)
        out = torch.cat(chunks).cpu().numpy()
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return out[inverse]

    def mean_loss(self, features: Sequence[Feature], batch_size: int) -> float:
        """The task's loss over ``features`` in evaluation mode with the adapter in place:
        the mean per-example loss (:meth:`predict`), or for a generative task the
        references' mean token negative log-likelihood (Σ NLL / Σ tokens)."""
        head = self.head
        if isinstance(head, GenerativeHead):
            nll, tokens = self.each_example(features, batch_size, head.response_nll)
            return float(nll.sum() / tokens.sum().clamp_min(1))
        return self.predict(features, batch_size)[2]

    def predict(
        self, features: Sequence[Feature], batch_size: int
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """(predictions, labels, mean loss) over ``features`` in their original order."""
        preds, labels, losses = self.predict_each(features, batch_size)
        return preds, labels, float(losses.mean())

    @torch.no_grad()
    def each_example(
        self,
        features: Sequence[Feature],
        batch_size: int,
        score: Callable[[Batch], tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, ...]:
        """``score(batch)``'s tensors (batch first) over ``features``: batches in length
        order, in evaluation mode at the model's precision (the head's mode restored),
        gathered on the host as fp32 in ``features``' own order."""
        was_training = self.head.training
        self.head.eval()
        order = np.argsort([feature_length(f) for f in features], kind="stable")
        parts = []
        try:
            with self.autocast():
                for batch in self.batches(features, batch_size, order):
                    parts.append(tuple(t.float() for t in score(batch)))
        finally:
            self.head.train(was_training)
        inverse = torch.as_tensor(np.argsort(order, kind="stable"))
        return tuple(torch.cat(column).cpu()[inverse] for column in zip(*parts, strict=True))

    @torch.no_grad()
    def generate(self, features: Sequence[Feature], batch_size: int) -> list[str]:
        """A generative task's answers to ``features``' prompts in their original order:
        :meth:`GenerativeHead.generate` on batches in length order (each batch seeded by
        its index), in evaluation mode at the model's precision."""
        head = self.head
        if not isinstance(head, GenerativeHead):
            raise TypeError(f"generate: task {self.task.name} is not generative")
        was_training = head.training
        head.eval()
        order = np.argsort([feature_length(f) for f in features], kind="stable")
        answers: list[str] = [""] * len(features)
        try:
            with self.autocast():
                for b, start in enumerate(range(0, len(order), batch_size)):
                    rows = order[start : start + batch_size]
                    for i, text in zip(rows, head.generate([features[i] for i in rows], b)):
                        answers[i] = text
        finally:
            head.train(was_training)
        return answers

    def predict_each(
        self, features: Sequence[Feature], batch_size: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(predictions, labels, per-example losses) over ``features`` in their original
        order (a classification or regression task: a generative one's answers are
        :meth:`GenerativeHead.generate`'s)."""
        head = self.head
        if isinstance(head, GenerativeHead):
            raise TypeError(f"predict: task {self.task.name} is generative")
        pred, loss = self.each_example(features, batch_size, head.predict)
        labels = np.array([f["label"] for f in features])
        return pred.numpy(), labels, loss.numpy()

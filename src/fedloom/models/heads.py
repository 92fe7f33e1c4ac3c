"""Task heads: how a backbone turns examples into a loss and into predictions.

* :class:`ClassifierHead` (encoders): pooled hidden state -> dropout -> linear layer.
  Cross-entropy for classification, mean squared error for regression (num_labels = 1).
* :class:`VerbalizerHead` (causal LMs): the prompt holds the sentence(s) and the question,
  wrapped in the tokenizer's chat template when it has one; the target is the label
  word(s) followed by end-of-text. The loss is
  the token cross-entropy on the answer tokens only; a prediction is the option with the
  highest total log-likelihood  argmax_k  sum_t log p(answer_k[t] | prompt, answer_k[<t]),
  so scoring needs no free-running generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fedloom.data import Example, TaskSpec
from fedloom.models import gate
from fedloom.models.prefix import FrozenPrefix

Feature = dict[str, Any]
#: tensors by name (a causal LM's batch also keeps its features, for option scoring)
Batch = dict[str, Any]


def feature_length(feature: Feature) -> int:
    """Token count of an encoded example (what padding depends on)."""
    return len(feature["input_ids"] if "input_ids" in feature else feature["prompt_ids"])


def _forward(
    model: nn.Module, prefix: FrozenPrefix | None, inputs: dict[str, Any], **kwargs: Any
) -> Any:
    """``model(**inputs, **kwargs)``, through ``prefix``'s cache when there is one."""
    return model(**inputs, **kwargs) if prefix is None else prefix(model, inputs, **kwargs)


def _pad(
    seqs: Sequence[Sequence[int]], value: int, device: torch.device, left: bool = False
) -> torch.Tensor:
    """The sequences as one (rows, longest) tensor on ``device``, padded with ``value``
    (built on the host, then copied in one transfer)."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if left:
            out[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        else:
            out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device)


def _device(module: nn.Module) -> torch.device:
    """Where ``module``'s weights live (a head's batches are built there)."""
    return next(module.parameters()).device


#: stands for the user's text when a chat template is rendered, then split at
USER_TEXT = "<<fedloom:sentences>>"


def prompt_frame(tokenizer: PreTrainedTokenizerBase, after: str) -> tuple[list[int], list[int]]:
    """Token ids before and after the user's text in a causal LM's prompt: the chat template
    rendered around :data:`USER_TEXT` + ``after`` (a user turn, then the assistant's
    header) when the tokenizer has one, else nothing before and ``after`` then
    ``"\nAnswer:"`` after."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if getattr(tokenizer, "chat_template", None) is None:
        return [], ids(after + "\nAnswer:")
    text = cast(
        str,
        tokenizer.apply_chat_template(  # a string: tokenize=False
            [{"role": "user", "content": USER_TEXT + after}],
            add_generation_prompt=True,
            tokenize=False,
        ),
    )
    if text.count(USER_TEXT) != 1:
        raise ValueError("model.backbone: the chat template does not keep the user's message")
    before, rest = text.split(USER_TEXT)
    return ids(before), ids(rest)


def left_padded(
    seqs: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device,
) -> Batch:
    """Token sequences and their targets (-100 where no loss) as one left-padded batch with
    position ids: every answer ends in the last column, so the LM head only has to run on
    the last few positions (it is ~20 % of SmolLM2's forward pass)."""
    mask = _pad([[1] * len(s) for s in seqs], 0, device, left=True)
    return {
        "input_ids": _pad(seqs, pad_id, device, left=True),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
        "targets": _pad(targets, -100, device, left=True),
    }


def answer_logprob(
    lm: nn.Module, prefix: FrozenPrefix | None, batch: Batch, keep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over the answer tokens of log p(token | prefix), number of answer tokens) per
    sequence of a :func:`left_padded` batch. Logits at position p predict token p + 1; only
    the last ``keep`` positions, which must cover the longest answer and the position
    before it, are computed. A dual model's gate reads the prompt, not the answer."""
    prompt = (batch["targets"] == -100) & batch["attention_mask"].bool()
    with gate.reading(prompt):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        logits = _forward(lm, prefix, inputs, logits_to_keep=keep).logits
    logits = logits[:, :-1].float()
    targets = batch["targets"][:, -(keep - 1) :]
    mask = targets != -100
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0).unsqueeze(-1))
    return (logp.squeeze(-1) * mask).sum(-1), mask.sum(-1)


def prompt_embedding(lm: nn.Module, prompts: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """One vector per prompt: the LM's last hidden state averaged over the prompt's tokens
    (only one position's logits are computed). Padded positions are zeroed before the sum,
    never multiplied by the mask."""
    device = _device(lm)
    mask = _pad([[1] * len(p) for p in prompts], 0, device, left=True)
    hidden = lm(
        input_ids=_pad(prompts, pad_id, device, left=True),
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
        output_hidden_states=True,
        logits_to_keep=1,
    ).hidden_states[-1]
    keep = mask.bool().unsqueeze(-1)
    return hidden.masked_fill(~keep, 0.0).sum(1) / keep.sum(1)


class ClassifierHead(nn.Module):
    """Encoder + pooling + linear layer (the head is trainable and travels with LoRA)."""

    def __init__(
        self,
        encoder: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        task: TaskSpec,
        pooling: str = "mean",
        dropout: float = 0.1,
        max_length: int = 128,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.task = task
        self.pooling = pooling
        self.max_length = max_length
        hidden = cast(PretrainedConfig, encoder.config).hidden_size
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, task.num_labels)
        #: set by FedModel with ``model.prefix_cache``: the encoder's cached frozen blocks
        self.prefix: FrozenPrefix | None = None
        #: (classes,) added to every example's logits while set, in training and in scoring
        #: (:func:`fedloom.models.label_prior.offset_logits`: a client's label prior)
        self.logit_offset: torch.Tensor | None = None

    def encode(self, examples: Sequence[Example]) -> list[Feature]:
        """Token ids of single texts and of text pairs (a multi-task pool mixes both)."""
        features: list[Feature] = [{} for _ in examples]
        for pairs in (False, True):
            group = [i for i, e in enumerate(examples) if (e.text_b is not None) == pairs]
            if not group:
                continue
            a = [examples[i].text_a for i in group]
            b = [examples[i].text_b for i in group] if pairs else None
            enc = self.tokenizer(a, b, truncation=True, max_length=self.max_length)
            keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
            for j, i in enumerate(group):
                features[i] = {**{k: enc[k][j] for k in keys}, "label": examples[i].label}
        return features

    @property
    def device(self) -> torch.device:
        return self.classifier.weight.device

    def collate(self, features: Sequence[Feature]) -> Batch:
        ids = [f["input_ids"] for f in features]
        device = self.device
        batch = {
            "input_ids": _pad(ids, self.tokenizer.pad_token_id, device),
            "attention_mask": _pad([[1] * len(s) for s in ids], 0, device),
        }
        if "token_type_ids" in features[0]:
            batch["token_type_ids"] = _pad([f["token_type_ids"] for f in features], 0, device)
        dtype = torch.float32 if self.task.is_regression else torch.long
        batch["labels"] = torch.tensor([f["label"] for f in features], dtype=dtype, device=device)
        return batch

    def _pooled(self, batch: Batch) -> torch.Tensor:
        """The pooled encoder output the classifier reads (``cls`` token or masked mean)."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = _forward(self.encoder, self.prefix, inputs).last_hidden_state
        if self.pooling == "cls":
            return hidden[:, 0]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    def _logits(self, batch: Batch) -> torch.Tensor:
        logits = self.classifier(self.dropout(self._pooled(batch))).float()
        return logits if self.logit_offset is None else logits + self.logit_offset

    def embed(self, features: Sequence[Feature]) -> torch.Tensor:
        """One vector per example: the pooled hidden state, before dropout and classifier."""
        return self._pooled(self.collate(features))

    def loss(self, batch: Batch) -> torch.Tensor:
        logits = self._logits(batch)
        if self.task.is_regression:
            return F.mse_loss(logits.squeeze(-1), batch["labels"])
        return F.cross_entropy(logits, batch["labels"])

    def example_losses(self, batch: Batch) -> torch.Tensor:
        """The loss of every example of the batch (differentiable; mean = :meth:`loss`)."""
        logits = self._logits(batch)
        if self.task.is_regression:
            return (logits.squeeze(-1) - batch["labels"]) ** 2
        return F.cross_entropy(logits, batch["labels"], reduction="none")

    @torch.no_grad()
    def class_log_probs(self, batch: Batch) -> torch.Tensor:
        """(batch, classes) log p(y | x) (classification only)."""
        return torch.log_softmax(self._logits(batch), -1)

    @torch.no_grad()
    def predict(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(predictions, per-example loss)."""
        logits = self._logits(batch)
        if self.task.is_regression:
            pred = logits.squeeze(-1)
            return pred, (pred - batch["labels"]) ** 2
        losses = F.cross_entropy(logits, batch["labels"], reduction="none")
        return logits.argmax(-1), losses


class VerbalizerHead(nn.Module):
    """Causal LM (decoders): the label whose verbalized answer is likeliest after the prompt.

    With a chat template (an instruction-tuned model such as SmolLM2-Instruct) the
    sentences and the question are the user's turn and the answer word, then end-of-turn,
    is the assistant's reply: the format the model was tuned on, so the answer needs no
    leading space and its closing token is one the model already predicts. Without one the
    prompt ends in ``Answer:`` and the answer word follows after a space.

    The prompt does not list the options: on SST-2 dev (SmolLM2-135M-Instruct, zero-shot)
    an ``Options: negative / positive`` line left the two answers' log-likelihood margin
    almost unrelated to the label, as if the model copied the first listed word.
    """

    def __init__(
        self,
        lm: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        task: TaskSpec,
        max_length: int = 256,
    ) -> None:
        super().__init__()
        if task.is_regression or not task.verbalizer:
            raise ValueError(
                f"model.head: the verbalizer needs a classification task with answer words; "
                f"task {task.name} has none"
            )
        self.lm = lm
        self.tokenizer = tokenizer
        self.task = task
        self.max_length = max_length
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("model.backbone: the tokenizer has no end-of-text token")
        self.chat = getattr(tokenizer, "chat_template", None) is not None
        lead = "" if self.chat else " "
        self.options: list[list[int]] = [self._ids(lead + word) + [eos] for word in task.verbalizer]
        self._before, self._after = self._frame()
        #: set by FedModel with ``model.prefix_cache``: the LM's cached frozen blocks
        self.prefix: FrozenPrefix | None = None

    @property
    def device(self) -> torch.device:
        return _device(self.lm)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _frame(self) -> tuple[list[int], list[int]]:
        """Token ids before and after the sentences (:func:`prompt_frame`)."""
        return prompt_frame(self.tokenizer, f"\nQuestion: {self.task.question}")

    def _prompt(self, example: Example) -> list[int]:
        if example.text_b is None:
            body = f"Sentence: {example.text_a}"
        else:
            body = f"Sentence 1: {example.text_a}\nSentence 2: {example.text_b}"
        frame = len(self._before) + len(self._after)
        budget = self.max_length - frame - max(len(o) for o in self.options)
        if budget < 1:
            raise ValueError(f"data.max_length: {self.max_length} leaves no room for the prompt")
        return self._before + self._ids(body)[:budget] + self._after

    def encode(self, examples: Sequence[Example]) -> list[Feature]:
        return [{"prompt_ids": self._prompt(e), "label": int(e.label)} for e in examples]

    def _sequences(self, features: Sequence[Feature], answers: Sequence[int]) -> Batch:
        seqs, targets = [], []
        for f, k in zip(features, answers, strict=True):
            answer = self.options[k]
            seqs.append(f["prompt_ids"] + answer)
            targets.append([-100] * len(f["prompt_ids"]) + answer)
        return left_padded(seqs, targets, self.tokenizer.pad_token_id, self.device)

    def collate(self, features: Sequence[Feature]) -> Batch:
        batch = self._sequences(features, [f["label"] for f in features])
        batch["labels"] = torch.tensor(
            [f["label"] for f in features], dtype=torch.long, device=self.device
        )
        batch["features"] = features  # kept for option scoring in predict()
        return batch

    def _answer_logprob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the answer's token log-probabilities, answer tokens) per sequence
        (:func:`answer_logprob` over the last positions, which cover the longest answer)."""
        return answer_logprob(self.lm, self.prefix, batch, max(len(o) for o in self.options) + 1)

    def embed(self, features: Sequence[Feature]) -> torch.Tensor:
        """One vector per example: :func:`prompt_embedding` of its prompt (the answer is
        not appended)."""
        return prompt_embedding(
            self.lm, [f["prompt_ids"] for f in features], self.tokenizer.pad_token_id
        )

    def loss(self, batch: Batch) -> torch.Tensor:
        total, count = self._answer_logprob(batch)
        return -total.sum() / count.sum().clamp_min(1)

    def example_losses(self, batch: Batch) -> torch.Tensor:
        """Every example's answer cross-entropy per answer token (differentiable; :meth:`loss`
        weights the examples by their answer lengths instead)."""
        total, count = self._answer_logprob(batch)
        return -total / count.clamp_min(1)

    @torch.no_grad()
    def option_scores(self, features: Sequence[Feature]) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, options) sum over each option's answer tokens of log p(token | prompt,
        answer so far), and the options' token counts.

        The prompts run once, keeping their key/value cache; each option then continues
        from the cache with its answer tokens but the last (the same tokens for every row,
        so no padding), and the cache is cut back to the prompts. This is the prompt +
        answer pass of :meth:`loss` without repeating the prompt for every option; gates
        read the prompt and keep that value for the continuations (:func:`gate.held`).

        When a frozen-prefix cache holds every option's prompt + answer sequence of the
        batch, each option is one such pass over the adapted blocks instead (the cache
        holds the frozen blocks' output of whole sequences, not their keys and values, so
        a continuation could not read the prompt's). Otherwise the prefix would cost more
        to compute for every option than the prompt's one pass, and is not cached."""
        if self.prefix is not None:
            sequences = [
                self._sequences(features, [k] * len(features)) for k in range(len(self.options))
            ]
            if all(self.prefix.holds(s) for s in sequences):
                cached = [self._answer_logprob(s) for s in sequences]
                return (
                    torch.stack([s for s, _ in cached], 1),
                    torch.stack([c for _, c in cached], 1),
                )
        prompts = [f["prompt_ids"] for f in features]
        device = self.device
        mask = _pad([[1] * len(p) for p in prompts], 0, device, left=True)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        rows = len(features)
        with gate.reading(mask.bool()), gate.held():
            out = self.lm(
                input_ids=_pad(prompts, self.tokenizer.pad_token_id, device, left=True),
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
            )
            first = torch.log_softmax(out.logits[:, -1].float(), -1)
            cache = out.past_key_values
            scores: list[torch.Tensor] = []
            for option in self.options:
                total = first[:, option[0]]
                if len(option) > 1:
                    fed = torch.tensor(option[:-1], device=device).expand(rows, -1)
                    logits = self.lm(
                        input_ids=fed,
                        attention_mask=torch.cat([mask, torch.ones_like(fed)], 1),
                        position_ids=positions[:, -1:]
                        + 1
                        + torch.arange(fed.shape[1], device=device),
                        past_key_values=cache,
                        use_cache=True,
                    ).logits
                    cache.crop(-fed.shape[1])  # back to the prompts
                    logp = torch.log_softmax(logits.float(), -1)
                    answer = torch.tensor(option[1:], device=device).expand(rows, -1).unsqueeze(-1)
                    total = total + logp.gather(-1, answer).squeeze(-1).sum(-1)
                scores.append(total)
        counts = torch.tensor([len(o) for o in self.options], device=device).expand(rows, -1)
        return torch.stack(scores, 1), counts

    @torch.no_grad()
    def class_log_probs(self, batch: Batch) -> torch.Tensor:
        """(batch, options) log p(y | x): the options' total answer log-likelihoods (what
        :meth:`predict` ranks) normalised over the label set."""
        scores, _ = self.option_scores(batch["features"])
        return torch.log_softmax(scores, -1)

    @torch.no_grad()
    def predict(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        scores, counts = self.option_scores(batch["features"])
        labels = batch["labels"]
        idx = torch.arange(len(labels), device=labels.device)
        losses = -scores[idx, labels] / counts[idx, labels]
        return scores.argmax(-1), losses

"""The head of a generative task (decoders): supervised fine-tuning on prompt/response pairs
with the loss on the response, and answers generated for scoring.

Rule. An example is a prompt x and a reference response y. The prompt is the user's turn of
the backbone's chat template when it has one (the assistant's header follows it), else the
prompt then ``"\\nAnswer:"`` with the response after a space; the response ends with the
tokenizer's end-of-text token, so the model learns to stop. The loss is the causal-LM
cross-entropy on the response tokens only (prompt and padding masked, -100):

    L = − Σ_examples Σ_t log p(y_t | x, y_<t) / Σ_examples |y|

the token-weighted mean over the batch, as supervised fine-tuning is done in TRL's
``SFTTrainer`` with its completion-only loss, OpenFedLLM and Flower's FlowerTune LLM
templates. ``example_losses`` (DP-SGD's per-example losses) is each example's mean over its
own response tokens.

Chat records (``data.messages_field``): the turns before the response are rendered with
the chat template (without one, each earlier turn as a ``role: content`` line), the
response being the assistant's next turn.

Length. ``data.max_length`` bounds prompt + response. A prompt too long is cut from its
left: a chat record's earliest turns go first (its system prompt last), then the start of
the last user turn's text; the frame of the chat template is kept whole; a response that does
not fit is cut at the end and counted (``Feature["cut"]``: the run's summary says how
many), or refused when ``data.truncate_responses = false``. A cut response has no
end-of-text token.

Generation (:meth:`GenerativeHead.generate`): the prompts left-padded in one batch,
transformers' ``generate`` with the adapter in place and :class:`fedloom.config.
GenerationConfig`'s settings, under a seeded random state, so the same config gives the
same text twice; the new tokens decoded without special tokens and stripped.

How fedloom differs from TRL: no packing of several examples into one sequence (each
client's examples are few; packing changes which tokens attend to which), and the prompt
frame is built once per head from the chat template rendered around a placeholder, so
every example's prompt is the user's text between two fixed token runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from fedloom.config import ConfigError, GenerationConfig
from fedloom.data import Example, TaskSpec
from fedloom.models import gate
from fedloom.models.heads import (
    USER_TEXT,
    Batch,
    Feature,
    _device,
    _pad,
    answer_logprob,
    left_padded,
    prompt_embedding,
    prompt_frame,
)
from fedloom.models.prefix import FrozenPrefix


class GenerativeHead(nn.Module):
    """Causal LM + LoRA trained on responses, scored by generating (module docstring)."""

    def __init__(
        self,
        lm: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        task: TaskSpec,
        max_length: int = 256,
        truncate_responses: bool = True,
        generation: GenerationConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not task.generative:
            raise ValueError(f"model.head: task {task.name} is not a generative task")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("model.backbone: the tokenizer has no end-of-text token")
        self.lm = lm
        self.tokenizer = tokenizer
        self.task = task
        self.max_length = max_length
        self.truncate_responses = truncate_responses
        self.generation = generation or GenerationConfig()
        self.seed = seed
        self.eos = int(eos)
        self.lead = " " if getattr(tokenizer, "chat_template", None) is None else ""
        self._before, self._after = prompt_frame(tokenizer, "")
        if len(self._before) + len(self._after) + 2 > max_length:
            raise ValueError(
                f"data.max_length: {max_length} tokens do not hold the prompt's frame "
                f"({len(self._before) + len(self._after)} tokens) and a response"
            )
        #: set by FedModel with ``model.prefix_cache``: the LM's cached frozen blocks
        self.prefix: FrozenPrefix | None = None

    @property
    def device(self) -> torch.device:
        return _device(self.lm)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _frame(self, earlier: Sequence[tuple[str, str]]) -> tuple[list[int], list[int]]:
        """Token ids before and after the last user turn's content, a chat record's
        ``earlier`` turns first: the chat template rendered around :data:`USER_TEXT`, or
        without one each earlier turn as a ``role: content`` line."""
        if not earlier:
            return self._before, self._after
        if self.lead:  # no chat template
            return self._ids("".join(f"{role}: {text}\n" for role, text in earlier)), self._after
        messages = [{"role": role, "content": text} for role, text in earlier]
        rendered = cast(
            str,
            self.tokenizer.apply_chat_template(  # a string: tokenize=False
                [*messages, {"role": "user", "content": USER_TEXT}],
                add_generation_prompt=True,
                tokenize=False,
            ),
        )
        before, after = rendered.split(USER_TEXT)
        return self._ids(before), self._ids(after)

    def _prompt(self, example: Example, budget: int) -> list[int]:
        """The prompt's token ids in at most ``budget`` tokens: a chat record's earliest
        turns dropped (the system prompt last) until its frame leaves room, then the last
        user turn's content cut from its left."""
        earlier = list(example.chat[:-1])
        before, after = self._frame(earlier)
        while earlier and len(before) + len(after) >= budget:
            del earlier[1 if earlier[0][0] == "system" and len(earlier) > 1 else 0]
            before, after = self._frame(earlier)
        text = self._ids(example.chat[-1][1] if example.chat else example.text_a)
        keep = budget - len(before) - len(after)
        return before + text[len(text) - keep :] + after

    def _encode(self, index: int, example: Example) -> Feature:
        frame = len(self._before) + len(self._after)
        response = self._ids(self.lead + str(example.label)) + [self.eos]
        room = self.max_length - frame - 1  # at least one token of the prompt's own
        cut = len(response) > room
        if cut and not self.truncate_responses:
            start = str(example.label)[:40]
            raise ConfigError(
                f"data.truncate_responses: example {index}'s response ({start!r}...) has "
                f"{len(response)} tokens with its end-of-text, and data.max_length = "
                f"{self.max_length} holds {room} after the prompt's frame; raise max_length "
                f"or allow cutting"
            )
        response = response[:room]
        return {
            "prompt_ids": self._prompt(example, self.max_length - len(response)),
            "prompt": example.text_a,
            "response_ids": response,
            "label": str(example.label),
            "cut": cut,
        }

    def encode(self, examples: Sequence[Example]) -> list[Feature]:
        """Each example's prompt and response token ids (module docstring), its prompt and
        reference response as text (``prompt``, ``label``) and whether the response was
        cut (``cut``)."""
        return [self._encode(i, e) for i, e in enumerate(examples)]

    def collate(self, features: Sequence[Feature]) -> Batch:
        seqs = [f["prompt_ids"] + f["response_ids"] for f in features]
        targets = [[-100] * len(f["prompt_ids"]) + f["response_ids"] for f in features]
        batch = left_padded(seqs, targets, self.tokenizer.pad_token_id, self.device)
        batch["features"] = features
        return batch

    def _response_logprob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the response's token log-probabilities, response tokens) per example."""
        keep = max(len(f["response_ids"]) for f in batch["features"]) + 1
        return answer_logprob(self.lm, self.prefix, batch, keep)

    def loss(self, batch: Batch) -> torch.Tensor:
        total, count = self._response_logprob(batch)
        return -total.sum() / count.sum().clamp_min(1)

    def example_losses(self, batch: Batch) -> torch.Tensor:
        """Every example's mean token cross-entropy over its own response (differentiable;
        :meth:`loss` weights the examples by their response lengths instead)."""
        total, count = self._response_logprob(batch)
        return -total / count.clamp_min(1)

    @torch.no_grad()
    def response_nll(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(negative log-likelihood of the reference response, its token count) per
        example, under teacher forcing."""
        total, count = self._response_logprob(batch)
        return -total, count.to(total.dtype)

    def embed(self, features: Sequence[Feature]) -> torch.Tensor:
        """One vector per example: :func:`prompt_embedding` of its prompt."""
        return prompt_embedding(
            self.lm, [f["prompt_ids"] for f in features], self.tokenizer.pad_token_id
        )

    @torch.no_grad()
    def generate(self, features: Sequence[Feature], batch_index: int = 0) -> list[str]:
        """The answers generated for ``features``' prompts (module docstring); the random
        state is seeded by the head's seed and ``batch_index``, and restored after."""
        settings = self.generation
        prompts = [f["prompt_ids"] for f in features]
        device = self.device
        mask = _pad([[1] * len(p) for p in prompts], 0, device, left=True)
        ids = _pad(prompts, self.tokenizer.pad_token_id, device, left=True)
        sampling = (
            {
                "temperature": settings.temperature,
                "top_p": settings.top_p,
                "top_k": settings.top_k,
            }
            if settings.do_sample
            else {"temperature": None, "top_p": None, "top_k": None}
        )
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), gate.reading(mask.bool()), gate.held():
            torch.manual_seed(self.seed * 1_000_003 + batch_index)
            out = cast(Any, self.lm).generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=settings.max_new_tokens,
                do_sample=settings.do_sample,
                num_beams=settings.num_beams,
                repetition_penalty=settings.repetition_penalty,
                no_repeat_ngram_size=settings.no_repeat_ngram_size,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.eos,
                **sampling,
            )
        new = out[:, ids.shape[1] :]
        return [t.strip() for t in self.tokenizer.batch_decode(new, skip_special_tokens=True)]

"""Frozen-prefix caching: when the adapters sit only in the upper transformer blocks
(``model.lora.layers``), the blocks below the first adapted one compute the same function
of an example in every step, round and client, so their output is computed once per
example and replayed afterwards.

For blocks ``0 … k−1`` without adapters and an example x of n tokens the cache keeps
h_k(x) ∈ R^{n×d}, the input of block k; a later forward pass of a batch runs the
embeddings (cheap) and blocks ``k …`` only, block k reading the cached rows instead of
what the lower blocks would produce. The gradient is unchanged: nothing below block k is
trainable. What changes is dropout: the prefix runs in eval mode once, so its dropout
(BERT's hidden and attention dropout) is off in training too, the deterministic prefix
of a fast path (the adapted blocks keep theirs). Every other value equals the full
forward pass up to float rounding (a test checks it), for right-padded encoders and
left-padded causal LMs alike: padded positions are masked out of attention, so a
token's hidden state does not depend on its batch's padding.

The key of an example is its token ids (and token type ids) at the attention mask's
positions, so the cache serves every client, round and evaluation that sees the same
text. It lives as long as the model and holds n · d float32 values per distinct example
(MiniLM, k = 3: about 80 KB for an MRPC pair).

Hand-written: neither transformers nor PEFT caches a frozen prefix across forward
passes (transformers' key/value cache serves generation within one sequence). The blocks
are swapped for the duration of a pass (a capturing stop for computing, a replaying
first block for reusing), which relies only on the model looping over its block list.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fedloom.models.blocks import block_list
from fedloom.models.pqlora import layer_index

#: the inputs of a forward pass that decide the prefix's output (the rest, e.g. labels,
#: logits_to_keep, are passed through untouched)
_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


def first_adapted_block(names: list[str]) -> int | None:
    """The lowest transformer block holding one of the trainable tensors ``names`` (None
    when none sits in a block)."""
    blocks = [b for b in map(layer_index, names) if b is not None]
    return min(blocks) if blocks else None


class _Reached(Exception):
    """Raised by :class:`_Capture` to end a forward pass at the prefix's output."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _Capture(nn.Module):
    def forward(self, hidden_states: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
        raise _Reached(hidden_states)


class _Replay(nn.Module):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
        if hidden_states.shape[:2] != self.hidden.shape[:2]:
            raise RuntimeError(
                f"prefix cache: replayed {tuple(self.hidden.shape[:2])} for a "
                f"batch of {tuple(hidden_states.shape[:2])}"
            )
        return self.hidden.to(hidden_states.dtype)


class FrozenPrefix:
    """The cached outputs of blocks ``0 … first − 1`` of ``model`` (see module docstring)."""

    def __init__(self, model: nn.Module, num_layers: int, first: int) -> None:
        if not 0 < first < num_layers:
            raise ValueError(
                f"model.prefix_cache: the first adapted block is {first}; "
                "set model.lora.layers to leave the lowest blocks unadapted"
            )
        try:
            name = block_list(model, num_layers)
        except ValueError as err:
            raise ValueError(f"model.prefix_cache: {err}") from None
        parent, _, self.attribute = name.rpartition(".")
        self.parent = model.get_submodule(parent) if parent else model
        self.blocks: nn.ModuleList = getattr(self.parent, self.attribute)
        self.first = first
        self._store: dict[bytes, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._store)

    @contextmanager
    def _blocks(self, blocks: list[nn.Module]) -> Iterator[None]:
        setattr(self.parent, self.attribute, nn.ModuleList(blocks))
        try:
            yield
        finally:
            setattr(self.parent, self.attribute, self.blocks)

    @staticmethod
    def _keys(inputs: Mapping[str, torch.Tensor], mask: torch.Tensor) -> list[bytes]:
        keys = []
        ids, mask = inputs["input_ids"].cpu(), mask.cpu()  # one transfer, not one per row
        types = inputs["token_type_ids"].cpu() if "token_type_ids" in inputs else None
        for row in range(mask.shape[0]):
            key = ids[row][mask[row]].numpy().tobytes()
            if types is not None:
                key += b"|" + types[row][mask[row]].numpy().tobytes()
            keys.append(key)
        return keys

    @torch.no_grad()
    def _compute(
        self,
        model: nn.Module,
        inputs: Mapping[str, torch.Tensor],
        rows: list[int],
        mask: torch.Tensor,
    ) -> list[torch.Tensor]:
        """The prefix's output for ``rows`` of the batch, one (tokens, d) tensor each."""
        sub = {k: v[rows] for k, v in inputs.items()}
        was_training = model.training
        model.eval()
        try:
            with self._blocks([*self.blocks[: self.first], _Capture()]):
                model(**sub)
        except _Reached as reached:
            hidden = reached.hidden.float()
        else:
            raise RuntimeError(
                "prefix cache: the forward pass never reached the first adapted block"
            )
        finally:
            model.train(was_training)
        return [hidden[i][mask[r]].clone() for i, r in enumerate(rows)]

    def holds(self, inputs: Mapping[str, Any]) -> bool:
        """Whether every example of the batch ``inputs`` is in the cache."""
        mask = inputs["attention_mask"].bool()
        return all(key in self._store for key in self._keys(inputs, mask))

    def __call__(self, model: nn.Module, inputs: Mapping[str, Any], **kwargs: Any) -> Any:
        """``model(**inputs, **kwargs)`` with the prefix's output read from the cache
        (computed first for the examples it lacks)."""
        keyed = {k: inputs[k] for k in _INPUTS if k in inputs}
        mask = keyed["attention_mask"].bool()
        keys = self._keys(keyed, mask)
        missing: dict[bytes, int] = {}
        for row, key in enumerate(keys):
            if key not in self._store:
                missing.setdefault(key, row)
        if missing:
            rows = list(missing.values())
            for key, hidden in zip(missing, self._compute(model, keyed, rows, mask)):
                self._store[key] = hidden
        width = next(iter(self._store.values())).shape[-1]
        replayed = torch.zeros(*mask.shape, width, device=mask.device)
        for row, key in enumerate(keys):
            replayed[row][mask[row]] = self._store[key]
        with self._blocks([_Replay(replayed), *self.blocks[self.first :]]):
            return model(**inputs, **kwargs)

"""A per-example gate: the learned weight g(x) in (0, 1) with which a dual-adapter model
mixes its two adapters for input x (FedDPA's instance-wise weighting; the global/local mix
FedMosaic builds on).

    g(x) = σ(v · ê(x) + b),    ê(x) = ē(x) / ‖ē(x)‖,
    ē(x) = mean of x's token embeddings over its non-padding positions

ē reads the backbone's frozen input (token) embeddings, so the gate costs an embedding
lookup and a dot product per example; it is computed once per forward pass and shared by
every adapted layer. It starts at v = 0, b = 0, i.e. g = 1/2 for every input (the fixed
mix FedDPA trains its local adapter at). b = +∞ forces g ≡ 1 exactly (σ(+∞) = 1 in IEEE
arithmetic) and b = −∞ forces g ≡ 0: a gate can be pinned to one adapter through its
tensors alone.

v · ê(x) = ‖v‖ cos(v, ē(x)): the gate is a sigmoid of the input's cosine similarity to a
learned direction. FedDPA's weight of the local adapter, λ · mean_i cos(h(x), h(x_i)) over
N local training inputs x_i, is λ ĥ(x) · mean_i ĥ(x_i): the same form with a fixed
direction (the mean of the client's normalized representations) and no bias or sigmoid.

Pieces, for any module that mixes two branches per example:

* :class:`InputGate`: the layer, features (batch, d) -> g (batch,);
* :func:`attach_input_gate`: computes g from a model's inputs before each of its forward
  passes (into a :class:`GateSignal`) and clears it afterwards;
* :func:`weight_output`: scales a module's output, example by example, by g or 1 − g;
* :func:`reading`: the positions the gate may read, when not every input token is
  context: a causal LM scoring an answer passes its prompt, so that g never sees the
  answer it helps to score (the label would leak into the gate);
* :func:`held`: every gate keeps the value of its first pass for the later ones, so that a
  prompt run once and continued from its key/value cache is gated as one pass would be.

A second gate reads a layer's own input instead of the embeddings, one gate per adapted
layer (FedMosaic's gate, Seo et al., ICLR 2026, after the noisy gating of Shazeer et al.
2017): :class:`NoisyTokenGate`, fed by :func:`attach_token_mask` (the positions, once per
forward pass of the model) and :func:`attach_layer_gate` (g for the layer's batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel

#: the positions an input gate pools over, when set by :func:`reading`
_READABLE: ContextVar[torch.Tensor | None] = ContextVar("gate_readable", default=None)


@contextmanager
def reading(mask: torch.Tensor) -> Iterator[None]:
    """Within the block, an input gate pools only the positions where ``mask`` (batch,
    length) is true instead of the attention mask; without a gate this does nothing."""
    token = _READABLE.set(mask)
    try:
        yield
    finally:
        _READABLE.reset(token)


#: gate values kept by :func:`held`, per signal
_HELD: ContextVar[dict[GateSignal, torch.Tensor] | None] = ContextVar("gate_held", default=None)


@contextmanager
def held() -> Iterator[None]:
    """Within the block, each gate computes its value on its first forward pass and reuses
    it on the later ones (the continuations of a cached prompt, whose inputs are only the
    new tokens); the batch must stay the same."""
    token = _HELD.set({})
    try:
        yield
    finally:
        _HELD.reset(token)


def _value(signal: GateSignal, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``compute()``, or within :func:`held` the value ``signal`` got first."""
    kept = _HELD.get()
    if kept is None:
        return compute()
    if signal not in kept:
        kept[signal] = compute()
    return kept[signal]


class InputGate(nn.Module):
    """g = σ(v · normalize(features) + b), one value in (0, 1) per example."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(F.normalize(features, dim=-1)).squeeze(-1))


def mean_pool(tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(batch, length, d) -> (batch, d): the mean over the positions where ``mask`` is 1."""
    if mask is None:
        return tokens.mean(1)
    weights = mask.unsqueeze(-1).to(tokens.dtype)
    return (tokens * weights).sum(1) / weights.sum(1).clamp_min(1.0)


class NoisyTokenGate(nn.Module):
    """g(x) = σ(mean_t [x_t · w + b + ε_t softplus(x_t · u)]) in training, ε_t ~ N(0, 1),
    and σ(mean_t [x_t · w] + b) in evaluation, over a layer's input tokens x_t (the
    positions of :func:`reading`, else the attention mask).

    w, b, u start at 0 (g = 1/2). The noise scale softplus(x_t · u) is differentiable, so
    the noise weight u trains with w and b; FedMosaic's official code computes it under
    ``no_grad``, so its noise weight never moves. The bias b (absent there) lets the gate
    be pinned to one adapter by its tensors alone (b = ±∞), as :class:`InputGate`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)
        self.noise = nn.Linear(dim, 1, bias=False)
        for tensor in (self.proj.weight, self.proj.bias, self.noise.weight):
            nn.init.zeros_(tensor)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        logits = F.linear(tokens, self.proj.weight)  # (batch, length, 1)
        if self.training:
            scale = F.softplus(self.noise(tokens)) + 1e-5
            logits = logits + torch.randn_like(logits) * scale
        # the bias joins after pooling, so that b = ±inf pins g without 0 · inf at padding
        return torch.sigmoid(mean_pool(logits, mask).squeeze(-1) + self.proj.bias)


class TokenMask:
    """The positions (batch, length) the layer gates of a model pool over during its
    current forward pass (None: every position)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


def attach_token_mask(model: nn.Module) -> TokenMask:
    """Before every forward pass of ``model`` set the returned mask to the positions of
    :func:`reading`, or else the ``attention_mask`` argument; clear it afterwards."""
    holder = TokenMask()

    def before(_module: nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        readable = _READABLE.get()
        holder.value = kwargs.get("attention_mask") if readable is None else readable

    def after(_module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        holder.value = None

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after)
    return holder


class GateSignal:
    """The gate values of the batch a model is processing, for the layers it weights."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def weights(self, out: torch.Tensor, complement: bool = False) -> torch.Tensor:
        """g (or 1 − g) shaped to multiply ``out`` row by row (batch first)."""
        if self.value is None:
            raise RuntimeError("a gated layer ran outside its model's forward pass")
        g = 1.0 - self.value if complement else self.value
        if out.shape[0] != g.shape[0]:
            raise RuntimeError(
                f"gated layer: output batch {out.shape[0]} != {g.shape[0]} gate values "
                "(the layer must see batch-first activations)"
            )
        return g.to(out.dtype).view(-1, *([1] * (out.dim() - 1)))


def attach_input_gate(model: PreTrainedModel, gate: InputGate) -> GateSignal:
    """Before every forward pass of ``model`` (a Hugging Face model, called with
    ``input_ids`` or ``inputs_embeds`` and ``attention_mask``), set the returned signal to
    ``gate`` of the mean input embedding (over the positions of :func:`reading`, if set);
    clear it after the pass."""
    signal = GateSignal()
    embeddings = model.get_input_embeddings()

    def before(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        def compute() -> torch.Tensor:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                tokens = kwargs["inputs_embeds"].detach()
            else:
                with torch.no_grad():
                    tokens = embeddings(ids)
            readable = _READABLE.get()
            mask = kwargs.get("attention_mask") if readable is None else readable
            return gate(mean_pool(tokens, mask))

        signal.value = _value(signal, compute)

    def after(_module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        signal.value = None

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after)
    return signal


def attach_layer_gate(layer: nn.Module, gate: NoisyTokenGate, mask: TokenMask) -> GateSignal:
    """Before every forward pass of ``layer`` (whose first argument is its batch-first
    input), set the returned signal to ``gate`` of that input over ``mask``'s positions."""
    signal = GateSignal()

    def before(_module: nn.Module, args: tuple[Any, ...]) -> None:
        signal.value = _value(signal, lambda: gate(args[0], mask.value))

    def after(_module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        signal.value = None

    layer.register_forward_pre_hook(before)
    layer.register_forward_hook(after)
    return signal


def weight_output(
    module: nn.Module, signal: GateSignal, complement: bool = False
) -> RemovableHandle:
    """Multiply ``module``'s output for example i by g_i (``complement``: by 1 − g_i)."""
    return module.register_forward_hook(
        lambda _m, _args, out: out * signal.weights(out, complement)
    )

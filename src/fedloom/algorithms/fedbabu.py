"""FedBABU (Oh, Kim & Yun, ICLR 2022, "FedBABU: Toward Enhanced Representation for
Federated Image Classification"; official code github.com/jhoon-oh/FedBABU).

The model is a body φ (the feature extractor) and a head h (the classifier). Federated
training updates and aggregates the body only; the head stays at its random
initialization h⁰ on every client, through every round. Round t, client k:

    local update:  φ_k ← the round's local steps on F_k(φ, h⁰) over φ only   (h⁰ frozen)
    sends φ_k;     server:  φ^{t+1} = Σ_k n_k φ_k / Σ_k n_k       (FedAvg over the body)

To be scored, client k personalizes the global model (φ^T, h⁰) by fine-tuning it on its
own training data for τ_f = ``ft_epochs`` passes (:mod:`fedloom.algorithms.head_finetune`):
the head alone (``finetune = "head"``) or the whole model (``"all"``).

With LoRA the body is the LoRA-adapted backbone (its LoRA factors; the backbone itself is
frozen) and the head the classifier's tensors (every non-LoRA tensor,
:data:`fedloom.algorithms.sharing.HEAD`). Local training is FedAvg's with the head left
out of the optimizer, so it gets no gradient, no momentum and no weight decay: h⁰ stays
bit for bit. The server step is :meth:`FedAvg.combine` over the body (weighted mean, or
the robust rule of ``[aggregation] rule``).

Communication. The server sends the body only, and the client sends back its body only
(as the official code broadcasts only the body's keys): every client builds the same
model from the same config and seed, so it knows h⁰ without communication
(:attr:`FedModel.initial_params`). The server keeps (φ^t, h⁰), its own build's h⁰.

The global model. (φ^T, h⁰) is the model federated training optimized: every client's
body was trained through this very head, so unlike FedPer's shared base (whose head nobody
trained with it, :mod:`fedloom.algorithms.partial`) it is a complete model, and the paper
reports its accuracy before fine-tuning beside the personalized one. It is scored as the
global adapter (``has_global``); each client's fine-tuned model is its personal adapter.

Defaults: τ_f = 5 epochs, the paper's (the official evaluation fine-tunes 5 epochs;
PFLlib's ``clientbabu.py`` defaults to 10). ``finetune = "head"``: the paper's main
results fine-tune the whole model and report head-only fine-tuning as a variant; fedloom
defaults to the head (the variant whose cost is a forward pass through the backbone and
a backward pass through the head alone), and ``finetune = "all"`` is the paper's main
protocol. τ_f = 5 also scored above 1 epoch on the clients' validation splits of a
label-skewed SST-2 federation no table reports (``benchmarks/personalization.py
--federation sst2-0.2``, seed 0).

Differences from the paper and the official code: (1) the paper's body is every layer
below the classifier of a CNN (4convNet, MobileNet, ResNet on CIFAR), all of it trained;
here it is the LoRA factors of a frozen pretrained backbone.
(2) The fine-tuning uses the local optimizer (AdamW or SGD, ``[train]``) at the
configured learning rates with a constant schedule and fresh moments, the same as
FedAvg-FT's; the official code fine-tunes with SGD (momentum 0.9) at the last learning
rate of its step-decayed training schedule. (3) The official code averages the clients
uniformly (full participation, equal shards); here ``weighting`` applies (default:
by examples, FedAvg's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fedloom.algorithms import sharing
from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.head_finetune import fine_tune, head_names
from fedloom.algorithms.registry import register
from fedloom.params import Params
from fedloom.train.local import train_locally


@register("fedbabu")
@dataclass(frozen=True)
class FedBABU(FedAvg):
    """FedBABU (Oh et al. 2022): the body federated with the head frozen at its
    initialization; each client fine-tunes the head (or everything) before scoring."""

    personalized = True
    has_global = True
    #: passes over the client's training data to personalize before scoring (τ_f)
    ft_epochs: float = 5.0
    #: what the personalization fine-tunes: the head alone, or the whole adapter
    finetune: Literal["head", "all"] = "head"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.ft_epochs > 0:
            raise ValueError(f"algorithm.ft_epochs: must be > 0 (got {self.ft_epochs})")
        if self.finetune not in ("head", "all"):
            raise ValueError(f"algorithm.finetune: must be head or all (got {self.finetune!r})")

    def check_model(self, params: Params) -> None:
        """The adapter needs a head to freeze and to fine-tune."""
        if not head_names(list(params)):
            raise ValueError(
                "model.head: fedbabu freezes the classifier head in training and fine-tunes "
                "it to score; this model's adapter has no head tensor (a causal LM's "
                "verbalizer head is frozen)"
            )

    @staticmethod
    def head(params: Params) -> Params:
        return {n: t for n, t in params.items() if sharing.is_head(n)}

    @staticmethod
    def body(params: Params) -> Params:
        return {n: t for n, t in params.items() if not sharing.is_head(n)}

    def payload(self, state: ServerState, client_id: int) -> Params:
        """The body φ^t alone: the client knows h⁰."""
        return self.body(state.global_params)

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        ctx.model.set_params({**payload, **self.head(ctx.model.initial_params)})
        metrics = train_locally(ctx, only=list(payload))
        trained = ctx.model.get_params()
        return ClientResult(
            ctx.client_id, {n: trained[n] for n in payload}, len(ctx.train), metrics
        )

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        body, extra = self.combine(state, results)
        return self.next_state(
            state,
            global_params={**state.global_params, **body},
            extra={**state.extra, **extra},
        )

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        """(φ^t, h⁰) fine-tuned on the client's training data (``ctx.state`` untouched)."""
        start = {**payload, **self.head(ctx.model.initial_params)}
        return fine_tune(ctx, start, self.ft_epochs, head_only=self.finetune == "head")

"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma & Guan, AAAI 2023, "FedALA: Adaptive Local
Aggregation for Personalized Federated Learning").

Each client keeps its own model θ_k and, before training in round t, initializes it by an
adaptive local aggregation (ALA) of the global model θ^t it receives. The model's layers
are split into the lower layers and the p higher ones; the lower layers take the global
values, the higher ones an element-wise learned mixture:

    lower:   θ̂_k = θ^t
    higher:  θ̂_k = θ_k + (θ^t − θ_k) ⊙ W_k                       W_k ∈ [0, 1], element-wise

The weights W_k are learned on a random s % sample of the client's training data, batch
by batch, by gradient descent on the client's loss at the mixed model (the chain rule
through θ̂ gives ∇_W L = ∇_θ̂ L ⊙ (θ^t − θ_k)), then clipped:

    W_k ← clip(W_k − η ∇_θ̂ L(θ̂_k) ⊙ (θ^t − θ_k), 0, 1),   θ̂_k ← θ_k + (θ^t − θ_k) ⊙ W_k

W_k starts at ones (θ̂_k = θ^t) and persists across rounds. In the client's first ALA (the
start phase) the weights train for epochs over the sample until the standard deviation of
the last ``num_pre_loss`` epoch losses falls below ``threshold``; afterwards one epoch a
round. The client then trains θ̂_k locally (the usual local training) into θ_k, keeps it
and sends it; the server step is FedAvg's (weighted mean, or the ``[aggregation]`` rule).
In its first participation a client has no model of its own: θ_k = θ^t, and ALA is skipped
(the authors' code skips it in the first round, where the two are equal).

On LoRA: the layers are the transformer blocks (their LoRA factors) with the classifier
head on top. The higher layers are the head and the LoRA tensors of the ``top_blocks``
highest transformer blocks holding LoRA; the LoRA tensors of the other blocks take the
global values. The authors' runs mix the last layer alone (their code's ``layer_idx = 2``
counts parameter tensors: the weight and bias of the CNN's last layer), which here is
``top_blocks = 0``, the head. Only the higher part of θ_k is kept in ``ctx.state``
(``ala_local``), with W_k (``ala_weights``); neither is ever sent. The adapter a client
uses, and is scored with, is its ALA mixture of the received global adapter with its
current weights (no weight learning at scoring, so scoring costs no passes).

Defaults, the authors': s = ``rand_percent`` = 80 and η = ``eta`` = 1.0 (the paper's and
their run script's), the head alone (above), ``num_pre_loss`` = 10 (their code's) and
``threshold`` = 0.01 (the value their README gives for the paper; the code defaults to 0.1).
s = 80 also scored above s = 5 (about FedAvg's compute) on the clients' validation
splits of a label-skewed SST-2 federation no table reports
(``benchmarks/personalization.py --federation sst2-0.2``, seed 0); η and the rest are
not tuned for LoRA, where W moves by η times a gradient times a gap of a few local
steps.

Differences from the official code (PFLlib's ``utils/ALA.py``, the authors' FedALA
repository): (1) the sample is a seeded random subset of the client's examples, as the
paper says, where the code takes a contiguous window of the unshuffled data at a random
start; (2) the weights learn with the model in evaluation mode (no dropout), so an epoch's
loss is a deterministic function of W (the paper's CNNs have no dropout); (3) the start
phase's stopping rule reads each epoch's mean batch loss where the code reads the epoch's
last batch loss, and stops after at most ``max_start_epochs`` epochs (the code can loop
for ever, which its README warns of); (4) the server sends the global model only to the
clients it samples (PFLlib runs ALA on every client every round); (5) PFLlib scores a
client after one more epoch of weight learning on the new global model, fedloom scores
the mixture with the weights the client holds.

Compute. ALA takes one forward and backward pass per batch of ``train.batch_size``
examples of the sample (at least ``num_pre_loss + 1`` epochs in the start phase, one epoch
afterwards), counted in ``train_passes``: under a budget of a few local steps the default
80 % sample costs more than the training itself (lower ``rand_percent`` to compare at
equal compute). The backward pass stops at the lowest higher layer (the rest is frozen).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedloom.algorithms import sharing
from fedloom.algorithms.base import ClientContext, ClientResult
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.models.heads import Feature
from fedloom.models.pqlora import layer_index
from fedloom.params import Params
from fedloom.train.local import train_locally, training_only
from fedloom.train.passes import count

#: ctx.state: the higher part of the client's model after its last local training (θ_k)
LOCAL = "ala_local"
#: ctx.state: the element-wise aggregation weights W_k, one tensor per higher tensor
WEIGHTS = "ala_weights"
#: salt of the seeded draw of the weight-learning sample
SAMPLE_SALT = 0xA1A


def adapted_blocks(names: Sequence[str]) -> list[int]:
    """The sorted transformer blocks holding one of the LoRA tensors ``names``."""
    return sorted(
        {b for n in names if not sharing.is_head(n) and (b := layer_index(n)) is not None}
    )


def mix(global_: Params, local: Params, weights: Params) -> Params:
    """θ̂: ``global_`` on every tensor, θ_k + (θ^t − θ_k) ⊙ W on the tensors of ``local``."""
    mixed = dict(global_)
    for n, own in local.items():
        mixed[n] = own + (global_[n] - own) * weights[n]
    return mixed


@register("fedala")
@dataclass(frozen=True)
class FedALA(FedAvg):
    """FedALA (Zhang et al., AAAI 2023): each client initializes its model by an
    element-wise learned mixture of the global and its own higher layers (the head and the
    top blocks' LoRA), the lower ones taken from the global model; FedAvg aggregates."""

    personalized = True
    #: s: the percentage of the client's training examples the weights learn on
    rand_percent: float = 80.0
    #: how many of the highest transformer blocks holding LoRA are mixed, besides the head
    top_blocks: int = 0
    #: η: the weights' learning rate
    eta: float = 1.0
    #: the start phase ends when the std of the last ``num_pre_loss`` epoch losses is below
    threshold: float = 0.01
    num_pre_loss: int = 10
    #: the start phase's cap on epochs over the sample
    max_start_epochs: int = 50

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.rand_percent <= 100:
            raise ValueError(
                f"algorithm.rand_percent: must be in (0, 100] (got {self.rand_percent})"
            )
        if self.top_blocks < 0:
            raise ValueError(f"algorithm.top_blocks: must be >= 0 (got {self.top_blocks})")
        if not self.eta > 0:
            raise ValueError(f"algorithm.eta: must be > 0 (got {self.eta})")
        if self.threshold < 0:
            raise ValueError(f"algorithm.threshold: must be >= 0 (got {self.threshold})")
        if self.num_pre_loss < 1:
            raise ValueError(f"algorithm.num_pre_loss: must be >= 1 (got {self.num_pre_loss})")
        if self.max_start_epochs < 1:
            raise ValueError(
                f"algorithm.max_start_epochs: must be >= 1 (got {self.max_start_epochs})"
            )

    def higher(self, names: Sequence[str]) -> list[str]:
        """The higher tensors among ``names``: the head and the LoRA tensors of the
        ``top_blocks`` highest blocks holding LoRA."""
        blocks = adapted_blocks(names)
        top = set(blocks[len(blocks) - self.top_blocks :]) if self.top_blocks else set()
        return [n for n in names if sharing.is_head(n) or layer_index(n) in top]

    def check_model(self, params: Params) -> None:
        """``top_blocks`` within the blocks holding LoRA, and something to mix."""
        blocks = adapted_blocks(list(params))
        if self.top_blocks > len(blocks):
            raise ValueError(
                f"algorithm.top_blocks: {self.top_blocks}, but the adapter has LoRA tensors "
                f"in {len(blocks)} transformer blocks"
            )
        if not self.higher(list(params)):
            raise ValueError(
                "algorithm.top_blocks: 0 mixes the head alone, and this model has no head "
                "tensors (a causal LM's verbalizer); set top_blocks >= 1"
            )

    def sample(self, ctx: ClientContext) -> list[Feature]:
        """The seeded s % sample of the client's training examples (at least one), in
        their order."""
        n = len(ctx.train)
        size = max(1, int(self.rand_percent / 100 * n))
        rng = np.random.default_rng([ctx.seed, SAMPLE_SALT])
        return [ctx.train[i] for i in np.sort(rng.choice(n, size, replace=False))]

    def start_phase_done(self, losses: Sequence[float]) -> bool:
        if len(losses) >= self.max_start_epochs:
            return True
        recent = losses[-self.num_pre_loss :]
        return len(losses) > self.num_pre_loss and float(np.std(recent)) < self.threshold

    def local_aggregation(
        self, ctx: ClientContext, global_: Params, local: Params, weights: Params | None
    ) -> tuple[Params, Params, dict[str, float]]:
        """ALA: the initialized adapter θ̂_k, the learned weights W_k (from ``weights``, or
        ones and the start phase when None) and the metrics ``ala_epochs``, ``ala_loss``.
        ``ctx.state`` is not touched; ``ctx.model`` is left holding θ̂_k."""
        model = ctx.model
        if model.precision == "fp16":
            raise ValueError(
                'model.precision = "fp16": FedALA\'s weight learning computes gradients '
                'without loss scaling; use "bf16" or "fp32"'
            )
        start_phase = weights is None
        w = {
            n: torch.ones_like(t) if weights is None else weights[n].clone()
            for n, t in local.items()
        }
        gap = {n: global_[n] - own for n, own in local.items()}
        model.set_params(mix(global_, local, w))
        named = model.trainable_parameters()
        tensors = [named[n] for n in local]
        sample, size = self.sample(ctx), ctx.settings.batch_size
        batches = [model.head.collate(sample[i : i + size]) for i in range(0, len(sample), size)]
        losses: list[float] = []
        was_training = model.head.training
        model.head.eval()
        try:
            with training_only(named, local):
                while True:
                    epoch = []
                    for batch in batches:
                        with torch.autocast(
                            model.device.type, dtype=torch.bfloat16, enabled=ctx.settings.bf16
                        ):
                            loss = model.loss(batch)
                        grads = torch.autograd.grad(loss, tensors)
                        count()
                        with torch.no_grad():
                            for n, p, g in zip(local, tensors, grads, strict=True):
                                w[n] = torch.clamp(w[n] - self.eta * g * gap[n], 0.0, 1.0)
                                p.copy_(local[n] + gap[n] * w[n])
                        epoch.append(loss.detach())
                    losses.append(float(torch.stack(epoch).mean()))
                    if not math.isfinite(losses[-1]):
                        raise FloatingPointError(
                            f"client {ctx.client_id}: non-finite loss in FedALA's weight learning"
                        )
                    if not start_phase or self.start_phase_done(losses):
                        break
        finally:
            model.head.train(was_training)
        metrics = {"ala_epochs": float(len(losses)), "ala_loss": losses[-1]}
        return model.get_params(), w, metrics

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        extra: dict[str, float] = {}
        start = payload
        if LOCAL in ctx.state:
            start, weights, extra = self.local_aggregation(
                ctx, payload, ctx.state[LOCAL], ctx.state.get(WEIGHTS)
            )
            ctx.state[WEIGHTS] = weights
        ctx.model.set_params(start)
        metrics = train_locally(ctx)
        trained = ctx.model.get_params()
        ctx.state[LOCAL] = {n: trained[n] for n in self.higher(list(trained))}
        return ClientResult(ctx.client_id, trained, len(ctx.train), {**metrics, **extra})

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        """θ̂_k with the client's current weights; the global adapter before it has any."""
        if WEIGHTS not in ctx.state:
            return payload
        return mix(payload, ctx.state[LOCAL], ctx.state[WEIGHTS])

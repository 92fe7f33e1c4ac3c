"""FedDBE: FedAvg with the Domain Bias Eliminator (Zhang, Hua, Cao, Wang, Song, Xue, Ma &
Guan, NeurIPS 2023, "Eliminating Domain Bias for Federated Learning in Representation
Space").

The model is a feature extractor (the body) and a classifier (the head). DBE gives client
k a personalized representation bias memory (PRBM), a trainable vector z̄ᵖ_k of the
representation's size that never leaves the client, and regularizes the client's mean
representation towards a global one (MR). With z = body(x) the representation of x:

    logits     = head(z + z̄ᵖ_k)
    local mean z̄_k ← (1 − μ) sg(z̄_k) + μ · mean_batch(z)           (reset to 0 each round)
    loss       = CE(logits, y) + κ · mean_j ½ (z̄_k,j − z̄_j)²

sg is stop-gradient (the mean keeps the gradient of the current batch only). Body, head
and z̄ᵖ_k train together with the local optimizer; the body and the head are sent and
averaged (FedAvg's step, or the ``[aggregation]`` rule), z̄ᵖ_k stays on the client, which
uses (and is scored with) the global model plus its own z̄ᵖ_k. The global mean z̄ is
fixed in an initialization period: each client trains without DBE (plain cross-entropy,
z̄ᵖ unused, no MR) while computing its local mean z̄_k, which it uploads with its model;
the server takes z̄ = Σ_k n_k z̄_k / Σ_k n_k and sends it with every later payload.

On LoRA: z is the classifier head's pooled representation (the encoder's output, mean or
[CLS] pooled, before the head's dropout), the body is the LoRA-adapted encoder and the
head the classifier. z̄ᵖ_k is added to the classifier's input after the head's dropout,
by a forward hook on the head's dropout module held only while the client trains
(:func:`representation_bias`); :mod:`fedloom.models.heads` is not changed. The PRBM
trains in the configured optimizer as a head tensor (``train.head_lr``; ``train_locally``'s
``extra_tensors``), as the official code trains it at the model's learning rate; it
starts at zeros. It lives in
``ctx.state["dbe_prbm"]``; z̄ travels in the payload as ``dbe.global_mean`` and each
client's z̄_k, in the initialization round only, in its result as ``dbe.local_mean`` (a
representation mean, which the method's definition uploads).

Defaults: μ = ``momentum`` = 1.0 (z̄_k is the current batch's mean) and κ = ``mr_weight``
= 50, the values of the authors' run script (their DBE repository, FMNIST at Dirichlet
0.1; PFLlib's argparse defaults, 0.1 and 0, switch MR off). κ = 50 also scored above
κ = 1 on the clients' validation splits of a label-skewed SST-2 federation no table reports
(``benchmarks/personalization.py --federation sst2-0.2``, seed 0); μ is not tuned for LoRA.

Differences from the official code (PFLlib's ``clientdbe.py`` / ``serverdbe.py``, the
authors' DBE repository): (1) the initialization period is fedloom's first round: its
sampled clients compute z̄_k while they train, the server averages them into z̄ and also
aggregates their models as in any round, where the code runs an extra round on every
client and throws the trained models away (z̄ then comes from the first round's sampled
clients alone); (2) the PRBM is a tensor of the configured optimizer (AdamW by default)
where the code gives it an SGD optimizer of its own at the same learning rate (they
coincide under plain SGD: ``train.optimizer = "sgd"``, no momentum, no weight decay, no
clipping); (3) with gradient
accumulation z̄_k moves once per micro-batch.

The client is scored with the global adapter and z̄ᵖ_k folded into the classifier's bias
(W (z + z̄ᵖ_k) + b = W z + (b + W z̄ᵖ_k) with the head's dropout off, as in scoring), so
its personal checkpoint is the model it uses. Compute: FedAvg's (the same steps; the hook
adds a vector and a mean).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.models import label_prior
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import ClassifierHead
from fedloom.params import Params, unflatten
from fedloom.train.local import train_locally

#: ctx.state: the client's representation bias z̄ᵖ_k (also its name in the optimizer)
PRBM = "dbe_prbm"
#: payload name of the global mean representation z̄ (server → client)
GLOBAL_MEAN = "dbe.global_mean"
#: result name of a client's mean representation z̄_k (client → server, initialization)
LOCAL_MEAN = "dbe.local_mean"
#: ServerState.extra: z̄ once the initialization round is aggregated
MEAN_KEY = "global_mean"
#: the name the classifier's weight goes by among the adapter's tensors
CLASSIFIER = "classifier.weight"


def classifier_head(model: FedModel) -> ClassifierHead:
    """``model``'s classifier head; a ValueError naming ``model.head`` for a verbalizer."""
    head = model.head
    if not isinstance(head, ClassifierHead):
        raise ValueError(  # noqa: TRY004 - a config mistake, reported as bad input
            f"model.head: feddbe adds its representation bias to a classifier head's pooled "
            f"representation; {model.spec.name} has a verbalizer head"
        )
    return head


@contextmanager
def representation_bias(
    model: FedModel, bias: torch.Tensor | None, pooled: list[torch.Tensor] | None = None
) -> Iterator[None]:
    """Inside the block ``model``'s classifier reads z + ``bias`` (added after the head's
    dropout; nothing added when None) and each forward pass appends its pooled
    representation z (before dropout) to ``pooled``; the hook is removed on leaving."""

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> Any:
        if pooled is not None:
            pooled.append(inputs[0])
        return output if bias is None else output + bias

    handle = classifier_head(model).dropout.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def running_mean(previous: torch.Tensor, batch: torch.Tensor, momentum: float) -> torch.Tensor:
    """z̄_k ← (1 − μ) sg(z̄_k) + μ · mean over the batch of z (rows of ``batch``)."""
    return (1 - momentum) * previous.detach() + momentum * batch.float().mean(0)


def mean_regularizer(local_mean: torch.Tensor, global_mean: torch.Tensor) -> torch.Tensor:
    """MR: mean_j ½ (z̄_k,j − z̄_j)²."""
    return (0.5 * (local_mean - global_mean) ** 2).mean()


@register("feddbe")
@dataclass(frozen=True)
class FedDBE(FedAvg):
    """FedDBE (Zhang et al., NeurIPS 2023): FedAvg with a personal bias vector added to each
    client's pooled representation and its mean representation pulled to the global mean."""

    personalized = True
    not_a_mean = (
        "its clients' mean representations travel beside the update in the first round "
        "and are not clipped"
    )
    #: μ: the weight of the current batch in the client's running mean representation
    momentum: float = 1.0
    #: κ: the weight of the mean regularization
    mr_weight: float = 50.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.momentum <= 1:
            raise ValueError(f"algorithm.momentum: must be in (0, 1] (got {self.momentum})")
        if self.mr_weight < 0:
            raise ValueError(f"algorithm.mr_weight: must be >= 0 (got {self.mr_weight})")

    def check_model(self, params: Params) -> None:
        """The representation bias needs a classifier head (its weight among the tensors)."""
        if not any(n.endswith(CLASSIFIER) for n in params):
            raise ValueError(
                "model.head: feddbe adds its representation bias to a classifier head's "
                "pooled representation; this model has no classifier (a causal LM's "
                "verbalizer)"
            )

    # --- server --------------------------------------------------------------------------
    def payload(self, state: ServerState, client_id: int) -> Params:
        if MEAN_KEY not in state.extra:
            return state.global_params
        return {**state.global_params, GLOBAL_MEAN: state.extra[MEAN_KEY]}

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        names = sorted(state.global_params)
        models = [
            ClientResult(r.client_id, {n: r.params[n] for n in names}, r.num_examples)
            for r in results
        ]
        point, rule_extra = self.combine_flat(state, models, names)
        extra = {**state.extra, **rule_extra}
        if MEAN_KEY not in extra:  # the initialization round
            means = [r for r in results if LOCAL_MEAN in r.params]
            if not means:
                raise ValueError(
                    f"feddbe: no client's mean representation ({LOCAL_MEAN}) reached the "
                    "server in the initialization round (a transform that sums the updates, "
                    "such as secure aggregation, does not carry it)"
                )
            extra[MEAN_KEY] = global_mean(means)
        params = unflatten(point, state.global_params, names)
        return self.next_state(state, global_params=params, extra=extra)

    # --- client --------------------------------------------------------------------------
    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        target = payload.get(GLOBAL_MEAN)
        ctx.model.set_params({n: t for n, t in payload.items() if n != GLOBAL_MEAN})
        metrics, bias, mean = self.train(ctx, self.bias(ctx), target)
        params = ctx.model.get_params()
        if target is None:  # the initialization period: upload z̄_k
            params[LOCAL_MEAN] = mean
        else:
            ctx.state[PRBM] = bias
        return ClientResult(ctx.client_id, params, len(ctx.train), metrics)

    def bias(self, ctx: ClientContext) -> torch.Tensor:
        """The client's z̄ᵖ_k: its own, or zeros before its first DBE round."""
        if PRBM in ctx.state:
            return ctx.state[PRBM]
        head = classifier_head(ctx.model)
        return torch.zeros(head.classifier.in_features, device=head.device)

    def train(
        self, ctx: ClientContext, bias: torch.Tensor, target: torch.Tensor | None
    ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """One round of :func:`train_locally` with DBE when the global mean ``target`` is
        known (z̄ᵖ_k added by the hook and trained beside the model, MR as the extra loss
        term), plain cross-entropy before (z̄_k still tracked); returns the metrics
        (``train_loss`` with the MR term), z̄ᵖ_k and z̄_k."""
        prbm = bias.detach().clone().requires_grad_(True)
        pooled: list[torch.Tensor] = []
        mean = [torch.zeros_like(prbm.detach())]

        def regularizer() -> torch.Tensor:
            mean[0] = running_mean(mean[0], pooled.pop(), self.momentum)
            if target is None:
                return torch.zeros((), device=prbm.device)
            return self.mr_weight * mean_regularizer(mean[0], target)

        with representation_bias(ctx.model, None if target is None else prbm, pooled):
            metrics = train_locally(ctx, regularizer, extra_tensors={PRBM: prbm})
        return metrics, prbm.detach(), mean[0].detach()

    # --- scoring -------------------------------------------------------------------------
    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        """The global adapter with z̄ᵖ_k folded into the classifier's bias: head(z + z̄ᵖ_k)
        = W z + (b + W z̄ᵖ_k) when the head's dropout is off, as in scoring (the global
        adapter itself before the client's first DBE round)."""
        adapter = {n: t for n, t in payload.items() if n != GLOBAL_MEAN}
        if PRBM not in ctx.state:
            return adapter
        weight, _ = label_prior.classifier_names(ctx.model)
        shift = adapter[weight].double() @ ctx.state[PRBM].to(adapter[weight]).double()
        return label_prior.shift_classifier(ctx.model, adapter, bias=shift)


def global_mean(results: Sequence[ClientResult]) -> torch.Tensor:
    """z̄ = Σ_k n_k z̄_k / Σ_k n_k over the results' uploaded means (float32)."""
    counts = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
    stacked = torch.stack([r.params[LOCAL_MEAN].double().cpu() for r in results])
    return ((counts @ stacked) / counts.sum()).float()

"""FedRoD (Chen & Chao, ICLR 2022, "On Bridging Generic and Personalized Federated
Learning for Image Classification"), its linear personal head.

Two predictors on one shared body. The body φ (with LoRA: the LoRA factors over the
frozen backbone; z(x) its pooled features) and the generic head ψ = (U, u) (the
classifier ``head`` tensors; g(x) = U z(x) + u its logits) are federated; each client k
also keeps a personal head h_k(z) = A_k z + a_k (a linear layer, hidden → classes), which
never leaves it. Client k, with n_{k,y} training examples of class y, in round t:

    generic:   (φ_k, ψ_k) ← S local steps from (φ^t, ψ^t) on the balanced softmax
                   L^BSM_k(x, y) = −log softmax(g(x) + γ log n_k)_y
    personal:  h_k ← S steps on the empirical risk of the summed logits
                   L_k(x, y) = −log softmax(sg[g(x)] + h_k(sg[z(x)]))_y    (sg: no gradient)
    sends (φ_k, ψ_k), keeps h_k;   server: FedAvg over (φ, ψ)

(the personal loss moves h_k only, as PFLlib's ``clientrod.py`` trains it: the body's
features and the generic logits are detached).

The balanced softmax (Ren et al. 2020) makes every client's generic objective an
estimate of the class-balanced risk, whatever its label mix, so the averaged generic
model is the federation's generic model, scored on raw logits g(x) (``has_global``). The
personal prediction is argmax_y g(x) + h_k(z(x)) (``personalized``): the personal head
learns, on top of the generic logits, the client's own label prior and decision shift.
S is the round's budget (``train.local_steps`` / ``local_epochs``); the generic step is
``train_locally`` under :func:`fedloom.models.label_prior.offset_logits` (the counts are
read on the client, :func:`~fedloom.models.label_prior.label_counts`, and never sent),
so ``[aggregation]`` rules, compression and privacy transforms compose unchanged.

Both heads are linear on the same pooled features, so g(x) + h_k(z(x)) is the classifier
with weight U + A_k and bias u + a_k: the adapter client k uses is the global one
with its personal head added into the classifier's tensors (:meth:`FedRoD.client_adapter`).
It is scored, checkpointed (``checkpoints/personal``) and re-scored by ``fedloom eval
--personal`` as any adapter is, with the dev-weighted client scores' example weights.

The personal head is trained on the client, after the generic steps, on the round's
final body: the distinct examples the S steps drew are embedded once (pooled features
in eval mode, :meth:`FedModel.embed`), their generic logits taken from the trained
generic head, and S steps over the same batches as the body's (same seed, so the same
examples each step) fit h_k with the configured optimizer, its own moments
(``optimizer_personal_head`` in ``ctx.state``), clipping and the schedule's clock;
h_k itself is ``personal_head`` in ``ctx.state`` (saved with the client's state, so a
resumed run continues it). Its rate is ``personal_lr`` (default: the head's,
``train.head_lr`` or ``train.lr``, as PFLlib's personal head takes the body's rate).

Cost. The generic training is FedAvg's S · ``grad_accum`` passes (``train_passes``);
the personal head adds one forward-only pass over the distinct examples the round drew
(at most min(n_k, S · batch · grad_accum); reported as ``personal_embedded``) and S
steps of a classes x hidden linear layer on cached features. A forward without a
backward is not a training pass (:mod:`fedloom.train.passes`, like scoring), so
``train_passes`` is FedAvg's.

How fedloom differs from the paper and PFLlib (``clientrod.py``):

* PFLlib interleaves the two updates: each batch takes a generic step, then a personal
  step on that batch's features and generic logits from before the generic step. fedloom's
  training loop (``train_locally``, shared with DP-SGD and the batched clients) gives no
  per-step features, and the personal loss sends no gradient into the body or the
  generic head, so fedloom fits the personal head after the generic steps, on the
  body and generic head the client ends the round with: the ones its personal
  prediction uses, at the price of one forward pass over the drawn examples.
* Features are taken in eval mode (no dropout), as at scoring; PFLlib's come from the
  training-mode forward.
* PFLlib (and FL-bench) start the personal head as a copy of the initial generic head;
  fedloom starts it at zero, so that before any personal training the personal
  prediction is exactly the generic one.
* ``gamma`` is the exponent of the counts, n^γ, as FL-bench exposes it; γ = 1 (the
  default) is the balanced softmax PFLlib uses, and scored above γ = 0.5 on the
  clients' validation splits of a label-skewed SST-2 federation no table reports
  (``benchmarks/personalization.py --federation sst2-0.2``, seed 0). A class the client
  has no example of gets log 0 = −∞ (γ > 0), as in both: it leaves the client's generic
  softmax.
* The paper's hypernetwork variant (FedRoD (hyper), a personal head generated from the
  client's class distribution) is not implemented.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedloom.algorithms.base import ClientContext, ClientResult
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.models import label_prior
from fedloom.models.heads import feature_length
from fedloom.params import Params
from fedloom.train.batching import client_batches
from fedloom.train.local import (
    build_optimizer,
    schedule_clock,
    schedule_step,
    steps_per_round,
    train_locally,
)

#: where a client keeps its personal head in ctx.state: {"weight": (classes, hidden),
#: "bias": (classes,)}
PERSONAL_HEAD = "personal_head"
#: where the personal head's optimizer moments persist in ctx.state
OPTIMIZER_PERSONAL = "optimizer_personal_head"


def balanced_offset(counts: np.ndarray, gamma: float) -> np.ndarray:
    """(classes,) the balanced softmax's offset to the logits, γ log n_y (−∞ for a class
    with no example when γ > 0; 0 everywhere for γ = 0)."""
    with np.errstate(divide="ignore"):
        return np.log(counts**gamma)


def drawn_batches(ctx: ClientContext, steps: int) -> list[np.ndarray]:
    """The training-example indices of each of ``steps`` steps (their ``grad_accum``
    micro-batches together), drawn as ``train_locally`` draws them for ``ctx``."""
    settings = ctx.settings
    batches = client_batches(
        settings.batching,
        [feature_length(f) for f in ctx.train],
        settings.batch_size,
        np.random.default_rng(ctx.seed),
    )
    return [
        np.concatenate([next(batches) for _ in range(settings.grad_accum)]) for _ in range(steps)
    ]


@register("fedrod")
@dataclass(frozen=True)
class FedRoD(FedAvg):
    """FedRoD (Chen & Chao, ICLR 2022): body and generic head federated, trained on the
    balanced softmax; a personal linear head per client added to the generic logits."""

    personalized = True
    has_global = True
    adjusts_logits = True
    #: γ, the exponent of the class counts in the balanced softmax (0: plain cross-entropy)
    gamma: float = 1.0
    #: the personal head's learning rate (None: the head's, train.head_lr or train.lr)
    personal_lr: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.gamma) and self.gamma >= 0):
            raise ValueError(f"algorithm.gamma: must be a finite number >= 0 (got {self.gamma})")
        if self.personal_lr is not None and not (
            math.isfinite(self.personal_lr) and self.personal_lr > 0
        ):
            raise ValueError(
                f"algorithm.personal_lr: must be a finite number > 0 (got {self.personal_lr})"
            )

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        counts = label_prior.label_counts(ctx.train, ctx.model.task.num_labels)
        ctx.model.set_params(payload)
        with label_prior.offset_logits(ctx.model, balanced_offset(counts, self.gamma)):
            metrics = train_locally(ctx)
        generic = ctx.model.get_params()
        personal = self.train_personal_head(ctx)
        return ClientResult(ctx.client_id, generic, len(ctx.train), {**metrics, **personal})

    def personal_head(self, ctx: ClientContext) -> Params:
        """The client's personal head: its own, or zero before its first training."""
        if PERSONAL_HEAD in ctx.state:
            return ctx.state[PERSONAL_HEAD]
        linear = label_prior.classifier(ctx.model).classifier
        return {
            "weight": torch.zeros_like(linear.weight.detach()),
            "bias": torch.zeros_like(linear.bias.detach()),
        }

    def train_personal_head(self, ctx: ClientContext) -> dict[str, float]:
        """S steps on the cross-entropy of the generic logits plus the personal head's,
        over the round's batches, with the body and generic head as trained (in place on
        ``ctx.state``); its metrics: ``personal_loss`` (mean over the steps) and
        ``personal_embedded`` (the examples embedded, forward only)."""
        settings, model = ctx.settings, ctx.model
        steps = steps_per_round(settings, len(ctx.train))
        drawn = drawn_batches(ctx, steps)
        used = np.unique(np.concatenate(drawn))
        examples = [ctx.train[i] for i in used]
        features = torch.as_tensor(model.embed(examples, settings.batch_size), device=model.device)
        labels = torch.tensor([int(f["label"]) for f in examples], device=model.device)
        with torch.no_grad():
            generic = label_prior.classifier(model).classifier(features).float()

        leaves = {
            f"{PERSONAL_HEAD}.{n}": t.detach().clone().float().requires_grad_(True)
            for n, t in self.personal_head(ctx).items()
        }
        weight, bias = leaves[f"{PERSONAL_HEAD}.weight"], leaves[f"{PERSONAL_HEAD}.bias"]
        optimizer = build_optimizer(settings, leaves)
        if self.personal_lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] = self.personal_lr
        if settings.optimizer_state == "persist" and OPTIMIZER_PERSONAL in ctx.state:
            # a copy: the saved moments stay as they were until the server accepts the round
            optimizer.load_state_dict(copy.deepcopy(ctx.state[OPTIMIZER_PERSONAL]))
        total, offset, warmup = schedule_clock(settings, steps, ctx.round, ctx.total_rounds)
        lr_sums = [0.0] * len(optimizer.param_groups)
        losses = []
        for step, indices in enumerate(drawn):
            schedule_step(optimizer, settings, offset + step, total, warmup, lr_sums)
            rows = torch.as_tensor(np.searchsorted(used, indices), device=model.device)
            logits = generic[rows] + features[rows] @ weight.T + bias
            loss = F.cross_entropy(logits, labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if settings.clip_norm > 0:
                torch.nn.utils.clip_grad_norm_([weight, bias], settings.clip_norm)
            optimizer.step()
            losses.append(loss.detach())
        mean_loss = float(torch.stack(losses).mean())
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"client {ctx.client_id}: non-finite personal-head loss")
        if settings.optimizer_state == "persist":
            ctx.state[OPTIMIZER_PERSONAL] = optimizer.state_dict()
        ctx.state[PERSONAL_HEAD] = {"weight": weight.detach(), "bias": bias.detach()}
        return {"personal_loss": mean_loss, "personal_embedded": float(len(used))}

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        """The global adapter with the personal head added into the classifier: logits
        g(x) + h_k(z(x)) in one linear layer."""
        head = self.personal_head(ctx)
        return label_prior.shift_classifier(
            ctx.model, payload, weight=head["weight"], bias=head["bias"]
        )

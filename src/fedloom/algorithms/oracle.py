"""The label-prior oracle: the pooled (centralized) model's features with each client's own
label prior. A benchmark reference, not a federated method: its server trains on every
client's training data, as :mod:`fedloom.algorithms.centralized` does (``pools_data``; so
it is refused where the clients' data stay on their nodes, ``runtime.client_data =
"nodes"``), and each client then applies what it alone knows, its label prior. The gap
between the oracle and the centralized model is the headroom of personalization under
label skew; a personalized method that gets near it has recovered the client's prior.

Training is centralized training: one party holds the pooled training data D = ∪_k D_k
and its adapter is the global one (scored as such, ``has_global``). To be scored, client k
uses the global adapter with its own prior, by ``prior``:

* ``"logit_adjust"`` (default): the prior correction of a classifier for label shift
  (Saerens, Latinne & Decaestecker, Neural Computation 2002, "Adjusting the Outputs of a
  Classifier to New a Priori Probabilities"), in the logit form of post-hoc logit
  adjustment (Menon, Jayasumana, Rawat, Jain, Veit & Kumar, ICLR 2021, "Long-tail
  learning via logit adjustment"): the pooled model estimates p(y | x) under the pooled
  prior p; under client k's prior p_k, with p(x | y) shared, Bayes' rule gives

      z_y^k(x) = z_y(x) / T + log p_k(y) − log p(y)

  with p_k from client k's own training labels and p from the pooled training labels,
  both add-one smoothed (:func:`fedloom.models.label_prior.log_prior`). Bayes' rule needs
  calibrated p(y | x), and a fine-tuned transformer is over-confident off its training
  data, so the party divides the logits by a temperature T fitted on the pooled
  validation split (temperature scaling, Guo et al., ICML 2017;
  :mod:`fedloom.models.calibration`; calibration is what makes a label-shift correction
  work, Alexandari, Kundaje & Shrikumar, ICML 2020). ``calibrate = False`` (or no
  validation split) keeps T = 1, the pooled model's own confidence. T and the offset
  change a linear layer's output, so client k's adapter is the global one with its classifier's weight and bias
  divided by T and the offset added to the bias: the same logits as the global adapter
  under :func:`fedloom.models.label_prior.offset_logits` at T = 1 (tests/test_oracle.py),
  in an adapter that is the model the client is scored with (its checkpoint, and Self /
  Others). Under bf16 the classifier, offset included, enters the logits at the forward
  pass's precision.
* ``"head_finetune"``: client k fine-tunes the head alone on its own training data for
  ``ft_epochs`` passes (default 5, FedBABU's; :mod:`fedloom.algorithms.head_finetune`,
  FedBABU's personalization step), which can learn more than the prior, e.g. a client's
  own class boundaries; its passes are the scored adapter's ``adapt_passes``.

The pooled label counts and T. The one party holds D, so it reports D's label counts and
its model's T to the server with its update (as metrics, beside its adapter, in
``logit_adjust`` only); the server keeps them in its state (checkpointed with it) and
sends them to the clients with the global adapter, under the payload entries
:data:`POOLED_COUNTS` and :data:`TEMPERATURE`, which no model tensor is named; a client's
own counts never leave it. Before the party's first update there are no pooled counts,
and a client scores the global adapter as it is.

Both variants need one logit per class (``adjusts_logits``): regression tasks and a
causal LM's verbalizer head are refused. In a mixed-backbone federation each backbone's
party pools its own clients' data, so p is that backbone's pooled prior.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.centralized import Centralized
from fedloom.algorithms.head_finetune import fine_tune
from fedloom.algorithms.registry import register
from fedloom.models import calibration, label_prior
from fedloom.params import Params

#: the payload entry (and ServerState.extra key) of the pooled training data's label counts
POOLED_COUNTS = "pooled_label_counts"
#: the payload entry (and ServerState.extra key) of the pooled model's temperature T, and
#: the party's metric of it
TEMPERATURE = "pooled_temperature"
#: the head fine-tuning's passes over the client's data without ``ft_epochs`` (FedBABU's)
DEFAULT_FT_EPOCHS = 5.0


@register("oracle_prior")
@dataclass(frozen=True)
class OraclePrior(Centralized):
    """A benchmark reference: the pooled model with each client's own label prior; the
    headroom of personalization under label skew, not a federated method."""

    personalized = True
    has_global = True
    adjusts_logits = True
    #: how a client applies its prior: logit adjustment, or fine-tuning the head
    prior: Literal["logit_adjust", "head_finetune"] = "logit_adjust"
    #: passes of the head fine-tuning (``prior = "head_finetune"`` only; unset: 5)
    ft_epochs: float | None = None
    #: ``logit_adjust``: the pooled model's logits divided by a temperature fitted on the
    #: pooled validation split before the prior moves them (False: T = 1, uncalibrated)
    calibrate: bool = True

    def __post_init__(self) -> None:
        if self.prior not in ("logit_adjust", "head_finetune"):
            raise ValueError(
                f"algorithm.prior: must be logit_adjust or head_finetune (got {self.prior!r})"
            )
        if self.ft_epochs is not None and self.prior != "head_finetune":
            raise ValueError("algorithm.ft_epochs: only with prior = 'head_finetune'")
        if self.ft_epochs is not None and not self.ft_epochs > 0:
            raise ValueError(f"algorithm.ft_epochs: must be > 0 (got {self.ft_epochs})")
        if not self.calibrate and self.prior != "logit_adjust":
            raise ValueError("algorithm.calibrate: only with prior = 'logit_adjust'")

    # --- the pooled party and the server ------------------------------------------------
    def payload(self, state: ServerState, client_id: int) -> Params:
        """The global adapter, and the pooled label counts and temperature once the party
        has sent them."""
        sent = {n: state.extra[n] for n in (POOLED_COUNTS, TEMPERATURE) if n in state.extra}
        return {**state.global_params, **sent}

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        """Centralized training of the pooled party; with ``logit_adjust`` its update
        carries the pooled data's label counts and its model's temperature."""
        result = super().local_train(ctx, adapter_of(payload))
        if self.prior != "logit_adjust":
            return result
        counts = label_prior.label_counts(ctx.train, ctx.model.task.num_labels)
        reported = label_prior.count_metrics(counts)
        reported[TEMPERATURE] = self.temperature(ctx, result.params)
        return replace(result, metrics={**result.metrics, **reported})

    def temperature(self, ctx: ClientContext, adapter: Params) -> float:
        """T of the party's trained ``adapter``, fitted on the pooled validation split
        (:func:`fedloom.models.calibration.fit_temperature`); 1 without ``calibrate`` or
        without a validation split (``partition.val_fraction = 0``)."""
        if not self.calibrate or not ctx.val:
            return 1.0
        ctx.model.set_params(adapter)
        log_probs, labels = calibration.held_out_log_probs(
            ctx.model, ctx.val, ctx.settings.batch_size
        )
        return calibration.fit_temperature(log_probs, labels)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        (only,) = results
        after = super().aggregate(state, results)
        if self.prior != "logit_adjust":
            return after
        counts = label_prior.reported_counts(only.metrics, "oracle_prior's pooled party")
        temperature = torch.tensor([only.metrics.get(TEMPERATURE, 1.0)], dtype=torch.float32)
        return replace(
            after, extra={**after.extra, POOLED_COUNTS: counts, TEMPERATURE: temperature}
        )

    # --- on the client ------------------------------------------------------------------
    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        """The global adapter with client k's prior: its logits moved by log p_k − log p,
        or its head fine-tuned on the client's data (``ctx.state`` untouched)."""
        adapter = adapter_of(payload)
        if self.prior == "head_finetune":
            epochs = DEFAULT_FT_EPOCHS if self.ft_epochs is None else self.ft_epochs
            return fine_tune(ctx, adapter, epochs, head_only=True)
        if POOLED_COUNTS not in payload:
            return adapter
        temperature = float(payload[TEMPERATURE]) if TEMPERATURE in payload else 1.0
        return label_prior.to_own_prior(
            ctx.model, adapter, ctx.train, payload[POOLED_COUNTS], temperature
        )


def adapter_of(payload: Params) -> Params:
    """``payload`` without the pooled label counts and temperature: the adapter."""
    return {n: t for n, t in payload.items() if n not in (POOLED_COUNTS, TEMPERATURE)}

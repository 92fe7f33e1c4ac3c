"""FedAvg with each client's own label prior: post-hoc logit adjustment of the federated
global model.

FedAvg (:mod:`fedloom.algorithms.fedavg`) trains one global model on every client's data;
under label skew it predicts with the label mix p it was trained on, not client k's own
p_k. With p(x | y) shared, Bayes' rule moves a calibrated classifier to client k's prior
(Saerens, Latinne & Decaestecker, Neural Computation 2002), in the logit form of post-hoc
logit adjustment (Menon et al., ICLR 2021):

    z_y^k(x) = z_y(x) / T + log p_k(y) − log p(y)

* p_k: client k's own training labels, add-one smoothed
  (:func:`fedloom.models.label_prior.log_prior`);
* p: the label mix the global model trained on. Each client reports its label counts with
  its update; the server sums them over every participation so far (a client sampled in r
  rounds counts r times, as its examples did in the averaged updates) and sends the sum
  with the global adapter;
* T: the temperature that makes the global model's probabilities honest on the clients'
  validation splits taken together (``partition.val_fraction``; temperature scaling, Guo
  et al., ICML 2017), as the oracle fits it on the pooled validation split. No party holds
  those splits together, so the fit is federated on a grid: each client scores the global
  adapter it receives on its own validation split and reports the summed NLL of
  softmax(z / T) at each of 81 temperatures
  (:func:`fedloom.models.calibration.nll_by_temperature`, T from 0.05 to 100, about 10 %
  apart); the server adds the sums up and keeps the T with the least
  (:func:`~fedloom.models.calibration.grid_temperature`). The T a client is scored with is
  thus the previous round's global model's, one round behind the model it corrects; a
  fine-tuned transformer is over-confident off its training data, and an uncalibrated
  offset barely moves it. Without validation splits (or ``calibrate = False``) T = 1.
  ``calibrate`` defaults to true, chosen on validation of a federation no table reports
  (SST-2, Dirichlet 0.2, 12 clients): there true and false tie (the fitted T was 1.05),
  and the tie goes to calibrating, which the oracle's over-confident pooled model needs.
  One T for all, not one per client: a client's own validation split is a handful of
  examples, often of a single label, and on examples the model already gets right the
  NLL falls as T does, down to the grid's bound, where the offset no longer counts.

The personal adapter is the global one with its classifier's weight and bias divided by
T and the offset added to the bias (:func:`fedloom.models.label_prior.adjust_classifier`),
built when the client is scored; training and aggregation are FedAvg's, so every
``[aggregation]`` rule and transform applies to the update.

How it differs from the label-prior oracle (``oracle_prior``, ``prior = "logit_adjust"``):
the same correction on FedAvg's federated features instead of the pooled model's, with T
fitted on a grid from the clients' sums, one round behind. Side by side, the oracle minus
this method is what pooling the data adds to the features, and this method minus
``local`` whether federated features with the client's prior beat training alone. It is fedloom's composition of those published rules, a
baseline for label skew rather than a method of its own paper.

What travels beyond the update: each client's label counts (one number per class) and its
validation NLL at each grid temperature, in the clear, so DP-FedAvg does not cover the
method; ``adjusts_logits``: regression tasks and a causal LM's verbalizer head are
refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.models import calibration, label_prior
from fedloom.params import Params

#: the payload entry (and ServerState.extra key) of the label counts the global model
#: trained on, summed over every participation
TRAINED_COUNTS = "trained_label_counts"
#: the payload entry (and ServerState.extra key) of the temperature fitted on the clients'
#: validation NLL sums
TEMPERATURE = "validation_temperature"
#: a client's summed validation NLL at the i-th grid temperature is the metric
#: ``NLL_METRIC.format(i)``
NLL_METRIC = "validation_nll_{}"
SENT = (TRAINED_COUNTS, TEMPERATURE)


@register("fedavg_la")
@dataclass(frozen=True)
class FedAvgLA(FedAvg):
    """FedAvg, then each client moves the global model to its own label prior by
    calibrated logit adjustment."""

    personalized = True
    has_global = True
    adjusts_logits = True
    not_a_mean = (
        "its clients' label counts and validation NLL sums travel beside the update and "
        "are not noised"
    )
    #: fit T on the clients' validation NLL sums (False: T = 1, the model's own confidence)
    calibrate: bool = True

    def payload(self, state: ServerState, client_id: int) -> Params:
        """The global adapter, and the label counts it trained on and T once there are any."""
        return {**state.global_params, **{n: state.extra[n] for n in SENT if n in state.extra}}

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        """FedAvg's local training; the update carries the client's label counts and, with
        ``calibrate`` and a validation split, the received global adapter's validation NLL
        at each grid temperature."""
        adapter = adapter_of(payload)
        reported = label_prior.count_metrics(
            label_prior.label_counts(ctx.train, ctx.model.task.num_labels)
        )
        if self.calibrate and ctx.val:
            ctx.model.set_params(adapter)
            nll = calibration.nll_by_temperature(
                *calibration.held_out_log_probs(ctx.model, ctx.val, ctx.settings.batch_size)
            )
            reported |= {NLL_METRIC.format(i): float(v) for i, v in enumerate(nll)}
        result = super().local_train(ctx, adapter)
        return replace(result, metrics={**result.metrics, **reported})

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        """FedAvg's step on the updates; the round's label counts added to the running sum,
        and T from the reported NLL sums (kept from an earlier round where none came)."""
        reported = [
            label_prior.reported_counts(r.metrics, f"fedavg_la: client {r.client_id}")
            for r in results
        ]
        after = super().aggregate(state, results)
        total = torch.stack(reported).sum(0)
        previous = state.extra.get(TRAINED_COUNTS)
        extra = {TRAINED_COUNTS: total if previous is None else total + previous}
        sums = [v for r in results if (v := nll_sums(r.metrics)) is not None]
        if sums:
            fitted = calibration.grid_temperature(np.sum(sums, axis=0))
            extra[TEMPERATURE] = torch.tensor([fitted], dtype=torch.float32)
        return replace(after, extra={**after.extra, **extra})

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        """The global adapter moved to the client's prior at the fitted T (``ctx.state``
        untouched); before any counts arrive, the global adapter."""
        adapter = adapter_of(payload)
        if TRAINED_COUNTS not in payload:
            return adapter
        temperature = float(payload[TEMPERATURE]) if TEMPERATURE in payload else 1.0
        return label_prior.to_own_prior(
            ctx.model, adapter, ctx.train, payload[TRAINED_COUNTS], temperature
        )


def nll_sums(metrics: Mapping[str, float]) -> np.ndarray | None:
    """A client's validation NLL at each grid temperature (:data:`NLL_METRIC`), None where
    it reported none; a ValueError for a partial report."""
    found = [metrics.get(NLL_METRIC.format(i)) for i in range(len(calibration.T_GRID))]
    if all(v is None for v in found):
        return None
    if any(v is None for v in found):
        raise ValueError(
            f"fedavg_la: {sum(v is not None for v in found)} of "
            f"{len(found)} validation NLL sums reported"
        )
    return np.array(found, dtype=np.float64)


def adapter_of(payload: Params) -> Params:
    """``payload`` without the label counts and T: the adapter."""
    return {n: t for n, t in payload.items() if n not in SENT}

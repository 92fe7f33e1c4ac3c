"""FedAvg with each client's own label prior: post-hoc logit adjustment of the federated
global model.

FedAvg (:mod:`fedloom.algorithms.fedavg`) trains one global model on every client's data;
under label skew it predicts with the label mix p it was trained on, not client k's own
p_k. With p(x | y) shared, Bayes' rule moves a calibrated classifier to client k's prior
(Saerens, Latinne & Decaestecker, Neural Computation 2002), in the logit form of post-hoc
logit adjustment (Menon et al., ICLR 2021):

    z_y^k(x) = z_y(x) / T_k + log p_k(y) − log p(y)

* p_k: client k's own training labels, add-one smoothed
  (:func:`fedloom.models.label_prior.log_prior`);
* p: the label mix the global model trained on. Each client reports its label counts with
  its update; the server sums them over every participation so far (a client sampled in r
  rounds counts r times, as its examples did in the averaged updates) and sends the sum
  with the global adapter;
* T_k: the temperature that makes the adjusted probabilities honest on client k's own
  validation split (``partition.val_fraction``): the NLL of softmax(z / T + log p_k −
  log p) minimized over T (temperature scaling, Guo et al., ICML 2017, with the prior's
  offset inside; :func:`fedloom.models.calibration.fit_temperature`). A fine-tuned
  transformer is over-confident off its training data, and an uncalibrated offset barely
  moves it. Without a validation split T_k = 1.

The personal adapter is the global one with its classifier's weight and bias divided by
T_k and the offset added to the bias (:func:`fedloom.models.label_prior.adjust_classifier`),
built when the client is scored; training and aggregation are FedAvg's, so every
``[aggregation]`` rule and transform applies to the update.

How it differs from the label-prior oracle (``oracle_prior``, ``prior = "logit_adjust"``):
the same correction on FedAvg's federated features instead of the pooled model's, and T
fitted by each client on its own validation split instead of on the pooled one, which no
federated party holds. Side by side, the oracle minus this method is what pooling the data
adds to the features, and this method minus ``local`` whether federated features with the
client's prior beat training alone. It is fedloom's composition of those published rules, a
baseline for label skew rather than a method of its own paper.

What travels beyond the update: each client's label counts (one number per class), in the
clear, so DP-FedAvg does not cover the method; ``adjusts_logits``: regression tasks and a
causal LM's verbalizer head are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register
from fedloom.models import calibration, label_prior
from fedloom.params import Params

#: the payload entry (and ServerState.extra key) of the label counts the global model
#: trained on, summed over every participation
TRAINED_COUNTS = "trained_label_counts"


@register("fedavg_la")
@dataclass(frozen=True)
class FedAvgLA(FedAvg):
    """FedAvg, then each client moves the global model to its own label prior by
    calibrated logit adjustment."""

    personalized = True
    has_global = True
    adjusts_logits = True
    #: fit T_k on the client's validation split (False: T = 1, the model's own confidence)
    calibrate: bool = True

    def payload(self, state: ServerState, client_id: int) -> Params:
        """The global adapter, and the label counts it trained on once there are any."""
        counts = state.extra.get(TRAINED_COUNTS)
        return (
            state.global_params
            if counts is None
            else {**state.global_params, TRAINED_COUNTS: counts}
        )

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        """FedAvg's local training; the update carries the client's label counts."""
        result = super().local_train(ctx, adapter_of(payload))
        counts = label_prior.label_counts(ctx.train, ctx.model.task.num_labels)
        return replace(result, metrics={**result.metrics, **label_prior.count_metrics(counts)})

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        """FedAvg's step on the updates; the round's label counts added to the running sum."""
        reported = [
            label_prior.reported_counts(r.metrics, f"fedavg_la: client {r.client_id}")
            for r in results
        ]
        after = super().aggregate(state, results)
        previous = state.extra.get(TRAINED_COUNTS)
        total = torch.stack(reported).sum(0)
        if previous is not None:
            total = total + previous
        return replace(after, extra={**after.extra, TRAINED_COUNTS: total})

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        """The global adapter moved to the client's prior with its own temperature
        (``ctx.state`` untouched); before any counts arrive, the global adapter."""
        adapter = adapter_of(payload)
        if TRAINED_COUNTS not in payload:
            return adapter
        own = label_prior.log_prior(label_prior.label_counts(ctx.train, ctx.model.task.num_labels))
        trained = label_prior.log_prior(payload[TRAINED_COUNTS].double().cpu().numpy())
        offset = torch.as_tensor(own - trained, dtype=torch.float64)
        return label_prior.adjust_classifier(
            ctx.model, adapter, offset, self.temperature(ctx, adapter, offset)
        )

    def temperature(self, ctx: ClientContext, adapter: Params, offset: torch.Tensor) -> float:
        """T_k: the adjusted NLL's minimizer on the client's validation split; 1 without
        ``calibrate`` or without a validation split."""
        if not self.calibrate or not ctx.val:
            return 1.0
        ctx.model.set_params(adapter)
        log_probs, labels = calibration.held_out_log_probs(
            ctx.model, ctx.val, ctx.settings.batch_size
        )
        return calibration.fit_temperature(log_probs, labels, offset)


def adapter_of(payload: Params) -> Params:
    """``payload`` without the label counts: the adapter."""
    return {n: t for n, t in payload.items() if n != TRAINED_COUNTS}

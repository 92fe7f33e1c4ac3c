"""``fedloom diagnose``: how heterogeneous a federation is, measured before any training.

At the initial model (LoRA B = 0, so the frozen backbone plus a fresh head) it measures:

- label skew: each client's Jensen–Shannon divergence to the global label mix;
- quantity skew: the coefficient of variation of the client sizes;
- task heterogeneity: how many tasks the clients hold;
- gradient dissimilarity G² = Σ_k p_k ‖∇F_k(w) − ∇F(w)‖² and B² on a few batches per
  client, raw and with the minibatch noise of those estimates removed, with the clients'
  gradient cosine matrix (client groups);
- feature shift: distance of each client's mean embedding to the pooled mean;
- concept shift: how well a client's labels agree with its nearest neighbours held by
  other clients, against its agreement with itself.

and turns the numbers into advice (:mod:`fedloom.diagnostics.advice`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedloom.diagnostics import (
    Advice,
    Dissimilarity,
    Measures,
    advise,
    client_gradient_estimate,
    feature_shift,
    gradient_dissimilarity,
    label_consistency,
)
from fedloom.experiment import ClientData, Experiment


@dataclass
class Diagnosis:
    """Everything ``fedloom diagnose`` measured, and the advice drawn from it."""

    stats: dict[str, Any]
    gradient: Dissimilarity
    feature: dict[str, Any]
    consistency: dict[str, Any] | None
    advice: Advice

    def to_dict(self) -> dict[str, Any]:
        g = self.gradient
        return {
            "partition": self.stats,
            "gradient": {
                "g2": g.g2,
                "b2": _json_number(g.b2),
                "g2_debiased": _json_number(g.g2_debiased),
                "b2_debiased": _json_number(g.b2_debiased),
                "noise_share": _json_number(g.noise_share),
                "mean_gradient_norm": g.mean_gradient_norm,
                "per_client": {str(c): v for c, v in g.per_client.items()},
                "cosine": np.round(g.cosine, 4).tolist(),
            },
            "feature_shift": _str_keys(self.feature),
            "label_consistency": _str_keys(self.consistency) if self.consistency else None,
            "advice": self.advice.to_dict(),
        }


def _json_number(value: float | None) -> float | None:
    """JSON has no infinity or NaN: those (an undefined B², noise share) become null."""
    return value if value is not None and np.isfinite(value) else None


def _str_keys(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _str_keys(v) for k, v in node.items()}
    return node


def _sample(client: ClientData, limit: int, seed: int) -> list[Any]:
    if len(client.train) <= limit:
        return client.train
    keep = np.sort(
        np.random.default_rng([seed, client.client_id]).choice(
            len(client.train), limit, replace=False
        )
    )
    return [client.train[i] for i in keep]


def diagnose(
    exp: Experiment, batches: int = 8, examples_per_client: int = 128, neighbours: int = 5
) -> Diagnosis:
    """Measure ``exp``'s federation at its initial adapter: ``batches`` of
    ``diagnostics.batch_size`` examples per client for the gradients (client groups only
    stand out of the minibatch noise with several batches: on MRPC with 3 of 10 clients'
    labels swapped, 2 batches of 16 missed them, 8 found exactly them),
    ``examples_per_client`` for the embedding probes."""
    cfg = exp.cfg
    clients = [c for c in exp.clients if c.train]
    if len(clients) < 2:
        raise ValueError("diagnose needs at least two clients with training data")
    params = exp.model.get_params()
    estimates = {
        c.client_id: client_gradient_estimate(
            exp.model, params, c.train, batches, cfg.diagnostics.batch_size, cfg.seed + c.client_id
        )
        for c in clients
    }
    dis = gradient_dissimilarity(
        {cid: e.mean for cid, e in estimates.items()},
        {c.client_id: float(len(c.train)) for c in clients},
        {cid: e.noise for cid, e in estimates.items()},
    )
    samples = {c.client_id: _sample(c, examples_per_client, cfg.seed) for c in clients}
    embeddings = {
        cid: exp.model.embed(feats, cfg.eval.batch_size) for cid, feats in samples.items()
    }
    consistency = None
    if not exp.task.is_regression and all(len(f) >= 2 for f in samples.values()):
        labels = {cid: [int(f["label"]) for f in feats] for cid, feats in samples.items()}
        consistency = label_consistency(embeddings, labels, k=neighbours)
    feature = feature_shift(embeddings)
    stats = exp.partition_stats()
    measures = Measures.from_stats(stats, gradient=dis, feature=feature, consistency=consistency)
    return Diagnosis(stats, dis, feature, consistency, advise(measures))

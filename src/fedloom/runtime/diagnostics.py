"""Per-round heterogeneity measurements of a running simulation (``scope: diagnostics``).

Every round: client drift ‖w_k − w‖ of each trained client from the adapter it received,
and per local step (‖w_k − w‖ / τ_k with τ_k its local steps).
Every ``diagnostics.every`` rounds, before training: the gradient dissimilarity
G² = Σ_k p_k ‖∇F_k(w) − ∇F(w)‖² at the global adapter over all clients (p_k their shares
of the training examples), with B² and the clients' gradient norms, raw and with the
minibatch noise of the gradient estimates removed. And every round the clients' label
divergence to the global mix (Jensen–Shannon, bits), which moves when clients drift
(``partition.temporal``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fedloom.diagnostics import client_gradient_estimate, drift_summary, gradient_dissimilarity
from fedloom.experiment import ClientData, Experiment
from fedloom.params import Params


def _finite_or_none(value: float | None) -> float | None:
    """JSON has no infinity or NaN: B² is undefined (None) when the mean gradient vanishes,
    and a noise share when G² is 0."""
    return value if value is not None and math.isfinite(value) else None


def gradient_measures(
    exp: Experiment, params: Params, parties: Sequence[ClientData], seed: int
) -> dict[str, Any]:
    """G², B² (raw and without minibatch noise, with the noise share of G²) and per-client
    gradient distances at ``params`` over ``parties``; the debiased values are None with
    ``diagnostics.batches`` = 1 (the noise needs two batches per client)."""
    diag = exp.cfg.diagnostics
    with_data = [p for p in parties if p.train]
    estimates = {
        p.client_id: client_gradient_estimate(
            exp.model, params, p.train, diag.batches, diag.batch_size, seed + p.client_id
        )
        for p in with_data
    }
    weights = {p.client_id: float(len(p.train)) for p in with_data}
    dis = gradient_dissimilarity(
        {c: e.mean for c, e in estimates.items()},
        weights,
        {c: e.noise for c, e in estimates.items()},
    )
    return {
        "g2": dis.g2,
        "b2": _finite_or_none(dis.b2),
        "g2_debiased": _finite_or_none(dis.g2_debiased),
        "b2_debiased": _finite_or_none(dis.b2_debiased),
        "noise_share": _finite_or_none(dis.noise_share),
        "mean_gradient_norm": dis.mean_gradient_norm,
        "per_client": {str(c): v for c, v in dis.per_client.items()},
    }


def gradient_due(exp: Experiment, round_: int) -> bool:
    """Whether G² is measured before training ``round_`` (1-based)."""
    every = exp.cfg.diagnostics.every
    return (
        every > 0
        and (round_ - 1) % every == 0
        and exp.algorithm.has_global
        and not exp.algorithm.pools_data
    )


def diagnostics_row(
    exp: Experiment,
    round_: int,
    drifts: Mapping[int, float],
    steps: Mapping[int, float],
    gradients: dict[str, Any] | None,
) -> dict[str, Any]:
    row: dict[str, Any] = {"round": round_, "scope": "diagnostics"}
    if drifts:  # empty when the method sends nothing to the server (local training)
        row["drift"] = drift_summary(drifts)
    per_step = {c: d / steps[c] for c, d in drifts.items() if steps.get(c)}
    if per_step:
        # at a fixed number of local epochs a client's step count grows with its size, and
        # drift with the step count: per step, drift compares clients of unequal sizes
        row["drift_per_step"] = drift_summary(per_step)
    if gradients is not None:
        row["gradient"] = gradients
    if exp.data.on_nodes:  # the server does not know the clients' label mixes
        return row
    stats = exp.partition_stats(round_)
    row["label_js"] = {
        "mean": stats["mean_js_to_global"],
        "per_client": {str(c["client_id"]): c["js_to_global"] for c in stats["clients"]},
    }
    return row

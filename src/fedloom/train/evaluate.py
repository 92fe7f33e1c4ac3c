"""Scoring an adapter on a set of examples with the task's metrics."""

from __future__ import annotations

from collections.abc import Sequence

from fedloom.data import compute_metrics
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature
from fedloom.params import Params


def evaluate(
    model: FedModel, params: Params, features: Sequence[Feature], batch_size: int
) -> dict[str, float]:
    """The task's metrics plus ``loss`` and ``n`` for ``params`` on ``features``."""
    model.set_params(params)
    preds, labels, loss = model.predict(features, batch_size)
    metrics = compute_metrics(model.task, preds, labels)
    return {**metrics, "loss": loss, "n": len(features)}

"""Scoring an adapter on a set of examples with the task's metrics.

An example may carry a ``"weight"`` (the dev-weighted client scores of
:mod:`fedloom.evaluation.dev_weighted`): metrics and loss are then weighted estimates."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedloom.data import compute_metrics
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature
from fedloom.params import Params


def example_weights(features: Sequence[Feature]) -> np.ndarray | None:
    """The examples' ``"weight"`` entries; None when they carry none (all weigh the same)."""
    if not features or "weight" not in features[0]:
        return None
    return np.array([f["weight"] for f in features], dtype=np.float64)


def scores(
    model: FedModel,
    predictions: np.ndarray,
    labels: np.ndarray,
    losses: np.ndarray,
    features: Sequence[Feature],
) -> dict[str, float | None]:
    """The task's metrics, ``loss`` and ``n`` of per-example predictions and losses,
    weighted by the examples' weights where they carry them."""
    weights = example_weights(features)
    metrics = compute_metrics(model.task, predictions, labels, weights)
    return {**metrics, "loss": float(np.average(losses, weights=weights)), "n": len(features)}


def evaluate(
    model: FedModel, params: Params, features: Sequence[Feature], batch_size: int
) -> dict[str, float | None]:
    """The task's metrics plus ``loss`` and ``n`` for ``params`` on ``features``."""
    model.set_params(params)
    return scores(model, *model.predict_each(features, batch_size), features)

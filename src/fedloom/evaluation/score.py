"""Scoring an adapter on a set of examples with the task's metrics.

An example may carry a ``"weight"`` (the dev-weighted client scores of
:mod:`fedloom.evaluation.dev_weighted`): metrics and loss are then weighted estimates.

A generative task (:func:`generative_scores`): ``loss`` is the reference responses' mean
token negative log-likelihood under teacher forcing (Σ NLL / Σ tokens over the examples),
``nll`` the same number and ``perplexity`` its exponential, when the task's metrics name
them; the other metrics score answers generated with the adapter in place
(:meth:`FedModel.generate`, :mod:`fedloom.evaluation.generation_metrics`), generated
only when some metric needs them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedloom.data import compute_metrics
from fedloom.data.tasks import TEACHER_FORCED
from fedloom.evaluation.generation_metrics import generation_scores
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
    if model.task.generative:
        return generative_scores(model, features, batch_size)
    return scores(model, *model.predict_each(features, batch_size), features)


def generative_scores(
    model: FedModel, features: Sequence[Feature], batch_size: int
) -> dict[str, float | None]:
    """A generative task's metrics, ``loss`` and ``n`` for the adapter in place (module
    docstring)."""
    mean = model.mean_loss(features, batch_size)
    teacher = {"nll": mean, "perplexity": float(np.exp(mean))}
    out: dict[str, float | None] = {m: teacher[m] for m in model.task.metrics if m in teacher}
    generated = [m for m in model.task.metrics if m not in TEACHER_FORCED]
    if generated:
        answers = model.generate(features, batch_size)
        references = [f["label"] for f in features]
        out.update(generation_scores(generated, answers, references))
    ordered = {m: out[m] for m in model.task.metrics}
    return {**ordered, "loss": mean, "n": len(features)}

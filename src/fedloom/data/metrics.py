"""Evaluation metrics of the GLUE and custom tasks and summary statistics over clients.

``f1`` is the binary F1 of class 1 (MRPC, QQP); ``macro_f1`` averages the F1 of every class
(custom classification tasks, any number of classes); ``balanced_accuracy`` averages the
recall of every class present in the labels (scikit-learn's ``balanced_accuracy_score``):
a constant prediction scores 1 / (number of classes present), however skewed the labels,
which makes it the score to read beside accuracy on a label-skewed client.

A metric the examples cannot define is ``None`` (null in JSON), never a number: F1 of
class 1 when no label is class 1 (recall is 0/0), Matthews' correlation and the Pearson /
Spearman correlations when the labels are constant. A constant *prediction* against
varying labels is a defined "no correlation", 0.0 (the convention of scikit-learn's
``matthews_corrcoef``), so a degenerate model scores without warnings.

Optional per-example ``weights`` make every classification metric a weighted estimate
(scikit-learn's ``sample_weight``): the dev-weighted client scores reweight the task's dev
set to one client's label mix (:mod:`fedloom.evaluation.dev_weighted`).

scikit-learn and scipy.stats are imported at the first score, not with fedloom: together
they took about a second of every run's start-up, also of runs that never score.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np

from .tasks import TaskSpec

Weights = np.ndarray | None
MetricFn = Callable[[np.ndarray, np.ndarray, Weights], float | None]


def _accuracy(predictions: np.ndarray, labels: np.ndarray, weights: Weights) -> float:
    from sklearn.metrics import accuracy_score

    return float(accuracy_score(labels, predictions, sample_weight=weights))


def _f1(predictions: np.ndarray, labels: np.ndarray, weights: Weights) -> float | None:
    positive = labels == 1 if weights is None else (labels == 1) & (weights > 0)
    if not positive.any():
        return None
    from sklearn.metrics import f1_score

    return float(
        f1_score(
            labels,
            predictions,
            pos_label=1,
            average="binary",
            sample_weight=weights,
            zero_division=0.0,
        )
    )


def _macro_f1(predictions: np.ndarray, labels: np.ndarray, weights: Weights) -> float:
    """Unweighted mean of the per-class F1 over the classes present in labels or predictions."""
    from sklearn.metrics import f1_score

    return float(
        f1_score(labels, predictions, average="macro", sample_weight=weights, zero_division=0.0)
    )


def _balanced_accuracy(predictions: np.ndarray, labels: np.ndarray, weights: Weights) -> float:
    """The mean over the classes present in ``labels`` (of positive weight) of their recall."""
    if weights is not None:
        predictions, labels, weights = (a[weights > 0] for a in (predictions, labels, weights))
    from sklearn.metrics import balanced_accuracy_score

    with warnings.catch_warnings():  # a class predicted but absent from labels: no recall
        warnings.simplefilter("ignore", UserWarning)
        return float(balanced_accuracy_score(labels, predictions, sample_weight=weights))


def _is_constant(values: np.ndarray) -> bool:
    return bool(np.all(values == values[0]))


def _matthews(predictions: np.ndarray, labels: np.ndarray, weights: Weights) -> float | None:
    if weights is not None:
        predictions, labels, weights = (a[weights > 0] for a in (predictions, labels, weights))
    if _is_constant(labels):
        return None
    if _is_constant(predictions):
        return 0.0
    from sklearn.metrics import matthews_corrcoef

    return float(matthews_corrcoef(labels, predictions, sample_weight=weights))


def _correlation(name: str) -> MetricFn:
    """scipy.stats' correlation ``name`` (its statistic) as a metric."""

    def metric(predictions: np.ndarray, labels: np.ndarray, weights: Weights) -> float | None:
        if weights is not None:
            raise ValueError("correlations are not defined with example weights")
        if len(labels) < 2 or _is_constant(labels):
            return None
        if _is_constant(predictions):
            return 0.0
        import scipy.stats

        value = float(getattr(scipy.stats, name)(predictions, labels)[0])
        return None if np.isnan(value) else value

    return metric


METRICS: dict[str, MetricFn] = {
    "accuracy": _accuracy,
    "f1": _f1,
    "macro_f1": _macro_f1,
    "balanced_accuracy": _balanced_accuracy,
    "matthews": _matthews,
    "pearson": _correlation("pearsonr"),
    "spearman": _correlation("spearmanr"),
}


def compute_metrics(
    task: TaskSpec, predictions: np.ndarray, labels: np.ndarray, weights: Weights = None
) -> dict[str, float | None]:
    """Score 1-D predictions against labels with every metric of ``task`` (None where the
    examples leave a metric undefined; optional non-negative example ``weights``).

    Classification predictions and labels are class ids; regression ones are scores.
    """
    predictions = np.asarray(predictions)
    labels = np.asarray(labels)
    if predictions.ndim != 1 or predictions.shape != labels.shape:
        raise ValueError(
            f"predictions {predictions.shape} and labels {labels.shape} must be 1-D of equal length"
        )
    if len(labels) == 0:
        raise ValueError("cannot compute metrics on zero examples")
    if weights is not None:
        weights = np.asarray(weights, dtype=np.float64)
        if weights.shape != labels.shape or np.any(weights < 0) or weights.sum() <= 0:
            raise ValueError("weights must be non-negative, one per example, not all zero")
    if task.is_regression:
        predictions = predictions.astype(np.float64)
        labels = labels.astype(np.float64)
    else:
        predictions = _class_ids(predictions, "predictions")
        labels = _class_ids(labels, "labels")
    return {name: METRICS[name](predictions, labels, weights) for name in task.metrics}


def _class_ids(values: np.ndarray, what: str) -> np.ndarray:
    if not np.all(np.mod(values, 1) == 0):
        raise ValueError(f"{what} must be integer class ids for a classification task")
    return values.astype(np.int64)


def summarize(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Mean, min, max and 10th percentile (numpy's ``linear`` method: over 10 clients about
    the second-worst) of the per-client scores that are defined, and ``n``, how many
    clients that is; undefined scores (None) are left out, and with none defined every
    statistic is None."""
    if len(values) == 0:
        raise ValueError("cannot summarize an empty sequence")
    array = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if array.size == 0:
        return {"mean": None, "min": None, "max": None, "p10": None, "n": 0}
    return {
        "mean": float(array.mean()),
        "min": float(array.min()),
        "max": float(array.max()),
        "p10": float(np.percentile(array, 10, method="linear")),
        "n": int(array.size),
    }

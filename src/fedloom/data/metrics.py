"""Evaluation metrics of the GLUE and custom tasks and summary statistics over clients.

``f1`` is the binary F1 of class 1 (MRPC, QQP); ``macro_f1`` averages the F1 of every class
(custom classification tasks, any number of classes).

Undefined correlations (a constant prediction or label vector) count as 0.0 rather than
NaN, so that a degenerate client model scores "no correlation" without warnings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from .tasks import TaskSpec

MetricFn = Callable[[np.ndarray, np.ndarray], float]


def _accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    return float(accuracy_score(labels, predictions))


def _f1(predictions: np.ndarray, labels: np.ndarray) -> float:
    return float(f1_score(labels, predictions, pos_label=1, average="binary", zero_division=0.0))


def _macro_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Unweighted mean of the per-class F1 over the classes present in labels or predictions."""
    return float(f1_score(labels, predictions, average="macro", zero_division=0.0))


def _is_constant(values: np.ndarray) -> bool:
    return bool(np.all(values == values[0]))


def _matthews(predictions: np.ndarray, labels: np.ndarray) -> float:
    if _is_constant(predictions) or _is_constant(labels):
        return 0.0
    return float(matthews_corrcoef(labels, predictions))


def _correlation(statistic: Callable) -> MetricFn:
    def metric(predictions: np.ndarray, labels: np.ndarray) -> float:
        if len(labels) < 2 or _is_constant(predictions) or _is_constant(labels):
            return 0.0
        value = float(statistic(predictions, labels)[0])
        return 0.0 if np.isnan(value) else value

    return metric


METRICS: dict[str, MetricFn] = {
    "accuracy": _accuracy,
    "f1": _f1,
    "macro_f1": _macro_f1,
    "matthews": _matthews,
    "pearson": _correlation(pearsonr),
    "spearman": _correlation(spearmanr),
}


def compute_metrics(
    task: TaskSpec, predictions: np.ndarray, labels: np.ndarray
) -> dict[str, float]:
    """Score 1-D predictions against labels with every metric of ``task``.

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
    if task.is_regression:
        predictions = predictions.astype(np.float64)
        labels = labels.astype(np.float64)
    else:
        predictions = _class_ids(predictions, "predictions")
        labels = _class_ids(labels, "labels")
    return {name: METRICS[name](predictions, labels) for name in task.metrics}


def _class_ids(values: np.ndarray, what: str) -> np.ndarray:
    if not np.all(np.mod(values, 1) == 0):
        raise ValueError(f"{what} must be integer class ids for a classification task")
    return values.astype(np.int64)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean, min, max and 10th percentile (linear interpolation) of per-client scores."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        raise ValueError("cannot summarize an empty sequence")
    return {
        "mean": float(array.mean()),
        "min": float(array.min()),
        "max": float(array.max()),
        "p10": float(np.percentile(array, 10, method="linear")),
    }

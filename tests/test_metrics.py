"""Task metrics against hand-computed values, and the per-client summary."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fedloom.data import TASKS, compute_metrics, custom_task, summarize
from fedloom.data.metrics import METRICS
from fedloom.data.tasks import CLASSIFICATION_METRICS, REGRESSION_METRICS


def test_every_declared_metric_is_implemented() -> None:
    assert METRICS.keys() == CLASSIFICATION_METRICS | REGRESSION_METRICS


def test_accuracy_and_f1() -> None:
    # TP=2 (0, 3), FP=1 (2), TN=1 (1), FN=0: precision 2/3, recall 1, F1 = 0.8.
    scores = compute_metrics(TASKS["MRPC"], np.array([1, 0, 1, 1]), np.array([1, 0, 0, 1]))
    assert scores == {"accuracy": pytest.approx(0.75), "f1": pytest.approx(0.8)}
    assert all(type(v) is float for v in scores.values())


def test_f1_positive_class_is_one() -> None:
    # Class 0 is predicted perfectly but never the positive class: F1 on class 1 is 0.
    scores = compute_metrics(TASKS["MRPC"], np.array([0, 0, 0, 0]), np.array([0, 0, 1, 0]))
    assert scores["f1"] == 0.0 and scores["accuracy"] == 0.75


def test_matthews() -> None:
    # TP=2, FP=1, TN=1, FN=1: (2*1 - 1*1) / sqrt(3*3*2*2) = 1/6.
    scores = compute_metrics(TASKS["CoLA"], np.array([1, 1, 0, 0, 1]), np.array([1, 0, 0, 1, 1]))
    assert scores == {"matthews": pytest.approx(1 / 6)}


def test_pearson_and_spearman() -> None:
    # Pearson of (1,2,3) and (1,2,4): cov 3 / sqrt(2 * 42/9) = 9 / sqrt(84).
    scores = compute_metrics(TASKS["STS-B"], np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 4.0]))
    assert scores == {"pearson": pytest.approx(9 / math.sqrt(84)), "spearman": pytest.approx(1.0)}
    # Rank differences (0, 1, 1, 0): 1 - 6*2 / (4*15) = 0.8.
    scores = compute_metrics(TASKS["STS-B"], np.array([1, 2, 3, 4]), np.array([1.0, 3.0, 2.0, 4.0]))
    assert scores["spearman"] == pytest.approx(0.8)


def test_constant_predictions_score_zero_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = np.array([0.0, 1.0, 4.0, 5.0])
        regression = compute_metrics(TASKS["STS-B"], np.full(4, 2.5), scores)
        matthews = compute_metrics(TASKS["CoLA"], np.ones(4, dtype=int), np.array([0, 1, 1, 0]))
        mrpc = compute_metrics(TASKS["MRPC"], np.zeros(3, dtype=int), np.array([1, 1, 0]))
    assert regression == {"pearson": 0.0, "spearman": 0.0}
    assert matthews == {"matthews": 0.0}
    assert mrpc == {"accuracy": pytest.approx(1 / 3), "f1": 0.0}


def test_metrics_the_labels_cannot_define_are_none_not_zero() -> None:
    """F1 of class 1 with no class-1 label is 0/0 recall; a correlation with constant labels
    is 0/0: undefined, even when every prediction is right (it used to read 0.0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mrpc = compute_metrics(TASKS["MRPC"], np.zeros(4, dtype=int), np.zeros(4, dtype=int))
        cola = compute_metrics(TASKS["CoLA"], np.array([0, 1, 0]), np.ones(3, dtype=int))
        stsb = compute_metrics(TASKS["STS-B"], np.array([1.0, 2.0, 3.0]), np.full(3, 2.0))
    assert mrpc == {"accuracy": 1.0, "f1": None}
    assert cola == {"matthews": None}
    assert stsb == {"pearson": None, "spearman": None}


def test_weighted_metrics_are_the_class_mix_average() -> None:
    """With weights p(c)/n(c), accuracy is Σ_c p(c)·acc_c (hand computed) and F1 counts a
    class-1 example as weight, not as one."""
    labels = np.array([0, 0, 0, 0, 1, 1])
    preds = np.array([0, 0, 0, 1, 1, 0])  # acc_0 = 3/4, acc_1 = 1/2
    weights = np.array([0.2 / 4] * 4 + [0.8 / 2] * 2)
    scores = compute_metrics(TASKS["MRPC"], preds, labels, weights)
    assert scores["accuracy"] == pytest.approx(0.2 * 0.75 + 0.8 * 0.5)
    # tp = 0.4, fp = 0.05, fn = 0.4: F1 = 2tp / (2tp + fp + fn)
    assert scores["f1"] == pytest.approx(0.8 / (0.8 + 0.05 + 0.4))
    zero_positive = compute_metrics(TASKS["MRPC"], preds, labels, np.array([1.0] * 4 + [0, 0]))
    assert zero_positive == {"accuracy": 0.75, "f1": None}
    with pytest.raises(ValueError, match="weights"):
        compute_metrics(TASKS["MRPC"], preds, labels, -weights)


def test_keys_follow_task_metrics() -> None:
    spec = custom_task("topic", ["a", "b", "c"], metrics=["matthews", "accuracy"])
    scores = compute_metrics(spec, np.array([0, 1, 2, 2]), np.array([0, 1, 2, 1]))
    assert list(scores) == ["matthews", "accuracy"]
    assert scores["accuracy"] == pytest.approx(0.75)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="1-D of equal length"):
        compute_metrics(TASKS["RTE"], np.array([0, 1]), np.array([0, 1, 1]))
    with pytest.raises(ValueError, match="zero examples"):
        compute_metrics(TASKS["RTE"], np.array([]), np.array([]))
    with pytest.raises(ValueError, match="integer class ids"):
        compute_metrics(TASKS["RTE"], np.array([0.5, 1.0]), np.array([0, 1]))


def test_summarize() -> None:
    # p10 of (1, 2, 3, 4, 10): position 0.1 * 4 = 0.4 -> 1 + 0.4 * (2 - 1) = 1.4.
    assert summarize([10.0, 2.0, 1.0, 4.0, 3.0]) == pytest.approx(
        {"mean": 4.0, "min": 1.0, "max": 10.0, "p10": 1.4, "n": 5}
    )
    assert summarize([0.5]) == {"mean": 0.5, "min": 0.5, "max": 0.5, "p10": 0.5, "n": 1}
    with pytest.raises(ValueError, match="empty"):
        summarize([])


def test_summarize_leaves_undefined_scores_out_and_counts_the_rest() -> None:
    assert summarize([0.8, None, 0.6]) == pytest.approx(
        {"mean": 0.7, "min": 0.6, "max": 0.8, "p10": 0.62, "n": 2})
    assert summarize([None, None]) == {"mean": None, "min": None, "max": None, "p10": None,
                                       "n": 0}

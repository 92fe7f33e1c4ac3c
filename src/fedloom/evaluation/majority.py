"""The majority-label baseline: client k predicts the most frequent label of its own
training data (the lowest class id on a tie) for every example, and is scored on the same
splits as the run's adapters (its test split, or the dev set weighted to its label mix).

No loss is reported: a constant prediction has no probabilities to score.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedloom.data import TaskSpec, compute_metrics
from fedloom.evaluation.score import example_weights
from fedloom.models.heads import Feature

Scores = dict[str, float | None]


def majority_label(train: Sequence[Feature], num_labels: int) -> int:
    """The most frequent label of ``train`` (the lowest class id among the tied)."""
    counts = np.bincount([int(f["label"]) for f in train], minlength=num_labels)
    return int(np.argmax(counts))


def majority_scores(task: TaskSpec, label: int, features: Sequence[Feature]) -> Scores:
    """The task's metrics and ``n`` of predicting ``label`` for every example of
    ``features`` (weighted by the examples' weights where they carry them)."""
    labels = np.array([int(f["label"]) for f in features], dtype=np.int64)
    predictions = np.full_like(labels, label)
    metrics = compute_metrics(task, predictions, labels, example_weights(features))
    return {**metrics, "n": len(features)}


def score_majority(
    task: TaskSpec,
    clients: Mapping[int, tuple[Sequence[Feature], Mapping[str, Sequence[Feature]]]],
) -> dict[str, dict[int, Scores]]:
    """Per scope, per client: the scores of the client's majority label on its scored
    splits (``clients``: client id -> (its training features, its splits by scope));
    an empty split or a client without training data is skipped."""
    per_scope: dict[str, dict[int, Scores]] = {}
    for cid, (train, splits) in clients.items():
        if not train:
            continue
        label = majority_label(train, task.num_labels)
        for scope, features in splits.items():
            if features:
                per_scope.setdefault(scope, {})[cid] = majority_scores(task, label, features)
    return per_scope

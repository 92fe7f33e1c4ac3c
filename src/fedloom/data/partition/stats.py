"""How non-IID a partition is: per-client label counts and a JSON-able summary.

Labels are counted as each client *sees* them: its concept-shift ``label_map`` applied and,
under drift, its mixture at the given round. Regression scores are counted in their
``REGRESSION_BINS`` quantile bins, so ``num_labels`` (and ``len(label_names)``) must then be
``REGRESSION_BINS`` (name them with :func:`~.pool.regression_bin_names`). Label skew is
measured as the Jensen–Shannon divergence (base 2, in bits, between 0 and 1) of a client's
label distribution to the size-weighted global mix (Lin, 1991, "Divergence measures based on
the Shannon entropy").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.spatial.distance import jensenshannon

from ...config import PartitionConfig
from .pool import REGRESSION_BINS, PartitionPool
from .split import ClientSplit

_SKEWS = ("quantity", "concept", "tasks", "temporal")


def label_histogram(
    labels: np.ndarray, splits: Sequence[ClientSplit], num_labels: int
) -> np.ndarray:
    """Clients x labels matrix counting each client's training examples per (raw) class."""
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError("label_histogram needs integer class ids")
    _check_range(labels, num_labels)
    counts = np.zeros((len(splits), num_labels), dtype=np.int64)
    for row, split in enumerate(splits):
        counts[row] = np.bincount(labels[split.train], minlength=num_labels)
    return counts


def _check_range(classes: np.ndarray, num_labels: int) -> None:
    if classes.size and not 0 <= classes.min() <= classes.max() < num_labels:
        raise ValueError(f"class ids must lie in 0..{num_labels - 1}")


def client_label_counts(
    pool: PartitionPool, splits: Sequence[ClientSplit], num_labels: int, round_: int = 0
) -> np.ndarray:
    """Clients x labels counts of the training examples at ``round_``, labels as seen."""
    if pool.is_regression and num_labels != REGRESSION_BINS:
        raise ValueError(
            f"regression scores are counted in REGRESSION_BINS={REGRESSION_BINS} quantile "
            f"bins; pass num_labels={REGRESSION_BINS}, got {num_labels}"
        )
    classes = pool.classes
    _check_range(classes, num_labels)
    counts = np.zeros((len(splits), num_labels), dtype=np.int64)
    for row, split in enumerate(splits):
        seen = classes[split.train_at(round_)]
        if split.label_map is not None:
            seen = split.label_map[seen]
        counts[row] = np.bincount(seen, minlength=num_labels)
    return counts


def js_to_global(counts: np.ndarray) -> np.ndarray:
    """Per row: JS divergence (bits) of its distribution to the pooled distribution."""
    pooled = counts.sum(axis=0) / counts.sum()
    divergences = np.array([jensenshannon(row / row.sum(), pooled, base=2) ** 2 for row in counts])
    # Rounding can push a zero divergence a hair below zero, where the square root is NaN.
    return np.nan_to_num(divergences)


def partition_stats(
    pool: PartitionPool,
    splits: Sequence[ClientSplit],
    label_names: Sequence[str],
    round_: int = 0,
    *,
    cfg: PartitionConfig | None = None,
) -> dict[str, Any]:
    """A JSON-able summary of the partition at ``round_``.

    Per client: sizes, label counts as seen, ``js_to_global``, task counts (multi-task
    pools), feature-value counts (scheme feature), label map and drift window. Federation:
    size statistics and mean/max divergence. ``cfg`` adds the scheme and the skews it
    applies; without it the skews are read off the splits (concept, temporal).
    """
    counts = client_label_counts(pool, splits, len(label_names), round_)
    divergences = js_to_global(counts)
    trains = [split.train_at(round_) for split in splits]
    sizes = np.array([len(t) + len(s.test_at(round_)) for t, s in zip(trains, splits)])
    clients = []
    for split, train, row, divergence in zip(splits, trains, counts, divergences):
        entry: dict[str, Any] = {
            "client_id": split.client_id,
            "train": len(train),
            "test": len(split.test_at(round_)),
            "label_counts": row.tolist(),
            "js_to_global": float(divergence),
            "label_map": None if split.label_map is None else split.label_map.tolist(),
            "drift": None
            if split.drift is None
            else {"start_round": split.drift.start_round, "end_round": split.drift.end_round},
        }
        if "task" in pool.columns:
            names = np.unique(pool.columns["task"]).tolist()
            entry["task_counts"] = _value_counts(pool.columns["task"][train], names)
        if cfg is not None and cfg.scheme == "feature":
            values = pool.lengths if cfg.feature == "length" else pool.column(cfg.feature or "")
            entry["feature_counts"] = _value_counts(values[train])
        clients.append(entry)
    if cfg is not None:
        skews = [name for name in _SKEWS if getattr(cfg, name) is not None]
    else:
        skews = [
            name
            for name, present in (
                ("concept", any(s.label_map is not None for s in splits)),
                ("temporal", any(s.drift is not None for s in splits)),
            )
            if present
        ]
    return {
        "num_clients": len(splits),
        "scheme": None if cfg is None else cfg.scheme,
        "skews": skews,
        "round": round_,
        "label_names": list(label_names),
        "sizes": {
            "mean": float(sizes.mean()),
            "min": int(sizes.min()),
            "max": int(sizes.max()),
            "cv": float(sizes.std() / sizes.mean()),
        },
        "mean_js_to_global": float(divergences.mean()),
        "max_js_to_global": float(divergences.max()),
        "clients": clients,
    }


def _value_counts(values: np.ndarray, keys: Sequence[str] | None = None) -> dict[str, int]:
    """Counts per value (as str), over ``keys`` when given, else over the values present."""
    present, counts = np.unique(values, return_counts=True)
    found = {str(value): int(count) for value, count in zip(present, counts)}
    return found if keys is None else {key: found.get(key, 0) for key in keys}

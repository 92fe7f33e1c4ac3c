"""Dev-weighted client scores: a client's accuracy on its own distribution, estimated on
the task's whole dev set.

A client's test split of 16-40 examples moves its score by several points per example.
When clients differ in their label mix (label skew, quantity skew, task heterogeneity,
concept shift by a label map), the client's distribution is P_k(x, y) = p_k(y) P(x | y')
with its label proportions p_k and, for a concept-shifted client, its relabelling
y' = π_k(y). The task's dev set, relabelled by π_k and reweighted per example by

    w_i = p_k(y'_i) / n_dev(y'_i)          (n_dev(c): dev examples labelled c after π_k)

is then an unbiased estimate of any metric on P_k: weighted accuracy is
Σ_c p_k(c) · acc_c, the class accuracies averaged with the client's own proportions (the
importance weighting of label shift, e.g. Lipton et al., 2018, "Detecting and correcting
for label shift with black box predictors"), on hundreds of examples instead of tens.
p_k is taken from the client's training labels.

It describes a client only where its label mix is what sets it apart: under feature skew
or temporal drift P(x | y) differs between clients, and their own test splits remain the
measure (``eval.client_mode = "split"``; the rule is
:func:`fedloom.client_mode.why_not_dev_weighted`). A class the client holds but the dev
set lacks (a small ``data.max_dev_examples``) cannot be scored; the remaining classes'
weights are renormalized and :func:`dev_weighted` reports how much weight was lost.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedloom.models.heads import Feature


def label_proportions(labels: Sequence[int], num_labels: int) -> np.ndarray:
    """p_k(c): the share of each class among ``labels``."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_labels)
    return counts / max(counts.sum(), 1)


def dev_weighted(
    dev: Sequence[Feature], proportions: np.ndarray, label_map: np.ndarray | None = None
) -> tuple[list[Feature], float]:
    """The dev examples of the classes the client holds, relabelled by ``label_map`` and
    each with its ``"weight"`` w_i (summing to 1) and its ``"dev_index"`` (its position in
    ``dev``), and the share of the client's label mass whose class has no dev example (0.0
    when every held class is scored)."""
    labels = np.array([int(f["label"]) for f in dev], dtype=np.int64)
    if label_map is not None:
        labels = np.asarray(label_map, dtype=np.int64)[labels]
    counts = np.bincount(labels, minlength=len(proportions))
    held = proportions > 0
    scored = held & (counts > 0)
    lost = float(proportions[held & ~scored].sum())
    if not scored.any():
        return [], lost
    per_class = np.where(scored, proportions / np.maximum(counts, 1), 0.0)
    per_class /= float((per_class * counts).sum())
    return [
        {**feature, "label": int(y), "weight": float(per_class[y]), "dev_index": i}
        for i, (feature, y) in enumerate(zip(dev, labels))
        if per_class[y] > 0
    ], lost

"""Concept shift P(Y|X): some clients label the same inputs differently.

A seeded choice of ``round(fraction · K)`` clients (rounded half up, at least one), or
exactly the ``clients`` named (then nothing is drawn to choose them), get a ``label_map``;
such a client sees class ``y`` as ``label_map[y]``, for ``y`` in ``0..L-1`` with ``L`` =
the largest label in the pool + 1. ``permute``: a uniformly random derangement
(a permutation without fixed points, drawn by rejection), the label-flip concept shift of
Li et al. (2022) and the "same features, different labels" setting of Kairouz et al.
(2021, "Advances and Open Problems in Federated Learning", §3.1); ``swap``: only the two
``classes`` (default 0 and 1) are exchanged. In a multi-task pool (a ``task`` column)
labels are permuted within each task's own labels, so a client never sees another task's
label. Regression scores have no classes to remap.
"""

from __future__ import annotations

import numpy as np

from ...config import ConceptConfig
from .pool import PartitionPool


def num_chosen(fraction: float, num_clients: int) -> int:
    """``round(fraction · num_clients)``, rounded half up, at least 1."""
    return max(1, int(np.floor(fraction * num_clients + 0.5)))


def label_maps(
    pool: PartitionPool, num_clients: int, concept: ConceptConfig, rng: np.random.Generator
) -> list[np.ndarray | None]:
    """Per client: its label map, or None for the clients that keep the true labels."""
    if pool.is_regression:
        raise ValueError("concept shift needs class labels; this task is a regression")
    num_labels = int(pool.labels.max()) + 1
    groups = _label_groups(pool, num_labels)
    if concept.kind == "swap":
        a, b = concept.classes or (0, 1)
        if not (0 <= a < num_labels and 0 <= b < num_labels) or a == b:
            raise ValueError(
                f"concept.classes must be two different labels in 0..{num_labels - 1}, got {[a, b]}"
            )
    elif min(len(group) for group in groups) < 2:
        raise ValueError("concept kind 'permute' needs at least two labels (per task)")
    chosen = _chosen(num_clients, concept, rng)
    maps: list[np.ndarray | None] = []
    for client in range(num_clients):
        if client not in chosen:
            maps.append(None)
            continue
        mapping = np.arange(num_labels)
        if concept.kind == "swap":
            mapping[[a, b]] = [b, a]
        else:
            for group in groups:
                mapping[group] = group[_derangement(len(group), rng)]
        maps.append(mapping)
    return maps


def _chosen(num_clients: int, concept: ConceptConfig, rng: np.random.Generator) -> set[int]:
    """The clients that relabel: ``concept.clients``, else a seeded ``fraction`` of them."""
    if concept.clients is not None:
        outside = sorted(c for c in concept.clients if not 0 <= c < num_clients)
        if outside:
            raise ValueError(
                f"concept.clients: {outside} are not clients (ids 0..{num_clients - 1})"
            )
        return set(concept.clients)
    if concept.fraction is None:
        raise ValueError("concept: one of fraction or clients is required")
    drawn = rng.choice(num_clients, num_chosen(concept.fraction, num_clients), replace=False)
    return set(drawn.tolist())


def _label_groups(pool: PartitionPool, num_labels: int) -> list[np.ndarray]:
    """Labels that may be exchanged with each other: all ``0..num_labels-1``, or each task's
    own labels in a multi-task pool."""
    if "task" not in pool.columns:
        return [np.arange(num_labels)]
    tasks = pool.columns["task"]
    groups = [np.unique(pool.labels[tasks == task]) for task in np.unique(tasks)]
    if sum(len(g) for g in groups) != len(np.unique(pool.labels)):
        raise ValueError("concept shift on a multi-task pool needs disjoint per-task labels")
    return groups


def _derangement(n: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random permutation of ``range(n)`` without fixed points (n >= 2)."""
    while True:
        perm = rng.permutation(n)
        if not np.any(perm == np.arange(n)):
            return perm

"""How well a run's discovered clusters match the federation's true grouping.

The true group of a client is what the partition built into it: the task it holds most
of (``partition.tasks``) and the label map of a concept shift (``partition.concept``),
read from the run's ``partition.json`` (:func:`fedloom.data.partition_stats`). Agreement
is the adjusted Rand index (Hubert & Arabie 1985; scikit-learn's): 1 for the same
grouping up to renaming, about 0 for a random one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def true_groups(stats: Mapping[str, Any]) -> dict[int, str]:
    """Client → its true group, e.g. ``"SST-2"``, ``"labels [1, 0]"`` / ``"labels as given"``,
    ``"MRPC · labels [1, 0]"`` (one group, ``"all"``, for every client of a federation built
    without tasks or concept shift)."""
    shifted = any(c.get("label_map") is not None for c in stats["clients"])
    groups = {}
    for client in stats["clients"]:
        parts = []
        tasks = client.get("task_counts") or {}
        if tasks:
            parts.append(max(tasks, key=lambda t: tasks[t]))
        if client.get("label_map") is not None:
            parts.append(f"labels {client['label_map']}")
        elif shifted:
            parts.append("labels as given")
        groups[int(client["client_id"])] = " · ".join(parts) or "all"
    return groups


def adjusted_rand(
    assignment: Mapping[int, int] | Mapping[str, int], groups: Mapping[int, str]
) -> float | None:
    """The adjusted Rand index of ``assignment`` against ``groups`` over the clients both
    name; None when the truth has a single group (nothing to recover)."""
    from sklearn.metrics import adjusted_rand_score

    found = {int(c): j for c, j in assignment.items()}
    clients = sorted(found.keys() & groups.keys())
    if len({groups[c] for c in clients}) < 2:
        return None
    return float(adjusted_rand_score([groups[c] for c in clients], [found[c] for c in clients]))

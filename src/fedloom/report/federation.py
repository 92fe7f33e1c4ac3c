"""The federation itself: the partition's label heatmap (the run's partition.png, or drawn
again from partition.json) and how far the clients drifted apart while training."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedloom.report.figures import (
    COLORS,
    THIN,
    Plot,
    copy_into,
    figure,
    gaps,
    rounds_axis,
    save,
)

_PARTITION_CAPTION = "Training examples of each label on each client (partition.json)."


def partition_plot(run_dir: Path, partition: Mapping[str, Any] | None, folder: Path) -> list[Plot]:
    """The run's ``partition.png`` copied beside the report, or, when the run has none
    (clients' data on their own nodes), drawn from partition.json's label counts."""
    path = folder / "partition.png"
    if (run_dir / "partition.png").is_file():
        return [Plot(copy_into(run_dir / "partition.png", path), "Partition", _PARTITION_CAPTION)]
    clients = (partition or {}).get("clients") or []
    names = (partition or {}).get("label_names") or []
    counts = [c.get("label_counts") for c in clients]
    if (
        not names
        or not counts
        or any(not isinstance(c, list) or len(c) != len(names) for c in counts)
    ):
        return []
    from fedloom.data import plot_label_heatmap

    plot_label_heatmap(np.asarray(counts), names, path, title="training labels per client")
    return [Plot(path, "Partition", _PARTITION_CAPTION)]


def partition_rows(partition: Mapping[str, Any] | None) -> tuple[list[str], list[list[str]]]:
    """Header and a row per client: sizes, label histogram, JS divergence to the global
    label mix, and the label map of a concept shift."""
    clients = (partition or {}).get("clients") or []
    if not clients:
        return [], []
    header = ["client", "train", "test", "labels", "JS to global"]
    shifted = any(c.get("label_map") is not None for c in clients)
    header += ["label map"] if shifted else []
    rows = []
    for c in clients:
        js = c.get("js_to_global")
        row = [
            str(c.get("client_id", "")),
            str(c.get("train", "")),
            str(c.get("test", "")),
            " ".join(str(n) for n in c.get("label_counts") or []),
            f"{js:.3f}" if isinstance(js, int | float) else "",
        ]
        rows.append(row + ([str(c.get("label_map"))] if shifted else []))
    return header, rows


def plot_diagnostics(found: Mapping[str, Mapping[str, Any]], folder: Path) -> list[Plot]:
    """Client drift ‖w_k − w‖ after local training (each client thin, the mean bold) and,
    when measured, the gradient dissimilarity G² / B² (minibatch noise removed)."""
    drift, gradient = found.get("drift"), found.get("gradient")
    if drift is None and gradient is None:
        return []
    panels = [p for p in (drift, gradient) if p is not None]
    fig = figure(5.0 * len(panels), 3.4)
    k = 1
    if drift is not None:
        ax = fig.add_subplot(1, len(panels), k)
        k += 1
        for j, values in enumerate(drift["per_client"].values()):
            ax.plot(
                drift["rounds"],
                gaps(values),
                **THIN,
                label="a client" if j == 0 else None,
            )
        ax.plot(
            drift["rounds"],
            gaps(drift["mean"]),
            color=COLORS[3],
            linewidth=2.2,
            marker="o" if len(drift["rounds"]) <= 12 else None,
            label="mean",
        )
        ax.set_title("client drift ‖w_k − w‖", fontsize=10)
        ax.legend(fontsize=7)
        rounds_axis(ax)
    if gradient is not None:
        ax = fig.add_subplot(1, len(panels), k)
        for j, key in enumerate(("g2_debiased", "b2_debiased")):
            ax.plot(
                gradient["rounds"],
                gaps(gradient[key]),
                color=COLORS[j],
                marker="o",
                label=key.replace("_debiased", " (debiased)"),
            )
        ax.set_title("gradient dissimilarity", fontsize=10)
        ax.legend(fontsize=7)
        rounds_axis(ax)
    fig.tight_layout()
    return [
        Plot(
            save(fig, folder / "diagnostics.png"),
            "Heterogeneity diagnostics",
            "How far each client's update moved from the round's payload, and how much the "
            "clients' gradients disagree (metrics.jsonl's diagnostics rows).",
        )
    ]

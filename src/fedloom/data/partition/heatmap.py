"""A clients x labels heatmap of label counts, written as a PNG."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

#: cells up to which each count is written into its cell
_ANNOTATE_CELLS = 400


def plot_label_heatmap(
    counts: np.ndarray, label_names: Sequence[str], path: Path, title: str = ""
) -> Path:
    """Draw ``counts`` (clients x labels) as a heatmap with a colorbar, numbers in the cells
    when there are at most 400 of them, and write it to ``path`` atomically (a temporary file
    renamed over it). Returns ``path``. A bare ``Figure`` renders with Agg, whatever
    pyplot's backend."""
    from matplotlib.figure import Figure

    counts = np.asarray(counts)
    num_clients, num_labels = counts.shape
    if num_labels != len(label_names):
        raise ValueError(f"{num_labels} count columns but {len(label_names)} label names")
    fig = Figure(figsize=(2 + 0.6 * num_labels, 1.5 + min(0.3 * num_clients, 20)))
    ax = fig.add_subplot()
    image = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="examples")
    ax.set_xticks(range(num_labels), labels=list(label_names), rotation=45, ha="right")
    ax.set_yticks(range(num_clients) if num_clients <= 50 else [])
    ax.set_xlabel("label")
    ax.set_ylabel("client")
    if title:
        # wrapped to the figure's width (a narrow figure clipped a long title); tight_layout
        # below makes room for its lines
        fontsize = 11.0
        per_line = max(16, int(0.9 * fig.get_figwidth() * 72 / (0.6 * fontsize)))
        ax.set_title(textwrap.fill(title, per_line), fontsize=fontsize)
    if counts.size <= _ANNOTATE_CELLS:
        threshold = counts.max() / 2
        for (row, col), value in np.ndenumerate(counts):
            color = "black" if value > threshold else "white"
            ax.text(col, row, str(value), ha="center", va="center", color=color, fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
    return path

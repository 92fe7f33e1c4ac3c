"""The relevance heatmap: the similarity matrix S a relevance-guided method (FedMosaic's
RELA) last computed between its clients, as ``relevance.png`` in the run directory."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_ANNOTATE_CELLS = 256


def plot_relevance(
    matrix: Sequence[Sequence[float]], clients: Sequence[int], path: Path, title: str = ""
) -> Path:
    """Draw S (clients x clients, values in [-1, 1]) with a diverging colormap centred at 0,
    numbers in the cells when there are at most 256, and write it to ``path`` atomically.
    A bare ``Figure`` renders with Agg, whatever pyplot's backend."""
    from matplotlib.figure import Figure

    values = np.asarray(matrix, dtype=float)
    n = len(clients)
    if values.shape != (n, n):
        raise ValueError(f"relevance matrix {values.shape} for {n} clients")
    size = 2.5 + min(0.4 * n, 14)
    fig = Figure(figsize=(size + 1, size))
    ax = fig.add_subplot()
    image = ax.imshow(values, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    fig.colorbar(image, ax=ax, label="relevance S")
    ticks = range(n) if n <= 50 else []
    ax.set_xticks(ticks, labels=[str(c) for c in clients] if n <= 50 else [])
    ax.set_yticks(ticks, labels=[str(c) for c in clients] if n <= 50 else [])
    ax.set_xlabel("client j")
    ax.set_ylabel("client i")
    if title:
        ax.set_title(title, fontsize=10)
    if values.size <= _ANNOTATE_CELLS:
        annotate_cells(ax, values, bound=1.0)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
    return path


def annotate_cells(ax: Any, values: np.ndarray, bound: float) -> None:
    """Each finite cell of the heatmap ``values`` (colour scale ±``bound``) written in it,
    white on the dark ends of the scale."""
    for (row, col), value in np.ndenumerate(values):
        if np.isfinite(value):
            ax.text(
                col,
                row,
                f"{value:.2f}",
                ha="center",
                va="center",
                fontsize=6,
                color="white" if abs(value) > 0.6 * bound else "black",
            )

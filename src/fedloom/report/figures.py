"""What every figure of a report shares: a bare Agg figure, its PNG written atomically,
None as a gap in a line."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: dots per inch of every PNG: a figure of w x h inches is 100w x 100h pixels
DPI = 100
#: the colour of one run / adapter, in order (matplotlib's tab10)
COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
#: the colour of an adapter kind (global / personal, the baselines) wherever it appears
ADAPTER_COLORS = {
    "global": COLORS[0],
    "personal": COLORS[1],
    "local": COLORS[2],
    "majority": COLORS[7],
    "zero_shot": COLORS[5],
}


def figure(
    width: float, height: float, layout: Literal["constrained", "tight"] | None = None
) -> Figure:
    """A figure of ``width`` x ``height`` inches drawn by Agg, whatever pyplot's backend
    (pyplot is not imported: no global state, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG at :data:`DPI` (its pixel size is its size in inches x DPI),
    through a temporary file renamed over ``path``."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return write_atomic(path, buffer.getvalue())


def write_atomic(path: Path, data: bytes) -> Path:
    """``data`` into a temporary file beside ``path``, renamed over it (no torn file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def rounds_axis(ax: Any, rounds: Sequence[int] = ()) -> None:
    """An x axis of rounds: integer ticks, a light grid; one round centred."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(set(rounds)) == 1:
        ax.set_xlim(rounds[0] - 1, rounds[0] + 1)
    ax.grid(alpha=0.3)


#: how each client's own line is drawn, under the bold summary lines
THIN: dict[str, Any] = {"color": "#9a9a9a", "linewidth": 0.8, "alpha": 0.6}


def gaps(values: Sequence[float | None]) -> np.ndarray:
    """``values`` as floats with NaN for None (a gap in a line)."""
    return np.asarray([np.nan if v is None else v for v in values], dtype=float)


def shape(panels: int, columns: int) -> tuple[int, int]:
    """(rows, columns) of a grid holding ``panels``."""
    columns = max(1, min(columns, panels))
    return -(-panels // columns), columns


def copy_into(source: Path, path: Path) -> Path:
    """``source`` copied to ``path`` (nothing to do when they are the same file)."""
    if not (path.exists() and path.samefile(source)):
        write_atomic(path, source.read_bytes())
    return path


@dataclass(frozen=True)
class Plot:
    """A PNG a report shows: where it is, its heading and a sentence on how to read it."""

    path: Path
    title: str
    caption: str = ""

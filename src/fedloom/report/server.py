"""What a method's server knows about its clients, over rounds: relevance / task
relationship matrices (FedMosaic's S, MOCHA's Ω), cluster assignments (IFCA, CFL, ...,
with their agreement with the partition's true groups), FedEM's mixture weights and
HetLoRA's ranks. Each drawn only for a run that logged it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedloom.report.figures import COLORS, Plot, figure, gaps, rounds_axis, save
from fedloom.report.relevance import annotate_cells
from fedloom.report.series import Matrices

#: the most rounds of a matrix drawn side by side (spread over the run, the last included)
MATRIX_PANELS = 4
_ANNOTATE_CELLS = 64


def _suffix(tag: str) -> str:
    return f"_{tag}" if tag else ""


def _picked(rounds: list[int]) -> list[int]:
    """Indices of up to :data:`MATRIX_PANELS` rounds spread evenly, the last included."""
    n = len(rounds)
    if n <= MATRIX_PANELS:
        return list(range(n))
    return sorted({round(i * (n - 1) / (MATRIX_PANELS - 1)) for i in range(MATRIX_PANELS)})


def plot_matrices(
    found: Mapping[str, Matrices], folder: Path, stem: str, label: str, centred_unit: bool
) -> list[Plot]:
    """Side by side, the matrix at a few rounds; a diverging colour scale centred at 0
    (fixed to [-1, 1] when ``centred_unit``, as for a relevance S)."""
    plots = []
    for tag, found_matrices in found.items():
        picked = _picked(found_matrices.rounds)
        if centred_unit:
            bound = 1.0
        else:
            bound = float(max(np.nanmax(np.abs(found_matrices.matrices[i])) for i in picked))
            bound = bound or 1.0
        n = max(len(found_matrices.clients[i]) for i in picked)
        side = 2.2 + min(0.35 * n, 6.0)
        fig = figure(side * len(picked) + 1.0, side + 0.6, layout="constrained")
        axes = []
        image = None
        for k, i in enumerate(picked):
            ax = fig.add_subplot(1, len(picked), k + 1)
            axes.append(ax)
            values, clients = found_matrices.matrices[i], found_matrices.clients[i]
            image = ax.imshow(
                values, cmap="RdBu_r", vmin=-bound, vmax=bound, interpolation="nearest"
            )
            ticks = range(len(clients)) if len(clients) <= 30 else []
            names = [str(c) for c in clients] if len(clients) <= 30 else []
            ax.set_xticks(ticks, labels=names, fontsize=7)
            ax.set_yticks(ticks, labels=names, fontsize=7)
            ax.set_title(f"round {found_matrices.rounds[i]}", fontsize=10)
            if values.size <= _ANNOTATE_CELLS:
                annotate_cells(ax, values, bound)
        if image is not None:
            fig.colorbar(image, ax=axes, label=label, shrink=0.8)
        name = f"{stem}{_suffix(tag)}.png"
        title = f"{label} over rounds" + (f" ({tag})" if tag else "")
        plots.append(
            Plot(
                save(fig, folder / name),
                title,
                f"The {label} between clients (row i, column j) the server computed, at "
                f"{len(picked)} of the {len(found_matrices.rounds)} rounds it was logged.",
            )
        )
    return plots


def plot_clusters(
    found: Mapping[str, list[tuple[int, dict[str, Any]]]],
    groups: Mapping[int, str] | None,
    folder: Path,
) -> list[Plot]:
    """Each client's cluster at each round (a colour per cluster, its number in the cell),
    and the adjusted Rand index against the true groups when the partition has several."""
    from fedloom.diagnostics.clusters import adjusted_rand

    plots = []
    for tag, history in found.items():
        rounds = [r for r, _ in history]
        clients = sorted({int(c) for _, a in history for c in a})
        table = np.full((len(clients), len(rounds)), np.nan)
        for col, (_, assignment) in enumerate(history):
            for c, j in assignment.items():
                table[clients.index(int(c)), col] = float(j)
        agreement = (
            [adjusted_rand({int(c): int(j) for c, j in a.items()}, groups) for _, a in history]
            if groups
            else []
        )
        has_truth = any(a is not None for a in agreement)
        width = min(max(5.0, 2.0 + 0.45 * len(rounds)), 12.0)
        height = max(3.0, 1.4 + min(0.3 * len(clients), 9.0))
        fig = figure(width + (4.0 if has_truth else 0.0), height)
        ax = fig.add_subplot(1, 2 if has_truth else 1, 1)
        from matplotlib.colors import ListedColormap

        k = int(np.nanmax(table)) + 1 if np.isfinite(table).any() else 1
        cmap = ListedColormap([COLORS[j % len(COLORS)] for j in range(max(k, 1))])
        ax.imshow(
            table,
            aspect="auto",
            cmap=cmap,
            vmin=-0.5,
            vmax=max(k, 1) - 0.5,
            interpolation="nearest",
        )
        if table.size <= 600:
            for (row, col), value in np.ndenumerate(table):
                if np.isfinite(value):
                    ax.text(
                        col,
                        row,
                        str(int(value)),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        ax.set_xticks(
            range(len(rounds)) if len(rounds) <= 40 else [],
            labels=[str(r) for r in rounds] if len(rounds) <= 40 else [],
            fontsize=7,
        )
        ax.set_yticks(
            range(len(clients)) if len(clients) <= 50 else [],
            labels=[str(c) for c in clients] if len(clients) <= 50 else [],
            fontsize=7,
        )
        ax.set_xlabel("round")
        ax.set_ylabel("client")
        ax.set_title(f"cluster of each client ({k} clusters)", fontsize=10)
        if has_truth:
            ax2 = fig.add_subplot(1, 2, 2)
            ax2.plot(rounds, gaps(agreement), color=COLORS[2], marker="o")
            ax2.set_ylim(-0.2, 1.05)
            ax2.set_title("adjusted Rand index vs the true groups", fontsize=10)
            rounds_axis(ax2, rounds)
        fig.tight_layout()
        plots.append(
            Plot(
                save(fig, folder / f"clusters{_suffix(tag)}.png"),
                "Clusters over rounds" + (f" ({tag})" if tag else ""),
                "The server's cluster assignment after each round (metrics.jsonl's clusters "
                "rows)"
                + ("; 1 on the right means the true groups were found." if has_truth else "."),
            )
        )
    return plots


def plot_mixture(found: Mapping[str, list[tuple[int, dict[str, Any]]]], folder: Path) -> list[Plot]:
    """FedEM: each client's mixture weights π at the last round, as stacked bars."""
    plots = []
    for tag, history in found.items():
        last_round, weights = history[-1]
        clients = sorted(weights, key=lambda c: int(c) if c.isdigit() else 1 << 30)
        if not clients:
            continue
        m = max(len(weights[c]) for c in clients)
        fig = figure(min(2.5 + 0.35 * len(clients), 12.0), 3.4)
        ax = fig.add_subplot()
        bottom = np.zeros(len(clients))
        for j in range(m):
            part = np.asarray([weights[c][j] if j < len(weights[c]) else 0.0 for c in clients])
            ax.bar(
                range(len(clients)),
                part,
                bottom=bottom,
                color=COLORS[j % len(COLORS)],
                label=f"component {j}",
            )
            bottom += part
        ax.set_xticks(
            range(len(clients)) if len(clients) <= 50 else [],
            labels=clients if len(clients) <= 50 else [],
            fontsize=7,
        )
        ax.set_xlabel("client")
        ax.set_ylabel("π")
        ax.set_title(f"mixture weights after round {last_round}", fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        plots.append(
            Plot(
                save(fig, folder / f"mixture{_suffix(tag)}.png"),
                "Mixture weights" + (f" ({tag})" if tag else ""),
                "Each client's weight on each shared component, as it last reported it.",
            )
        )
    return plots


def plot_ranks(found: Mapping[str, list[tuple[int, dict[str, Any]]]], folder: Path) -> list[Plot]:
    """HetLoRA: each client's LoRA rank over rounds."""
    plots = []
    for tag, history in found.items():
        rounds = [r for r, _ in history]
        clients = sorted({c for _, ranks in history for c in ranks})
        fig = figure(6.4, 3.4)
        ax = fig.add_subplot()
        for j, c in enumerate(clients):
            ax.plot(
                rounds,
                gaps([ranks.get(c) for _, ranks in history]),
                color=COLORS[j % len(COLORS)],
                marker="o" if len(rounds) <= 12 else None,
                label=f"client {c}" if len(clients) <= 10 else None,
            )
        ax.set_ylabel("rank")
        rounds_axis(ax, rounds)
        if len(clients) <= 10:
            ax.legend(fontsize=7)
        fig.tight_layout()
        plots.append(
            Plot(
                save(fig, folder / f"ranks{_suffix(tag)}.png"),
                "LoRA ranks" + (f" ({tag})" if tag else ""),
                "The rank the server holds for each client after each round.",
            )
        )
    return plots

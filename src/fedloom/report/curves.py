"""Scores over rounds and the final per-client scores: the global adapter on the dev set,
every client scope per metric (each client a thin line, the mean and p10 bold), the
training loss, and the distribution of the final per-client scores by adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedloom.report.figures import (
    ADAPTER_COLORS,
    COLORS,
    THIN,
    Plot,
    figure,
    gaps,
    rounds_axis,
    save,
    shape,
)
from fedloom.report.series import CLIENT_PARTS, ClientCurves, Curve, TrainSeries


def _marker(rounds: list[int]) -> str | None:
    return "o" if len(rounds) <= 12 else None


def plot_dev(curves: dict[str, dict[str, Curve]], folder: Path) -> list[Plot]:
    """One panel per metric, a line per ``global/dev`` label (per backbone)."""
    names = list(dict.fromkeys(m for by_metric in curves.values() for m in by_metric))
    if not names:
        return []
    rows, cols = shape(len(names), 3)
    fig = figure(4.0 * cols, 3.0 * rows)
    for i, name in enumerate(names):
        ax = fig.add_subplot(rows, cols, i + 1)
        every: list[int] = []
        for j, (label, by_metric) in enumerate(curves.items()):
            if name in by_metric:
                curve = by_metric[name]
                every += curve.rounds
                ax.plot(
                    curve.rounds,
                    gaps(curve.values),
                    marker=_marker(curve.rounds),
                    color=COLORS[j % len(COLORS)],
                    label=label,
                )
        ax.set_title(name)
        rounds_axis(ax, sorted(set(every)))
        if len(curves) > 1:
            ax.legend(fontsize=7)
    fig.suptitle("global adapter on the dev set")
    fig.tight_layout()
    return [
        Plot(
            save(fig, folder / "dev.png"),
            "Global adapter on the dev set",
            "The global adapter's score on the task's dev set after each evaluated round.",
        )
    ]


def plot_clients(
    curves: list[ClientCurves], dev: dict[str, dict[str, Curve]], folder: Path
) -> list[Plot]:
    """One PNG per metric (``clients_<metric>.png``), one panel per client scope: each
    client a thin grey line, the mean solid and the 10th percentile dashed in the
    adapter's colour; the global panels carry the dev score (dotted) for reference."""
    names = list(dict.fromkeys(m for c in curves for m in c.per_client))
    plots = []
    for name in names:
        panels = [c for c in curves if name in c.per_client]
        rows, cols = shape(len(panels), 2)
        fig = figure(4.8 * cols, 3.3 * rows)
        axes: list[Any] = []
        for i, scores in enumerate(panels):
            ax = fig.add_subplot(rows, cols, i + 1, sharey=axes[0] if axes else None)
            axes.append(ax)
            adapter = scores.scope.split("/", 1)[0]
            color = ADAPTER_COLORS.get(adapter, COLORS[4])
            for j, values in enumerate(scores.per_client[name].values()):
                ax.plot(scores.rounds, gaps(values), **THIN, label="a client" if j == 0 else None)
            marker = _marker(scores.rounds)
            ax.plot(
                scores.rounds,
                gaps(scores.mean[name]),
                color=color,
                linewidth=2.2,
                marker=marker,
                label="mean",
            )
            ax.plot(
                scores.rounds,
                gaps(scores.p10[name]),
                color=color,
                linewidth=1.6,
                linestyle="--",
                marker=marker,
                label="p10",
            )
            if adapter == "global" and name in dev.get("global/dev", {}):
                curve = dev["global/dev"][name]
                ax.plot(
                    curve.rounds,
                    gaps(curve.values),
                    color="black",
                    linestyle=":",
                    linewidth=1.4,
                    label="dev",
                )
            ax.set_title(f"{scores.scope} ({len(scores.per_client[name])} clients)", fontsize=10)
            ax.set_ylabel(name)
            rounds_axis(ax, scores.rounds)
            ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = save(fig, folder / f"clients_{_slug(name)}.png")
        plots.append(
            Plot(
                path,
                f"{name} per client",
                "Each grey line is one client; the solid line is the mean over clients and "
                "the dashed one the 10th percentile (the worse-off clients).",
            )
        )
    return plots


def plot_train_loss(train: TrainSeries, folder: Path) -> list[Plot]:
    if not any(v is not None for v in train.loss):
        return []
    fig = figure(6.4, 3.4)
    ax = fig.add_subplot()
    for j, values in enumerate(train.loss_per_client.values()):
        ax.plot(train.rounds, gaps(values), **THIN, label="a client" if j == 0 else None)
    ax.plot(
        train.rounds,
        gaps(train.loss),
        color=COLORS[3],
        linewidth=2.2,
        marker=_marker(train.rounds),
        label="mean over reporting clients",
    )
    ax.set_ylabel("training loss")
    rounds_axis(ax, train.rounds)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return [
        Plot(
            save(fig, folder / "train_loss.png"),
            "Training loss",
            "Each client's mean loss over its local steps in a round (grey), and their mean.",
        )
    ]


def plot_final(final: dict[str, dict[str, dict[str, float]]], folder: Path) -> list[Plot]:
    """One panel per metric: each client scope's final per-client scores as a box and its
    points; a client's global and personal score on the same split joined by a line."""
    names = list(dict.fromkeys(m for by_metric in final.values() for m in by_metric))
    if not names:
        return []
    # a client's global and personal scores on the same split side by side
    scopes = sorted(final, key=lambda s: CLIENT_PARTS.index(s.partition("/")[2]))
    panel = max(3.6, 0.9 * len(scopes) + 1.2)
    rows, cols = shape(len(names), max(1, int(11.0 // panel)))
    fig = figure(panel * cols, 3.6 * rows)
    jitter = np.random.default_rng(0)
    for i, name in enumerate(names):
        ax = fig.add_subplot(rows, cols, i + 1)
        shown = [s for s in scopes if name in final[s]]
        where: dict[str, dict[str, tuple[float, float]]] = {}
        for x, scope in enumerate(shown):
            scores = final[scope][name]
            color = ADAPTER_COLORS.get(scope.split("/", 1)[0], COLORS[4])
            ax.boxplot(
                [list(scores.values())],
                positions=[x],
                widths=0.5,
                showfliers=False,
                medianprops={"color": color},
                boxprops={"color": color},
                whiskerprops={"color": color},
                capprops={"color": color},
            )
            xs = x + jitter.uniform(-0.12, 0.12, len(scores))
            ax.scatter(xs, list(scores.values()), s=14, color=color, alpha=0.8, zorder=3)
            where[scope] = {c: (float(px), v) for (c, v), px in zip(scores.items(), xs)}
        for part in CLIENT_PARTS:
            left, right = where.get(f"global/{part}", {}), where.get(f"personal/{part}", {})
            for c in left.keys() & right.keys():
                ax.plot(*zip(left[c], right[c]), color="#bbbbbb", linewidth=0.7, zorder=1)
        ax.set_xticks(range(len(shown)), labels=[s.replace("/", "\n") for s in shown], fontsize=8)
        ax.set_title(name)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return [
        Plot(
            save(fig, folder / "final_scores.png"),
            "Final scores per client",
            "Each point is one client's score at the last evaluation, by adapter and "
            "split; grey lines join a client's global and personal scores.",
        )
    ]


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)

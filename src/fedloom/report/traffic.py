"""What a round costs: bytes sent down and up, and the privacy budget spent (ε)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedloom.report.figures import COLORS, THIN, Plot, figure, gaps, rounds_axis, save
from fedloom.report.series import TrainSeries

_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "bytes"))


def _unit(largest: float) -> tuple[float, str]:
    return next((scale, name) for scale, name in _UNITS if largest >= scale or scale == 1.0)


def plot_traffic(train: TrainSeries, folder: Path) -> list[Plot]:
    """Bytes per round (server to clients, clients to server) and their running total."""
    if not train.has_traffic:
        return []
    down, up = gaps(train.bytes_down), gaps(train.bytes_up)
    total_down, total_up = np.nancumsum(down), np.nancumsum(up)
    scale, unit = _unit(float(np.nanmax([*down, *up, 1.0])))
    cum_scale, cum_unit = _unit(float(max(total_down[-1], total_up[-1], 1.0)))
    fig = figure(10.0, 3.4)
    ax = fig.add_subplot(1, 2, 1)
    width = 0.4
    rounds = np.asarray(train.rounds, dtype=float)
    ax.bar(rounds - width / 2, down / scale, width, color=COLORS[0], label="down (to clients)")
    ax.bar(rounds + width / 2, up / scale, width, color=COLORS[1], label="up (to server)")
    ax.set_ylabel(unit)
    ax.set_ylim(0, 1.3 * float(np.nanmax([*down, *up, 1.0])) / scale)
    ax.set_title("per round")
    ax.legend(fontsize=7, ncols=2, loc="upper center")
    ax2 = fig.add_subplot(1, 2, 2)
    ax2.plot(
        rounds, total_down / cum_scale, color=COLORS[0], linewidth=3.5, marker="o", label="down"
    )
    ax2.plot(
        rounds,
        total_up / cum_scale,
        color=COLORS[1],
        linewidth=1.6,
        linestyle="--",
        marker="s",
        label="up",
    )
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel(cum_unit)
    ax2.set_title("cumulative")
    ax2.legend(fontsize=7)
    for a in (ax, ax2):
        rounds_axis(a, train.rounds)
    fig.tight_layout()
    return [
        Plot(
            save(fig, folder / "traffic.png"),
            "Bytes per round",
            "What the server sent the sampled clients (down) and the accepted updates as they "
            "travelled (up), summed over the clients of the round.",
        )
    ]


def plot_privacy(
    train: TrainSeries, privacy: Mapping[str, Any] | None, config: Mapping[str, Any], folder: Path
) -> list[Plot]:
    """ε after each round as the accountant composed it (the largest client's under
    DP-SGD, each client's as a thin line), against the target ε when one was set; the
    clipping norm beside it when adaptive clipping moved it."""
    if not train.has_privacy:
        return []
    settings = config.get("privacy", {})
    clip = [c for c in train.clip_norm if c is not None]
    moving = len(set(clip)) > 1
    fig = figure(10.0 if moving else 6.4, 3.4)
    ax = fig.add_subplot(1, 2 if moving else 1, 1)
    for j, values in enumerate(train.epsilon_per_client.values()):
        ax.plot(
            train.rounds,
            gaps(values),
            **THIN,
            label="a client (DP-SGD)" if j == 0 else None,
        )
    ax.plot(
        train.rounds, gaps(train.epsilon), color=COLORS[4], linewidth=2.2, marker="o", label="ε"
    )
    target = settings.get("target_epsilon")
    if isinstance(target, int | float):
        ax.axhline(target, color="black", linestyle=":", label=f"target ε = {target:g}")
    delta = next((d for d in reversed(train.delta) if d is not None), None)
    if delta is None and privacy:
        delta = privacy.get("delta")
    level = (privacy or {}).get("level") or settings.get("level", "")
    if isinstance(delta, int | float):
        ax.set_title(f"ε spent ({level} level, δ = {delta:.3g})", fontsize=10)
    else:  # DP-SGD: δ is per client, given as a rule
        ax.set_title(f"ε spent ({level} level)", fontsize=10)
    ax.set_ylabel("ε")
    ax.set_ylim(bottom=0)
    rounds_axis(ax, train.rounds)
    ax.legend(fontsize=7)
    if moving:
        ax2 = fig.add_subplot(1, 2, 2)
        ax2.plot(train.rounds, gaps(train.clip_norm), color=COLORS[5], marker="o")
        ax2.set_title("clipping norm (adaptive)")
        rounds_axis(ax2, train.rounds)
    fig.tight_layout()
    return [
        Plot(
            save(fig, folder / "privacy.png"),
            "Privacy budget per round",
            "The accountant's ε after each round, logged in metrics.jsonl's train rows.",
        )
    ]

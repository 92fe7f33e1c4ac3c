"""Several runs side by side: ``compare(paths)`` reads run directories (or a sweep
directory, expanded to its points' runs and replicates) and labels each by what differs
between them: its algorithm and the config keys whose values differ (a sweep's swept
keys). A :class:`Comparison` renders its final scores as a rich Table or a Markdown table
(for BENCHMARKS.md), and its curves over rounds as one PNG.

The final scores are summary.json's (a run still going: its last evaluation rows'): per
metric, the global adapter's dev score and the clients' mean and p10 of the global and of
the personal adapters (``summary[adapter]["clients"]``, scored as the run's client_mode
says), and the privacy ε where a run has one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedloom.report.figures import COLORS, figure, gaps, rounds_axis, save
from fedloom.report.rundata import ReportError, RunData, is_run_dir, read_run
from fedloom.report.series import ADAPTERS, client_curves, dev_curves
from fedloom.report.tables import final_scores

if TYPE_CHECKING:
    from rich.table import Table

#: config keys that name a run rather than define it
IGNORED_KEYS = frozenset({"name", "output_dir"})
#: the score columns, per metric: (heading, adapter, part, statistic)
SCORE_COLUMNS = (
    ("global dev", "global", "dev", None),
    ("global mean", "global", "clients", "mean"),
    ("global p10", "global", "clients", "p10"),
    ("personal mean", "personal", "clients", "mean"),
    ("personal p10", "personal", "clients", "p10"),
    # baselines, where a run scored them (eval.baselines)
    ("local mean", "local", "clients", "mean"),
    ("local p10", "local", "clients", "p10"),
    ("majority mean", "majority", "clients", "mean"),
    ("zero-shot mean", "zero_shot", "clients", "mean"),
)


@dataclass(frozen=True)
class ComparedRun:
    label: str
    run: RunData
    #: this run's value of each key that differs between the compared runs (None: unset)
    settings: dict[str, Any]
    #: the point a sweep selected (on its clients' validation splits)
    selected: bool = False

    @cached_property
    def final(self) -> dict[str, dict[str, dict[str, Any]]]:
        """:func:`~fedloom.report.tables.final_scores` of the run."""
        return final_scores(self.run)

    def score(self, metric: str, adapter: str, part: str, stat: str | None) -> float | None:
        scores = self.final.get(adapter, {}).get(part, {}).get(metric)
        value = scores.get(stat) if isinstance(scores, dict) and stat else scores
        return float(value) if isinstance(value, int | float) else None

    @property
    def epsilon(self) -> float | None:
        eps = ((self.run.summary or {}).get("privacy") or {}).get("epsilon")
        if eps is None:  # still running: the last train row's
            eps = next(
                (
                    r["epsilon"]
                    for r in reversed(self.run.rows)
                    if r.get("scope") == "train" and isinstance(r.get("epsilon"), int | float)
                ),
                None,
            )
        return float(eps) if isinstance(eps, int | float) else None


@dataclass
class Comparison:
    runs: list[ComparedRun]
    #: the config keys whose values differ between the runs (what the labels show)
    keys: list[str]
    #: every metric a run has final scores for, the first run's main metric first
    metrics: list[str]
    #: the paths compare() was given
    sources: list[Path] = field(default_factory=list)

    def columns(self) -> list[tuple[str, str, str, str | None]]:
        """The score columns some run has a value in."""
        return [
            c
            for c in SCORE_COLUMNS
            if any(r.score(m, *c[1:]) is not None for r in self.runs for m in self.metrics)
        ]

    def table_rows(self, metrics: Sequence[str] | None = None) -> tuple[list[str], list[list[str]]]:
        """Header and a row per (run, metric): the label (★ for a sweep's selected point),
        the metric, the score columns, ε where a run has one, the rounds and wall time."""
        metrics = list(metrics or self.metrics)
        columns = self.columns()
        private = any(r.epsilon is not None for r in self.runs)
        header = [
            "run",
            "metric",
            *(c[0] for c in columns),
            *(["ε"] if private else []),
            "rounds",
            "wall s",
        ]
        rows = []
        for r in self.runs:
            summary, status = r.run.summary or {}, r.run.status or {}
            rounds = str(summary.get("rounds") or status.get("round") or "—")
            if r.run.state != "finished" and status.get("rounds"):
                rounds = f"{status.get('round', 0)}/{status['rounds']} ({r.run.state})"
            wall = summary.get("wall_seconds")
            for metric in metrics:
                rows.append(
                    [
                        ("★ " if r.selected else "") + r.label,
                        metric,
                        *(_cell(r.score(metric, *c[1:])) for c in columns),
                        *([_cell(r.epsilon, ".3g")] if private else []),
                        rounds,
                        f"{wall:.1f}" if isinstance(wall, int | float) else "—",
                    ]
                )
        return header, rows

    def rich_table(self, metrics: Sequence[str] | None = None) -> Table:
        from rich.table import Table

        header, rows = self.table_rows(metrics)
        table = Table(
            title="final scores: dev score of the global adapter, and the clients' mean and "
            "p10 of each adapter",
            caption="\n".join(str(p) for p in self.sources),
        )
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i < 2 else "right")
        for row in rows:
            table.add_row(*row)
        return table

    def markdown(self, metrics: Sequence[str] | None = None) -> str:
        """A Markdown table of :meth:`table_rows` (``|`` in a label escaped)."""
        header, rows = self.table_rows(metrics)
        lines = [
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|",
        ]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        if any(r.selected for r in self.runs):
            lines.append("\n★ the point the sweep selected on the clients' validation splits")
        return "\n".join(lines)

    def plot(self, path: str | Path, metric: str | None = None) -> Path:
        """``metric`` (default: the main metric) over rounds, a panel per score (the global
        adapter on the dev set, the clients' mean of each adapter with its p10 dashed), a
        colour per run; written to ``path`` as a PNG."""
        metric = metric or (self.metrics[0] if self.metrics else None)
        if metric is None:
            raise ReportError("no run has scores to draw")
        panels = _panels(self.runs, metric)
        if not panels:
            raise ReportError(f"no run logged {metric!r} over rounds")
        fig = figure(4.4 * len(panels), 3.6 + 0.22 * len(self.runs), layout="constrained")
        first = None
        labelled: set[int] = set()  # a run is in the legend once, from its first line
        for k, (title, lines) in enumerate(panels.items()):
            ax = fig.add_subplot(1, len(panels), k + 1, sharey=first)
            first = first or ax
            for j, line in lines.items():
                color = COLORS[j % len(COLORS)]
                label = None if j in labelled else self.runs[j].label
                labelled.add(j)
                rounds, values, low = line
                ax.plot(
                    rounds,
                    gaps(values),
                    color=color,
                    linewidth=2,
                    label=label,
                    marker="o" if len(rounds) <= 12 else None,
                )
                if low is not None:
                    ax.plot(rounds, gaps(low), color=color, linewidth=1.2, linestyle="--")
            ax.set_title(title, fontsize=10)
            ax.set_ylabel(metric)
            rounds_axis(ax)
        fig.legend(loc="outside lower center", ncols=min(3, len(self.runs)), fontsize=8)
        return save(fig, Path(path))


def _panels(
    runs: Sequence[ComparedRun], metric: str
) -> dict[str, dict[int, tuple[list[int], list[float | None], list[float | None] | None]]]:
    """{panel title: {run index: (rounds, values, p10 or None)}}: the global adapter on the
    dev set, then each adapter's clients (:data:`~fedloom.report.series.ADAPTERS` order),
    the panels some run has."""
    panels: dict[tuple[int, str], dict[int, Any]] = {}
    for j, r in enumerate(runs):
        dev = dev_curves(r.run).get("global/dev", {}).get(metric)
        if dev is not None:
            panels.setdefault((-1, "global adapter, dev set"), {})[j] = (
                dev.rounds,
                dev.values,
                None,
            )
        for curves in client_curves(r.run):
            adapter, part = curves.scope.split("/", 1)
            if part == "clients" and metric in curves.mean:
                rank = ADAPTERS.index(adapter) if adapter in ADAPTERS else len(ADAPTERS)
                kind = "adapter" if adapter in ("global", "personal") else "baseline"
                title = f"{adapter} {kind}, clients (mean; p10 dashed)"
                panels.setdefault((rank, title), {})[j] = (
                    curves.rounds,
                    curves.mean[metric],
                    curves.p10[metric],
                )
    return {title: lines for (_, title), lines in sorted(panels.items())}


def _cell(value: float | None, spec: str = ".4f") -> str:
    return "—" if value is None else format(value, spec)


def compare(paths: Sequence[str | Path]) -> Comparison:
    """Compare the runs in ``paths``: run directories, or sweep directories (each
    expanded to its points' runs, then its replicates). :class:`ReportError` (one line,
    naming the path) when a path is neither, or when nothing is left to compare."""
    found: list[tuple[Path, bool]] = []
    for path in map(Path, paths):
        if is_run_dir(path):
            found.append((path, False))
        elif is_sweep_dir(path):
            found += sweep_runs(path)
        else:
            raise ReportError(f"{path}: neither a run directory nor a sweep directory")
    if not found:
        raise ReportError("nothing to compare: give run directories or a sweep directory")
    runs = [read_run(p) for p, _ in found]
    settings = [flatten(r.config) for r in runs]
    keys = differing(settings)
    labels = unique_labels(
        [label(r, s, keys) for r, s in zip(runs, settings)], [r.path for r in runs]
    )
    compared = [
        ComparedRun(text, r, {k: s.get(k) for k in keys}, chosen)
        for text, r, s, (_, chosen) in zip(labels, runs, settings, found)
    ]
    names: dict[str, None] = {}
    for r in runs:
        names |= dict.fromkeys(m for m in r.metric_names() if _has_final(r, m))
    return Comparison(compared, keys, list(names), [Path(p) for p in paths])


def _has_final(run: RunData, metric: str) -> bool:
    return any(
        metric in parts.get(part, {})
        for parts in final_scores(run).values()
        for part in ("dev", "clients")
    )


def is_sweep_dir(path: Path) -> bool:
    return (path / "sweep.json").is_file() or (path / "plan.toml").is_file()


def sweep_runs(sweep_dir: Path) -> list[tuple[Path, bool]]:
    """(run directory, selected) of a sweep's points in point order, then its replicates,
    from sweep.json (a run directory it names that has moved is looked for by its name in
    ``sweep_dir``); the run directories inside it when sweep.json cannot be read."""
    try:
        record = json.loads((sweep_dir / "sweep.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        record = None
    if not isinstance(record, dict):
        return [(p, False) for p in sorted(sweep_dir.iterdir()) if p.is_dir() and is_run_dir(p)]
    selected = record.get("selected")
    replicates = (record.get("replicates") or {}).get("runs") or []
    out = []
    for entry in [*record.get("points", []), *replicates[1:]]:
        path = _located(sweep_dir, Path(entry["run_dir"]))
        if path is not None:
            chosen = entry.get("index") == selected and not entry.get("replicate")
            out.append((path, bool(chosen and selected is not None)))
    return out


def _located(sweep_dir: Path, path: Path) -> Path | None:
    for candidate in (path, sweep_dir / path.name):
        if candidate.is_dir() and is_run_dir(candidate):
            return candidate
    return None


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"train.lr": 0.001, ...}`` (tables of tables flattened)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out |= flatten(value, f"{dotted}.")
        elif dotted not in IGNORED_KEYS:
            out[dotted] = value
    return out


def differing(settings: Sequence[Mapping[str, Any]]) -> list[str]:
    """The keys whose values (a missing key counts as one) are not the same in every
    config, in the order of first appearance."""
    keys = list(dict.fromkeys(k for s in settings for k in s))
    return [
        k
        for k in keys
        if len({json.dumps(s.get(k), sort_keys=True, default=str) for s in settings}) > 1
    ]


def shown(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def label(run: RunData, settings: Mapping[str, Any], keys: Sequence[str]) -> str:
    """The algorithm, then ``key=value`` for each differing key this run sets
    (``algorithm.name`` is the algorithm itself); a run that has not finished says its
    state."""
    parts = [
        f"{k}={shown(settings[k])}"
        for k in keys
        if k != "algorithm.name" and settings.get(k) is not None
    ]
    text = run.algorithm + (f" ({', '.join(parts)})" if parts else "")
    return text if run.state == "finished" else f"{text} [{run.state}]"


def unique_labels(labels: Sequence[str], paths: Sequence[Path]) -> list[str]:
    """``labels`` with the run directory's name added to any that is not unique."""
    return [
        f"{text} {paths[i].name}" if labels.count(text) > 1 else text
        for i, text in enumerate(labels)
    ]

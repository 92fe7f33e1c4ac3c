"""A run's final numbers as plain tables (a header and rows of strings): the scores as
summary.json has them (or, for a run that has not finished, as its last evaluation rows
logged them), the facts of the run, and the versions that produced it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedloom.report.rundata import RunData
from fedloom.report.series import ADAPTERS

#: the parts of an adapter's scores, in the order a table lists them
PARTS = ("dev", "clients", "clients_split", "val", "others")
STATS = ("mean", "p10", "min", "max", "n")


def final_scores(run: RunData) -> dict[str, dict[str, dict[str, Any]]]:
    """``{adapter: {part: {metric: stats}}}``: summary.json's entries of scores
    (``global``, ``personal``, baselines such as ``local`` / ``majority``: a dev part maps
    each metric to its score, a client part to its mean, p10, min, max and n) and Self /
    Others' ``others``. A run without summary.json: the same read from each scope's last
    row of metrics.jsonl."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    if run.summary is not None:
        for adapter, entry in run.summary.items():
            if _is_scores(entry):
                out[adapter] = dict(entry)
        others = run.summary.get("self_others") or {}
        if isinstance(others.get("others"), dict) and others.get("adapter"):
            out.setdefault(str(others["adapter"]), {})["others"] = others["others"]
        return dict(sorted(out.items(), key=lambda item: _adapter_order(item[0])))
    for row in run.rows:
        scope = str(row.get("scope", ""))
        adapter, _, part = scope.partition("/")
        if not adapter or part not in PARTS or "round" not in row:
            continue
        if part == "dev":
            scores = {k: v for k, v in row.items() if k not in ("round", "scope", "backbone")}
        else:
            scores = row.get("metrics") or {}
        out.setdefault(adapter, {})[part] = scores
    return dict(sorted(out.items(), key=lambda item: _adapter_order(item[0])))


def _is_scores(entry: Any) -> bool:
    """A summary entry of an adapter's scores: ``{part: {metric: ...}}`` over known parts."""
    return (
        isinstance(entry, dict)
        and bool(entry)
        and all(part in PARTS and isinstance(v, dict) for part, v in entry.items())
    )


def _adapter_order(adapter: str) -> int:
    return ADAPTERS.index(adapter) if adapter in ADAPTERS else len(ADAPTERS)


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def score_rows(run: RunData) -> tuple[list[str], list[list[str]]]:
    """One row per (adapter/part, metric): the mean, p10, min, max and n over clients; a
    dev row's score under mean and its example count under n."""
    header = ["scores", "metric", *STATS]
    rows = []
    names = run.metric_names()
    for adapter, parts in final_scores(run).items():
        for part in sorted(parts, key=lambda p: PARTS.index(p) if p in PARTS else len(PARTS)):
            scores = parts[part]
            metrics = [m for m in names if m in scores] + [
                m for m in scores if m not in names and m != "n"
            ]
            for metric in metrics:
                stats = scores[metric]
                if isinstance(stats, dict):
                    cells = [_cell(stats.get(s)) for s in STATS]
                else:
                    cells = [_cell(stats), "", "", "", _cell(scores.get("n"))]
                rows.append([f"{adapter}/{part}", metric, *cells])
    return header, rows


def fact_rows(run: RunData) -> list[list[str]]:
    """``[name, value]`` rows: what ran, how far it got, how long it took, where."""
    summary, status = run.summary or {}, run.status or {}
    rounds = (
        summary.get("rounds")
        or status.get("rounds")
        or (run.config.get("federation", {}).get("rounds"))
    )
    done = status.get("round", rounds if run.summary is not None else None)
    facts: list[tuple[str, Any]] = [
        ("run directory", str(run.path)),
        ("name", run.name),
        ("task", summary.get("task") or run.config.get("data", {}).get("task")),
        ("algorithm", run.algorithm),
        ("state", run.state + (f": {status['error']}" if status.get("error") else "")),
        ("rounds", f"{done} of {rounds}" if done is not None else rounds),
        ("clients", run.config.get("partition", {}).get("num_clients")),
        ("backbone", run.config.get("model", {}).get("backbone")),
        ("main metric", summary.get("main_metric")),
        ("client scores", summary.get("client_mode")),
        ("started", status.get("started")),
        ("ended", status.get("ended")),
        ("wall seconds", summary.get("wall_seconds")),
    ]
    for key, value in (summary.get("compute") or {}).items():
        facts.append((f"compute: {key}", _flat(value)))
    for key, value in (summary.get("privacy") or {}).items():
        facts.append((f"privacy: {key}", value))
    if isinstance(summary.get("clusters"), dict):
        facts.append(("final clusters", _flat(summary["clusters"])))
    return [
        [name, f"{value:.4g}" if isinstance(value, float) else _cell(value)]
        for name, value in facts
        if value not in (None, "")
    ]


def _flat(value: Any) -> Any:
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    return value


def version_rows(versions: Mapping[str, Any]) -> list[list[str]]:
    return [[str(k), _cell(v)] for k, v in versions.items()]

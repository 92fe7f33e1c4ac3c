"""A round's evaluation (:class:`Evaluation`): the clients' scores summarized by scope,
and joined over the backbones of a mixed-backbone federation (``[[model.groups]]``).

Each backbone's clients are evaluated by :func:`fedloom.evaluation.round.evaluate_state`
on that backbone's cohort (:meth:`Experiment.cohorts`); :func:`merge_evaluations` joins the
per-client scores of every scope and summarizes them over all clients, and keeps each
backbone's global dev score apart (``summary["backbones"]``). Self / Others is scored
after the join, over every backbone's clients (:mod:`fedloom.evaluation.self_others`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedloom.data import summarize
from fedloom.params import Params


@dataclass
class Evaluation:
    """Rows for metrics.jsonl plus the numbers that go into summary.json."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    #: the adapter each client used, for personalized methods, where the clients are
    #: simulated (the local and Ray runtimes; a Flower node keeps and checkpoints its own)
    adapters: dict[int, Params] = field(default_factory=dict)


def _client_scope(
    per_client: dict[int, dict[str, float | None]], metric_names: tuple[str, ...]
) -> dict[str, Any]:
    """Per-metric summaries over the clients whose metric is defined (``n`` of them)."""
    return {
        "metrics": {m: summarize([v[m] for v in per_client.values()]) for m in metric_names},
        "per_client": {str(c): v for c, v in per_client.items()},
    }


def add_scopes(
    out: Evaluation,
    adapter: str,
    per_scope: dict[str, dict[int, dict[str, float | None]]],
    names: tuple[str, ...],
) -> None:
    """Each client scope of ``per_scope`` (``clients``, ``val``, ``clients_split``) with
    scores, summarized into ``out`` as the row ``<adapter>/<scope>`` and the summary's
    ``<adapter>`` entry."""
    for scope in ("clients", "val", "clients_split"):
        if per_scope.get(scope):
            summary = _client_scope(per_scope[scope], names)
            out.rows.append({"scope": f"{adapter}/{scope}", **summary})
            out.summary.setdefault(adapter, {})[scope] = summary["metrics"]


def merge_evaluations(
    evaluations: Mapping[str, Evaluation], metric_names: tuple[str, ...]
) -> Evaluation:
    """One evaluation from each backbone's (``{backbone: Evaluation}``): every scope with
    per-client scores joined over the backbones and summarized again; rows without them
    (a global adapter's dev score) kept per backbone, tagged with it."""
    if len(evaluations) == 1:
        return next(iter(evaluations.values()))
    out = Evaluation(summary={})
    joined: dict[str, dict[str, Any]] = {}
    for backbone, evaluation in evaluations.items():
        out.adapters.update(evaluation.adapters)
        out.summary.setdefault("client_mode", evaluation.summary.get("client_mode"))
        for row in evaluation.rows:
            if "per_client" in row:
                joined.setdefault(row["scope"], {}).update(row["per_client"])
            else:
                out.rows.append({**row, "backbone": backbone})
        dev = evaluation.summary.get("global", {}).get("dev")
        if dev is not None:
            out.summary.setdefault("backbones", {})[backbone] = {"global_dev": dev}
    for scope, per_client in joined.items():
        metrics = {
            m: summarize([v[m] if v is not None else None for v in per_client.values()])
            for m in metric_names
        }
        out.rows.append({"scope": scope, "metrics": metrics, "per_client": per_client})
        adapter, part = scope.split("/", 1)
        out.summary.setdefault(adapter, {})[part] = metrics
    return out

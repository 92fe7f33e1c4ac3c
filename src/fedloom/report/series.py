"""metrics.jsonl rows as series over rounds: what the figures draw and the tables list.

Row shapes (written by :mod:`fedloom.server`):

* ``train``: ``train_loss`` and ``per_client`` losses, ``bytes_down`` / ``bytes_up``, the
  sampled ``clients`` and ``failed`` ones; with privacy, ``epsilon`` (and ``delta``,
  ``privacy`` measurements such as ``clip_norm`` under DP-FedAvg; ``per_client_epsilon``
  under DP-SGD);
* ``global/dev``: one score per metric (tagged with ``backbone`` in a mixed federation);
* ``<adapter>/<part>`` (``global`` / ``personal`` x ``clients`` / ``clients_split`` /
  ``val`` / ``others``): ``metrics`` (per metric mean, p10, min, max, n) and
  ``per_client`` (client id -> its scores);
* ``diagnostics``: ``drift``, ``gradient``, ``label_js``;
* a method's own rows: ``clusters`` (``assignment``), ``relevance`` (``matrix`` over
  ``clients``), ``omega`` (MOCHA's Ω), ``mixture`` (FedEM's ``weights``), ``ranks``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedloom.report.rundata import RunData

#: adapters in the order a report shows them (baselines after the method's own; any other
#: adapter a run logs comes last)
ADAPTERS = ("global", "personal", "local", "majority", "zero_shot")
#: the parts of a client scope scored over rounds
CLIENT_PARTS = ("clients", "clients_split", "val")


def client_scopes(run: RunData) -> list[str]:
    """The ``<adapter>/<part>`` scopes with per-client scores over rounds the run logged
    (``part`` in :data:`CLIENT_PARTS`), by adapter (:data:`ADAPTERS` first), then part."""
    found = {
        str(row["scope"])
        for row in run.rows
        if isinstance(row.get("per_client"), dict)
        and str(row.get("scope", "")).partition("/")[2] in CLIENT_PARTS
    }

    def order(scope: str) -> tuple[int, str, int]:
        adapter, _, part = scope.partition("/")
        known = ADAPTERS.index(adapter) if adapter in ADAPTERS else len(ADAPTERS)
        return known, adapter, CLIENT_PARTS.index(part)

    return sorted(found, key=order)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if np.isfinite(value) else None


def p10(values: list[float | None]) -> float | None:
    """numpy's linear 10th percentile of the defined values (as the run's summaries)."""
    present = [v for v in values if v is not None]
    return float(np.percentile(present, 10, method="linear")) if present else None


def mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


@dataclass(frozen=True)
class ClientCurves:
    """One client scope (e.g. ``personal/clients``) over the rounds it was scored at."""

    scope: str
    rounds: list[int]
    #: metric -> client id -> its score at each of ``rounds`` (None where not scored)
    per_client: dict[str, dict[str, list[float | None]]]
    #: metric -> mean / p10 over the clients at each of ``rounds``
    mean: dict[str, list[float | None]]
    p10: dict[str, list[float | None]]


def client_curves(run: RunData) -> list[ClientCurves]:
    """Every client scope (:func:`client_scopes`) the run logged, metrics as
    :meth:`RunData.metric_names` orders them. The mean and p10 are the row's own where it
    has them (its task metrics), else computed alike (e.g. the loss)."""
    names = run.metric_names()
    out = []
    for scope in client_scopes(run):
        by_round = {int(row["round"]): row for row in run.scoped(scope) if "round" in row}
        if not by_round:
            continue
        rounds = sorted(by_round)
        clients = sorted(
            {c for row in by_round.values() for c in (row.get("per_client") or {})}, key=_order
        )
        per_client: dict[str, dict[str, list[float | None]]] = {}
        means: dict[str, list[float | None]] = {}
        p10s: dict[str, list[float | None]] = {}
        for metric in names:
            table = {c: [_score(by_round[r], c, metric) for r in rounds] for c in clients}
            if not any(v is not None for values in table.values() for v in values):
                continue
            per_client[metric] = table
            at = [[table[c][i] for c in clients] for i in range(len(rounds))]
            logged = [(by_round[r].get("metrics") or {}).get(metric) for r in rounds]
            means[metric] = [
                _number(s.get("mean")) if isinstance(s, dict) else mean(v)
                for s, v in zip(logged, at)
            ]
            p10s[metric] = [
                _number(s.get("p10")) if isinstance(s, dict) else p10(v) for s, v in zip(logged, at)
            ]
        if per_client:
            out.append(ClientCurves(scope, rounds, per_client, means, p10s))
    return out


def _score(row: Mapping[str, Any], client: str, metric: str) -> float | None:
    scores = (row.get("per_client") or {}).get(client)
    return _number(scores.get(metric)) if isinstance(scores, dict) else None


def _order(client: str) -> tuple[int, str]:
    return (int(client), "") if client.isdigit() else (1 << 30, client)


@dataclass(frozen=True)
class Curve:
    rounds: list[int]
    values: list[float | None]


def dev_curves(run: RunData) -> dict[str, dict[str, Curve]]:
    """``{"global/dev": {metric: Curve}}`` (one key per backbone in a mixed federation:
    ``"global/dev (tiny-bert)"``)."""
    out: dict[str, dict[str, Curve]] = {}
    for name in run.metric_names():
        for row in run.scoped("global/dev"):
            value = _number(row.get(name))
            if value is None or "round" not in row:
                continue
            label = "global/dev" + (f" ({row['backbone']})" if row.get("backbone") else "")
            curve = out.setdefault(label, {}).setdefault(name, Curve([], []))
            curve.rounds.append(int(row["round"]))
            curve.values.append(value)
    return out


@dataclass(frozen=True)
class TrainSeries:
    """The ``train`` rows: one entry per round."""

    rounds: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    #: client id -> its training loss at each round (None when not sampled / failed)
    loss_per_client: dict[str, list[float | None]] = field(default_factory=dict)
    bytes_down: list[float | None] = field(default_factory=list)
    bytes_up: list[float | None] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    #: the accountant's ε after each round (None for a run without privacy)
    epsilon: list[float | None] = field(default_factory=list)
    delta: list[float | None] = field(default_factory=list)
    #: DP-SGD: client id -> the ε its update reported, per round
    epsilon_per_client: dict[str, list[float | None]] = field(default_factory=dict)
    #: DP-FedAvg's clipping norm per round (adaptive clipping moves it)
    clip_norm: list[float | None] = field(default_factory=list)

    @property
    def has_privacy(self) -> bool:
        return any(e is not None for e in self.epsilon)

    @property
    def has_traffic(self) -> bool:
        return any(b is not None for b in (*self.bytes_down, *self.bytes_up))


def train_series(run: RunData) -> TrainSeries:
    rows = {int(row["round"]): row for row in run.scoped("train") if "round" in row}
    out = TrainSeries()
    clients = sorted(
        {c for row in rows.values() for c in (row.get("per_client") or {})}, key=_order
    )
    dp_clients = sorted(
        {c for row in rows.values() for c in (row.get("per_client_epsilon") or {})}, key=_order
    )
    for r in sorted(rows):
        row = rows[r]
        out.rounds.append(r)
        out.loss.append(_number(row.get("train_loss")))
        for c in clients:
            loss = (row.get("per_client") or {}).get(c)
            out.loss_per_client.setdefault(c, []).append(_number(loss))
        out.bytes_down.append(_number(row.get("bytes_down")))
        out.bytes_up.append(_number(row.get("bytes_up")))
        out.sampled.append(len(row.get("clients") or []))
        out.failed.append(len(row.get("failed") or []))
        out.epsilon.append(_number(row.get("epsilon")))
        out.delta.append(_number(row.get("delta")))
        for c in dp_clients:
            eps = (row.get("per_client_epsilon") or {}).get(c)
            out.epsilon_per_client.setdefault(c, []).append(_number(eps))
        measured = row.get("privacy")
        out.clip_norm.append(
            _number(measured.get("clip_norm")) if isinstance(measured, dict) else None
        )
    return out


def final_client_scores(run: RunData) -> dict[str, dict[str, dict[str, float]]]:
    """Each client scope's last row: ``{scope: {metric: {client: score}}}`` (clients whose
    score is undefined left out)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    names = run.metric_names()
    for scope in client_scopes(run):
        rows = list(run.scoped(scope))
        if not rows:
            continue
        last = rows[-1]
        for metric in names:
            scores = {
                c: v
                for c in sorted(last.get("per_client") or {}, key=_order)
                if (v := _score(last, c, metric)) is not None
            }
            if scores:
                out.setdefault(scope, {})[metric] = scores
    return out


@dataclass(frozen=True)
class Matrices:
    """A matrix over clients logged each round (FedMosaic's relevance S, MOCHA's Ω)."""

    rounds: list[int]
    clients: list[list[int]]
    matrices: list[np.ndarray]


def matrices(run: RunData, scope: str, key: str) -> dict[str, Matrices]:
    """``{tag: Matrices}`` of the rows of ``scope`` holding ``key`` (tag: the backbone of a
    mixed federation, else "")."""
    out: dict[str, Matrices] = {}
    for row in run.scoped(scope):
        matrix, clients = row.get(key), row.get("clients")
        if not isinstance(matrix, list) or not isinstance(clients, list) or "round" not in row:
            continue
        values = np.asarray(
            [[np.nan if v is None else v for v in line] for line in matrix], dtype=float
        )
        if values.shape != (len(clients), len(clients)):
            continue
        entry = out.setdefault(str(row.get("backbone", "")), Matrices([], [], []))
        entry.rounds.append(int(row["round"]))
        entry.clients.append([int(c) for c in clients])
        entry.matrices.append(values)
    return out


def by_round(run: RunData, scope: str, key: str) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """``{tag: [(round, row[key]), ...]}`` for a method's per-client rows (``clusters`` /
    ``assignment``, ``mixture`` / ``weights``, ``ranks`` / ``ranks``)."""
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for row in run.scoped(scope):
        if isinstance(row.get(key), dict) and "round" in row:
            out.setdefault(str(row.get("backbone", "")), []).append((int(row["round"]), row[key]))
    return out


def diagnostics_series(run: RunData) -> dict[str, dict[str, Any]]:
    """The ``diagnostics`` rows' client drift and gradient dissimilarity per round:
    ``{"drift": {"rounds", "mean", "max", "per_client"}, "gradient": {"rounds", "g2",
    "b2", ...}}`` with only what the run logged."""
    out: dict[str, dict[str, Any]] = {}
    rows = [row for row in run.scoped("diagnostics") if "round" in row]
    drift_rows = [row for row in rows if isinstance(row.get("drift"), dict)]
    if drift_rows:
        clients = sorted(
            {c for row in drift_rows for c in row["drift"].get("per_client") or {}}, key=_order
        )
        out["drift"] = {
            "rounds": [int(row["round"]) for row in drift_rows],
            "mean": [_number(row["drift"].get("mean")) for row in drift_rows],
            "max": [_number(row["drift"].get("max")) for row in drift_rows],
            "per_client": {
                c: [_number((row["drift"].get("per_client") or {}).get(c)) for row in drift_rows]
                for c in clients
            },
        }
    gradient_rows = [row for row in rows if isinstance(row.get("gradient"), dict)]
    if gradient_rows:
        keys = ("g2_debiased", "b2_debiased", "noise_share")
        out["gradient"] = {
            "rounds": [int(row["round"]) for row in gradient_rows],
            **{k: [_number(row["gradient"].get(k)) for row in gradient_rows] for k in keys},
        }
    return out

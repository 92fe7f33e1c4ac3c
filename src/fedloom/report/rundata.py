"""A run directory read into plain data, for reports and comparisons.

Reads what :mod:`fedloom.runtime.rundir` writes: ``config.toml`` (parsed, and its text),
``versions.json``, ``partition.json``, ``summary.json`` (absent while a run goes on),
``status.json`` and every row of ``metrics.jsonl``. Nothing is required but one of
``config.toml`` / ``metrics.jsonl``; a line of metrics.jsonl that does not parse (the
last one of a run killed mid-write) is skipped and noted.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ReportError(ValueError):
    """A path that cannot be reported on; ``str(err)`` is one line naming it."""


#: keys of a client's score dict (and of a dev row) that are not metrics
NOT_METRICS = frozenset({"n", "clients", "round", "scope", "backbone", "adapt_passes"})


@dataclass(frozen=True)
class RunData:
    path: Path
    #: config.toml parsed ({} without one) and as written
    config: dict[str, Any]
    config_text: str
    versions: dict[str, Any]
    partition: dict[str, Any] | None
    #: summary.json; None until the run finishes
    summary: dict[str, Any] | None
    #: status.json (see :func:`fedloom.runtime.rundir.read_status`)
    status: dict[str, Any] | None
    rows: list[dict[str, Any]]
    #: what could not be read, one line each
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str((self.summary or {}).get("name") or self.config.get("name") or self.path.name)

    @property
    def algorithm(self) -> str:
        return str(
            (self.summary or {}).get("algorithm")
            or self.config.get("algorithm", {}).get("name")
            or "?"
        )

    @property
    def state(self) -> str:
        """finished / running / interrupted / failed; "finished" for a run directory with a
        summary but no status file, "unknown" without either."""
        if self.status is not None:
            return str(self.status.get("state", "unknown"))
        return "finished" if self.summary is not None else "unknown"

    @property
    def main_metric(self) -> str | None:
        main = (self.summary or {}).get("main_metric")
        return str(main) if main else None

    def scoped(self, scope: str) -> Iterator[dict[str, Any]]:
        """The rows of one scope, in the order written."""
        return (row for row in self.rows if row.get("scope") == scope)

    def scopes(self) -> list[str]:
        """Every scope the rows have, in order of first appearance."""
        return list(dict.fromkeys(str(row.get("scope")) for row in self.rows))

    def metric_names(self) -> list[str]:
        """Every metric any evaluation row logged (dev rows and clients' scores): the main
        metric first, then the task's others in the order the rows list them, the loss last
        (a generative task's dev ``loss`` is its ``nll`` again)."""
        found: dict[str, None] = {}
        for row in self.rows:
            scope = str(row.get("scope", ""))
            if scope.endswith("/dev"):
                found |= dict.fromkeys(k for k, v in row.items() if _is_metric(k, v))
            elif isinstance(row.get("metrics"), dict):
                found |= dict.fromkeys(row["metrics"])
                for scores in (row.get("per_client") or {}).values():
                    if isinstance(scores, dict):
                        found |= dict.fromkeys(k for k, v in scores.items() if _is_metric(k, v))
        first = [m for m in (self.main_metric,) if m in found]
        last = [m for m in ("loss",) if m in found and m not in first]
        return first + [m for m in found if m not in first and m not in last] + last


def _is_metric(key: str, value: Any) -> bool:
    return key not in NOT_METRICS and isinstance(value, int | float) and not isinstance(value, bool)


def is_run_dir(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "config.toml").is_file()


def read_run(path: str | Path) -> RunData:
    """Read the run directory ``path``; :class:`ReportError` if it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: no such directory")
    if not is_run_dir(path):
        raise ReportError(f"{path}: not a run directory (no metrics.jsonl or config.toml)")
    notes: list[str] = []
    config_text = _text(path / "config.toml", notes)
    try:
        config = tomllib.loads(config_text) if config_text else {}
    except tomllib.TOMLDecodeError as err:
        notes.append(f"config.toml: unreadable ({err})")
        config = {}
    return RunData(
        path=path,
        config=config,
        config_text=config_text,
        versions=_json(path / "versions.json", notes) or {},
        partition=_json(path / "partition.json", notes),
        summary=_json(path / "summary.json", notes),
        status=_json(path / "status.json", notes),
        rows=_rows(path / "metrics.jsonl", notes),
        notes=notes,
    )


def _text(path: Path, notes: list[str]) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as err:
        notes.append(f"{path.name}: unreadable ({err})")
        return ""


def _json(path: Path, notes: list[str]) -> Any:
    text = _text(path, notes)
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        notes.append(f"{path.name}: unreadable ({err})")
        return None
    if not isinstance(value, dict):
        notes.append(f"{path.name}: not a JSON object")
        return None
    return value


def _rows(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(_text(path, notes).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            notes.append(f"metrics.jsonl: line {number} is not JSON (skipped)")
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows

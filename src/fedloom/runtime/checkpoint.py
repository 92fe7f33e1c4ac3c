"""Resumable checkpoints: everything a run needs to continue after a round.

    checkpoints/resume/round_NNNN/
        server.safetensors               every server state (one per backbone in a run
                                         within architecture): global, cluster and personal
                                         adapters the server keeps, optimizer moments,
                                         control variates, relevance EMAs
        clients/client_NNN.safetensors   every client's local state (optimizer moments,
                                         personal adapters, gates), as its runtime keeps it
        manifest.json                    the round; how long metrics.jsonl was then; the
                                         last evaluation's summary; the seconds run so far;
                                         the files of the checkpoint; the transform chain's
                                         server states and the rounds released under
                                         differential privacy

A checkpoint is written into a hidden ``.round_NNNN.tmp`` directory and renamed into place
when complete, so a kill mid-write leaves the previous checkpoint as the newest. Each
safetensors file carries a SHA-256 checksum (:func:`fedloom.runtime.rundir.save_params`),
so a damaged file is detected on loading, never loaded: the checkpoint before it is used
(``checkpoint.keep`` of them are kept). The random streams need no checkpoint: client
sampling, client seeds and diagnostics are drawn from generators seeded by (seed, round,
client) afresh every round.

Resuming truncates metrics.jsonl to its length at the checkpoint (rows of rounds after it
are written again) and continues the rounds; the run then ends with the metrics.jsonl and
summary.json an uninterrupted run writes (``wall_seconds`` counts the seconds of every
attempt).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedloom.algorithms import ServerState
from fedloom.runtime.client_state import load_client_state, save_client_state
from fedloom.runtime.rundir import CheckpointError, RunDir, atomic_write
from fedloom.runtime.state_file import load_state, save_state

RESUME_DIR = "resume"
MANIFEST = "manifest.json"
SERVER_FILE = "server.safetensors"
#: the transform chain's server states (:attr:`ResumePoint.chain_states`)
CHAIN_FILE = "chain.safetensors"


class ResumeError(ValueError):
    """A run cannot be resumed; ``str(err)`` names the run directory and why."""


@dataclass
class ResumePoint:
    """A run's state after ``round`` rounds."""

    round: int
    #: server states by key (:class:`fedloom.runtime.cohorts.Servers`)
    states: dict[str, ServerState]
    #: every client's local state (empty for clients that keep none)
    local_states: dict[int, dict[str, Any]]
    #: the summary of the last evaluation (what summary.json gets if no round is left)
    evaluation: dict[str, Any]
    #: seconds the run has spent in its rounds so far
    elapsed: float
    #: the length in bytes of metrics.jsonl after round ``round``
    metrics_bytes: int
    #: the transform chain's server states (the adaptive clipping norm)
    chain_states: list[Mapping[str, Any]] = field(default_factory=list)
    #: the rounds released under differential privacy (the accountant's ledger)
    releases: list[dict[str, Any]] = field(default_factory=list)


def _round_dirs(root: Path) -> list[Path]:
    """Complete checkpoint directories, newest first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("round_") and p.name[6:].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[6:]), reverse=True)


def save_point(run: RunDir, point: ResumePoint, keep: int) -> None:
    """Write ``point`` as ``checkpoints/resume/round_NNNN`` and keep the newest ``keep``."""
    root = run.checkpoints / RESUME_DIR
    name = f"round_{point.round:04d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_state(tmp / SERVER_FILE, point.states, {"round": str(point.round)})
    # the transforms' server states: numbers, and tensors (downlink references)
    save_state(tmp / CHAIN_FILE, [dict(state) for state in point.chain_states])
    clients = []
    for cid, state in sorted(point.local_states.items()):
        if state:
            clients.append(cid)
            save_client_state(
                tmp / "clients" / f"client_{cid:03d}.safetensors", state, point.round, cid
            )
    manifest = {
        "round": point.round,
        "metrics_bytes": point.metrics_bytes,
        "elapsed": point.elapsed,
        "evaluation": point.evaluation,
        "clients": sorted(point.local_states),
        "stateful_clients": clients,
        "releases": point.releases,
    }
    atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    final = root / name
    shutil.rmtree(final, ignore_errors=True)  # the same round again, after a resume
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in _round_dirs(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_dir(path: Path) -> ResumePoint:
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    states, _ = load_state(path / SERVER_FILE)
    stateful = set(manifest["stateful_clients"])
    local_states = {
        int(cid): (
            load_client_state(path / "clients" / f"client_{int(cid):03d}.safetensors")
            if cid in stateful
            else {}
        )
        for cid in manifest["clients"]
    }
    return ResumePoint(
        round=int(manifest["round"]),
        states=states,
        local_states=local_states,
        evaluation=manifest["evaluation"],
        elapsed=float(manifest["elapsed"]),
        metrics_bytes=int(manifest["metrics_bytes"]),
        chain_states=load_state(path / CHAIN_FILE)[0]
        if (path / CHAIN_FILE).is_file()
        else manifest.get("chain_states", []),
        releases=manifest.get("releases", []),
    )


def load_point(run: RunDir) -> tuple[ResumePoint, list[str]]:
    """The newest checkpoint that loads and verifies, and one line for each newer one that
    did not (damaged, partial); :class:`ResumeError` when none does."""
    skipped: list[str] = []
    for path in _round_dirs(run.checkpoints / RESUME_DIR):
        try:
            point = _load_dir(path)
        except (CheckpointError, OSError, KeyError, ValueError, TypeError) as err:
            skipped.append(f"{path}: not used ({type(err).__name__}: {err})")
            continue
        metrics = run.metrics_path.stat().st_size if run.metrics_path.is_file() else 0
        if metrics < point.metrics_bytes:
            skipped.append(
                f"{path}: not used (metrics.jsonl has {metrics} bytes, the "
                f"checkpoint was taken at {point.metrics_bytes})"
            )
            continue
        return point, skipped
    why = "; ".join(skipped) if skipped else "it has no checkpoints/resume/round_* directory"
    raise ResumeError(f"{run.path}: cannot resume: {why}")


def rewind_metrics(run: RunDir, point: ResumePoint) -> None:
    """Cut metrics.jsonl back to its length at ``point`` (the rows of later rounds go)."""
    run.metrics_path.touch()
    with run.metrics_path.open("r+b") as f:
        f.truncate(point.metrics_bytes)
        f.flush()
        os.fsync(f.fileno())

"""The run directory: ``runs/<name>-<timestamp>/``.

    config.toml      the resolved configuration (after --set overrides)
    partition.json   per-client sizes and label histograms
    metrics.jsonl    one JSON object per round and scope, appended and flushed as they come
    summary.json     the final numbers
    checkpoints/     global.safetensors, personal/client_<id>.safetensors
    run.log          the log
    status.json      running / finished / interrupted / failed, the last completed round,
                     timestamps and the error of a failed run (see RunDir.write_status)

Every file that is rewritten (checkpoints, summary) is written to a temporary file and
moved into place with ``os.replace``, so a crash mid-write never leaves a torn file and
the previous checkpoint stays valid until the new one is complete.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from datetime import datetime
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tomli_w
from safetensors.torch import load_file, save

from fedloom.params import Params


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask can only read by setting)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``.

    The file gets the mode a plain ``open(path, "w")`` gives (0o666 minus the umask), like
    the appended metrics.jsonl and run.log, not mkstemp's private 0o600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_params(path: Path, params: Params, metadata: Mapping[str, str] | None = None) -> None:
    """Atomically write ``params`` as safetensors."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in params.items()}
    atomic_write(path, save(tensors, metadata=dict(metadata or {})))


def load_params(path: Path) -> Params:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    return load_file(str(path))


#: the states of status.json; only "running" is not final
RUN_STATES = ("running", "finished", "interrupted", "failed")
STATUS_FILE = "status.json"


def read_status(run_dir: str | Path) -> dict[str, Any] | None:
    """A run directory's ``status.json`` (see :meth:`RunDir.write_status`), or None when
    there is none (a run directory from before status files, or no run directory).

    ``state == "running"`` means the run is going on, or its process died without a word
    (SIGKILL, power loss): then ``round`` is the last round it completed, and its
    checkpoints are from that round or an earlier one. An unreadable file reads as
    ``{"state": "unknown", "error": ...}``."""
    path = Path(run_dir) / STATUS_FILE
    try:
        status = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return {"state": "unknown", "error": f"{path}: unreadable ({err})"}
    if not isinstance(status, dict):
        return {"state": "unknown", "error": f"{path}: not a JSON object"}
    return status


def unfinished_warning(run_dir: str | Path) -> str | None:
    """One line warning that ``run_dir``'s run did not finish (None if it did, or if it
    has no status file), e.g. for ``fedloom eval`` to print before scoring."""
    status = read_status(run_dir)
    if status is None or status.get("state") == "finished":
        return None
    state, done, total = status.get("state"), status.get("round"), status.get("rounds")
    progress = f"after round {done}" + (f" of {total}" if total else "") if done is not None else ""
    if state == "running":
        what = f"has not finished (status 'running' {progress}: still going, or killed)"
    elif state == "failed":
        what = f"failed {progress}: {status.get('error')}"
    else:
        what = f"was {state} {progress}".rstrip()
    return f"run {Path(run_dir)} {what}; its checkpoints may be from an earlier round"


def check_output_dir(output_dir: str | Path) -> Path:
    """Fail early, before any model loads, unless run directories can be made under
    ``output_dir``: it is a writable directory, or can be created in one. Raises
    :class:`~fedloom.config.ConfigError` naming ``output_dir``."""
    from fedloom.config import ConfigError

    path = Path(output_dir)
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == path else f" (so {path} cannot be made)"
        raise ConfigError(f"output_dir: {existing} is a file, not a directory{where}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir: {existing} is not writable")
    return path


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


class RunDir:
    """Creates and writes one run directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.checkpoints = path / "checkpoints"
        self.metrics_path = path / "metrics.jsonl"
        #: what status.json holds (see :meth:`write_status`); {} before the first write
        self.status: dict[str, Any] = {}
        #: the last row appended to metrics.jsonl, per scope
        self.latest: dict[str, dict[str, Any]] = {}

    @classmethod
    def create(cls, output_dir: str | Path, name: str) -> RunDir:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(output_dir) / f"{name}-{stamp}"
        path, i = base, 1
        while path.exists():
            path = base.with_name(f"{base.name}-{i}")
            i += 1
        path.mkdir(parents=True)
        return cls(path)

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write(self.path / "config.toml", tomli_w.dumps(config).encode())

    def write_json(self, name: str, payload: Any) -> None:
        atomic_write(self.path / name, (json.dumps(payload, indent=2) + "\n").encode())

    def append_metrics(self, row: Mapping[str, Any]) -> None:
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
        self.latest[str(row.get("scope"))] = dict(row)

    def write_status(
        self, state: str, *, round_: int | None = None, rounds: int | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        """Atomically (re)write ``status.json``; returns what it holds::

            {"state": "running" | "finished" | "interrupted" | "failed",
             "round": 3,            # the last completed round (0: none yet)
             "rounds": 8,           # federation.rounds
             "started": "2026-11-22T13:00:00+01:00", "updated": "...",
             "ended": "..." | null, # set with a final state
             "error": "..." | null, # what made a run fail
             "pid": 1234, "host": "..."}

        ``round_`` and ``rounds`` keep their previous values unless given."""
        if state not in RUN_STATES:
            raise ValueError(f"unknown run state {state!r} (known: {', '.join(RUN_STATES)})")
        now = _now()
        previous = self.status
        self.status = {
            "state": state,
            "round": previous.get("round", 0) if round_ is None else round_,
            "rounds": previous.get("rounds") if rounds is None else rounds,
            "started": previous.get("started", now),
            "updated": now,
            "ended": None if state == "running" else now,
            "error": error,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        self.write_json(STATUS_FILE, self.status)
        return self.status

    @contextmanager
    def tracking(self, rounds: int) -> Iterator[RunDir]:
        """``status.json`` over a ``with`` block: running, then finished; failed (with the
        error) on an exception; interrupted on Ctrl-C. The exception goes on up."""
        self.write_status("running", rounds=rounds)
        try:
            yield self
        except KeyboardInterrupt:
            self._final_status("interrupted")
            raise
        except BaseException as err:
            self._final_status("failed", f"{type(err).__name__}: {err}")
            raise
        self.write_status("finished")

    def _final_status(self, state: str, error: str | None = None) -> None:
        try:
            self.write_status(state, error=error)
        except OSError:  # e.g. a full disk: the original error matters more
            pass

    def save_global(self, params: Params, round_: int) -> None:
        save_params(self.checkpoints / "global.safetensors", params, {"round": str(round_)})

    def save_personal(self, client_id: int, params: Params, round_: int) -> None:
        path = self.checkpoints / "personal" / f"client_{client_id:03d}.safetensors"
        save_params(path, params, {"round": str(round_), "client_id": str(client_id)})

    @contextmanager
    def logger(self) -> Iterator[logging.Logger]:
        """A logger appending to ``run.log`` for the duration of the ``with`` block."""
        log = logging.getLogger(f"fedloom.run.{self.path.name}")
        log.setLevel(logging.INFO)
        log.propagate = False
        handler = logging.FileHandler(self.path / "run.log", encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        try:
            yield log
        finally:
            log.removeHandler(handler)
            handler.close()

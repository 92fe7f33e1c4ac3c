"""The run directory: ``runs/<name>-<timestamp>/``.

    config.toml      the resolved configuration (after --set overrides)
    partition.json   per-client sizes and label histograms
    metrics.jsonl    one JSON object per round and scope, appended and flushed as they come
    summary.json     the final numbers
    checkpoints/     global.safetensors, personal/client_<id>.safetensors (each with a
                     SHA-256 checksum in its metadata), and the previous good ones:
                     global.prev.safetensors, personal.prev/client_<id>.safetensors
    run.log          the log
    status.json      running / finished / interrupted / failed, the last completed round,
                     timestamps and the error of a failed run (see RunDir.write_status)

Every file that is rewritten (checkpoints, summary) is written to a temporary file and
moved into place with ``os.replace``, so a crash mid-write never leaves a torn file and
the previous checkpoint stays valid until the new one is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import tomli_w
from safetensors.torch import load, save

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


#: safetensors metadata key of a checkpoint's checksum (see :func:`save_params`)
CHECKSUM_KEY = "fedloom.sha256"


class CheckpointError(ValueError):
    """A checkpoint file is damaged (empty, truncated, altered); ``str(err)`` is one line
    naming the file."""


def save_params(
    path: Path,
    params: Params,
    metadata: Mapping[str, str] | None = None,
    *,
    previous: Path | None = None,
) -> None:
    """Atomically write ``params`` as safetensors, with a SHA-256 checksum in the metadata.

    The checksum covers the header (every tensor's name, dtype, shape and offsets, and the
    other metadata) and the tensor bytes, so :func:`load_params` notices any truncation or
    changed bit. With ``previous``, the checkpoint being replaced is first kept there
    (hard-linked, or copied, then moved into place atomically) if it verifies, so a good
    fallback survives when the new file is later damaged.
    """
    tensors = {k: v.detach().contiguous().cpu() for k, v in params.items()}
    meta = {k: v for k, v in (metadata or {}).items() if k != CHECKSUM_KEY}
    header, payload = _split(path, save(tensors, metadata=meta))
    meta[CHECKSUM_KEY] = _digest(header, payload)
    blob = save(tensors, metadata=meta)
    if previous is not None:
        _keep_previous(path, previous)
    atomic_write(path, blob)


def load_params(path: Path) -> Params:
    """The tensors of a checkpoint, after checking its checksum.

    Raises ``FileNotFoundError`` when there is no file and :class:`CheckpointError`
    (one line naming the file) when it is damaged. Files without a checksum (written
    before checkpoints carried one) load if safetensors can parse them."""
    return load_checkpoint(path)[0]


def load_checkpoint(path: Path) -> tuple[Params, dict[str, str]]:
    """``(tensors, metadata)`` of a verified checkpoint (see :func:`load_params`); the
    metadata holds e.g. ``round`` and, for personal adapters, ``client_id``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    blob = path.read_bytes()
    header, payload = _split(path, blob)
    meta = dict(header.get("__metadata__") or {})
    expected = meta.pop(CHECKSUM_KEY, None)
    if expected is not None and _digest(header, payload) != expected:
        raise CheckpointError(
            f"{path}: damaged checkpoint (its SHA-256 checksum does not match its contents)"
        )
    try:
        tensors = load(blob)
    except Exception as err:  # noqa: BLE001 - safetensors raises its own types for malformed files
        raise CheckpointError(f"{path}: damaged checkpoint ({err})") from None
    return tensors, meta


def checkpoint_metadata(path: Path) -> dict[str, str]:
    """The metadata of a checkpoint's header, without verifying the tensors (e.g. the
    round of a file whose tensor bytes are damaged); {} when the header is unreadable."""
    try:
        header = _header(Path(path), Path(path).read_bytes())
    except (OSError, CheckpointError):
        return {}
    meta = header.get("__metadata__")
    return {k: v for k, v in meta.items() if k != CHECKSUM_KEY} if isinstance(meta, dict) else {}


def _header(path: Path, blob: bytes) -> dict[str, Any]:
    """A safetensors file's JSON header; CheckpointError if it cannot be read."""
    if not blob:
        raise CheckpointError(f"{path}: damaged checkpoint (the file is empty)")
    if len(blob) < 8:
        raise CheckpointError(f"{path}: damaged checkpoint (truncated: {len(blob)} bytes)")
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise CheckpointError(
            f"{path}: damaged checkpoint (truncated or altered: its header alone needs "
            f"{size + 8} bytes, the file has {len(blob)})"
        )
    try:
        header = json.loads(blob[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: damaged checkpoint (unreadable header)")
    return header


def _split(path: Path, blob: bytes) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's JSON header and tensor bytes; CheckpointError if it cannot be."""
    header = _header(path, blob)
    payload = blob[8 + int.from_bytes(blob[:8], "little") :]
    try:
        needed = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0
        )
    except (TypeError, KeyError, IndexError, ValueError):
        raise CheckpointError(f"{path}: damaged checkpoint (unreadable header)") from None
    if len(payload) < needed:
        raise CheckpointError(
            f"{path}: damaged checkpoint (truncated: {len(payload)} of {needed} tensor bytes)"
        )
    return header, payload


def _digest(header: Mapping[str, Any], payload: bytes) -> str:
    """SHA-256 of the canonical header (without the checksum itself) and the tensor bytes."""
    canonical = dict(header)
    meta = {
        k: v for k, v in (canonical.pop("__metadata__", None) or {}).items() if k != CHECKSUM_KEY
    }
    if meta:
        canonical["__metadata__"] = meta
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())
    digest.update(b"\0")
    digest.update(payload)
    return digest.hexdigest()


def _keep_previous(path: Path, previous: Path) -> None:
    """Move a copy of the good checkpoint at ``path`` to ``previous`` atomically."""
    if not path.is_file():
        return
    try:
        load_checkpoint(path)
    except CheckpointError:
        return  # a damaged file must not replace the good fallback
    previous.parent.mkdir(parents=True, exist_ok=True)
    tmp = previous.with_name(f".{previous.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        try:
            os.link(path, tmp)
        except OSError:  # no hard links here: copy
            atomic_write(tmp, path.read_bytes())
        os.replace(tmp, previous)
    finally:
        tmp.unlink(missing_ok=True)


def previous_checkpoint(path: Path) -> Path:
    """Where :class:`RunDir` keeps the checkpoint before ``path``:
    ``global.safetensors`` -> ``global.prev.safetensors``,
    ``personal/client_003.safetensors`` -> ``personal.prev/client_003.safetensors`` (and
    ``clusters/`` -> ``clusters.prev/``)."""
    if path.parent.name in ("personal", "clusters") or path.parent.name.startswith("clusters-"):
        return path.parent.with_name(f"{path.parent.name}.prev") / path.name
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_personal(checkpoints: Path, client_id: int, params: Params, round_: int) -> None:
    """Client ``client_id``'s adapter after ``round_`` as
    ``checkpoints/personal/client_NNN.safetensors`` (its round and client id in the
    metadata); the one it replaces moves to ``personal.prev/``. The server writes it into
    its run directory in a simulation, a Flower node into its own folder."""
    path = checkpoints / "personal" / f"client_{client_id:03d}.safetensors"
    save_params(
        path,
        params,
        {"round": str(round_), "client_id": str(client_id)},
        previous=previous_checkpoint(path),
    )


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


def finite_json(payload: Any, path: str = "") -> tuple[Any, list[str]]:
    """``payload`` with every non-finite float (NaN, ±inf) replaced by None, so that it is
    strict JSON (null), and the dotted keys of those values."""
    if isinstance(payload, float) and not math.isfinite(payload):
        return None, [path or "<value>"]
    if isinstance(payload, Mapping):
        clean, bad = {}, []
        for key, value in payload.items():
            clean[key], found = finite_json(value, f"{path}.{key}" if path else str(key))
            bad += found
        return clean, bad
    if isinstance(payload, (list, tuple)):
        items = [finite_json(v, f"{path}[{i}]") for i, v in enumerate(payload)]
        return [v for v, _ in items], [b for _, found in items for b in found]
    return payload, []


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

    def write_jsonl(self, name: str, records: list[Any]) -> None:
        """Strict JSON lines, one record a line, written at once (:meth:`write_json`'s
        rule for non-finite numbers)."""
        lines = [json.dumps(self._strict(r, name), allow_nan=False) + "\n" for r in records]
        atomic_write(self.path / name, "".join(lines).encode())

    def write_json(self, name: str, payload: Any) -> None:
        """Strict JSON: a non-finite number is written as null, with a warning in run.log."""
        payload = self._strict(payload, name)
        atomic_write(
            self.path / name, (json.dumps(payload, indent=2, allow_nan=False) + "\n").encode()
        )

    def append_metrics(self, row: Mapping[str, Any]) -> None:
        line = json.dumps(self._strict(row, "metrics.jsonl"), sort_keys=True, allow_nan=False)
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
        self.latest[str(row.get("scope"))] = dict(row)

    def _strict(self, payload: Any, where: str) -> Any:
        clean, bad = finite_json(payload)
        if bad:
            logging.getLogger(f"fedloom.run.{self.path.name}").warning(
                "%s: non-finite values written as null: %s", where, ", ".join(bad)
            )
        return clean

    def write_status(
        self,
        state: str,
        *,
        round_: int | None = None,
        rounds: int | None = None,
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

    def save_global(self, params: Params, round_: int, backbone: str | None = None) -> None:
        """``checkpoints/global.safetensors`` (a backbone's in a mixed federation:
        ``global-<backbone>.safetensors``); the one it replaces becomes
        ``global.prev.safetensors``."""
        path = self.checkpoints / (
            "global.safetensors" if backbone is None else f"global-{backbone}.safetensors"
        )
        save_params(path, params, {"round": str(round_)}, previous=previous_checkpoint(path))

    def save_personal(self, client_id: int, params: Params, round_: int) -> None:
        """``checkpoints/personal/client_NNN.safetensors``; the one it replaces moves to
        ``personal.prev/``."""
        save_personal(self.checkpoints, client_id, params, round_)

    def save_cluster(
        self, cluster: int, params: Params, round_: int, backbone: str | None = None
    ) -> None:
        """``checkpoints/clusters/cluster_NN.safetensors`` (a clustered method's server
        adapters; ``clusters-<backbone>/`` per backbone in a mixed federation); the one it
        replaces moves to ``clusters.prev/``."""
        folder = "clusters" if backbone is None else f"clusters-{backbone}"
        path = self.checkpoints / folder / f"cluster_{cluster:02d}.safetensors"
        save_params(
            path,
            params,
            {"round": str(round_), "cluster": str(cluster)},
            previous=previous_checkpoint(path),
        )

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

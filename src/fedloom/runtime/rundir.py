"""The run directory: ``runs/<name>-<timestamp>/``.

    config.toml      the resolved configuration (after --set overrides)
    partition.json   per-client sizes and label histograms
    metrics.jsonl    one JSON object per round and scope, appended and flushed as they come
    summary.json     the final numbers
    checkpoints/     global.safetensors, personal/client_<id>.safetensors
    run.log          the log

Every file that is rewritten (checkpoints, summary) is written to a temporary file and
moved into place with ``os.replace``, so a crash mid-write never leaves a torn file and
the previous checkpoint stays valid until the new one is complete.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tomli_w
from safetensors.torch import load_file, save

from fedloom.params import Params


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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


class RunDir:
    """Creates and writes one run directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.checkpoints = path / "checkpoints"
        self.metrics_path = path / "metrics.jsonl"

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

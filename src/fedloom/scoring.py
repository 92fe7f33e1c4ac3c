"""Scoring a finished run's saved adapters on any labeled data (``fedloom eval``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fedloom.config import ConfigError, load_config
from fedloom.data import DataError, Example, TaskSpec, get_task, load_glue, load_table, summarize
from fedloom.federation import resolve_task
from fedloom.models.fedmodel import FedModel
from fedloom.runtime.rundir import load_params
from fedloom.train.evaluate import evaluate

_CLIENT_FILE = re.compile(r"client_(\d+)\.safetensors$")


def load_examples(
    data: Path, task: TaskSpec, split: str, text_fields: list[str], label_field: str,
    label_names: list[str] | None,
) -> list[Example]:
    """A GLUE directory (``<dir>/<TASK>/<split>.tsv`` or ``<task dir>/<split>.tsv``), a GLUE
    ``.tsv`` file of the task, or a ``.jsonl``/``.csv`` file with named fields."""
    if not data.exists():
        raise DataError(f"--data: {data} does not exist")
    if data.is_dir():
        return load_glue(task, split, data)
    if data.suffix == ".tsv":
        return load_glue(task, data.stem, data.parent)
    return load_table(data, text_fields, label_field, label_names or list(task.label_names) or None)


def score_run(
    run_dir: Path, data: Path, *, task: str | None = None, split: str = "dev",
    personal: bool = False, batch_size: int = 64, text_fields: list[str] | None = None,
    label_field: str | None = None,
) -> dict[str, Any]:
    """Metrics of the run's global (and with ``personal``, every client's) adapter on
    ``data``; JSONL/CSV fields default to the ones the run was configured with."""
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.toml)")
    cfg = load_config(config_path)
    if cfg.partition.tasks is not None and task is None:
        raise ConfigError(
            f"{run_dir}: a multi-task run (partition.tasks) has a union label space; "
            "pass --task to score its adapter on one task's data"
        )
    try:
        spec = get_task(task) if task else resolve_task(cfg.data)
    except ConfigError:
        raise
    except ValueError as err:  # an unknown --task
        raise ConfigError(f"--task: {err}") from None
    checkpoints = run_dir / "checkpoints"
    global_path = checkpoints / "global.safetensors"
    personal_paths = sorted((checkpoints / "personal").glob("client_*.safetensors"))
    if not global_path.is_file() and not (personal and personal_paths):
        raise FileNotFoundError(f"{global_path}: no global adapter in this run")
    if personal and not personal_paths:
        raise FileNotFoundError(f"{checkpoints / 'personal'}: this run saved no personal adapters")
    examples = load_examples(
        data, spec, split, text_fields or cfg.data.text_fields,
        label_field or cfg.data.label_field, cfg.data.label_names,
    )
    if not examples:
        raise DataError(f"{data}: no examples")
    model = FedModel.build(cfg.model, spec, cfg.data.max_length, cfg.seed)
    features = model.encode(examples)
    result: dict[str, Any] = {}
    if global_path.is_file():
        result["global"] = evaluate(model, load_params(global_path), features, batch_size)
    if personal:
        per = {}
        for path in personal_paths:
            cid = int(_CLIENT_FILE.search(path.name).group(1))
            per[str(cid)] = evaluate(model, load_params(path), features, batch_size)
        result["personal"] = {
            "clients": per,
            "summary": {m: summarize([v[m] for v in per.values()]) for m in spec.metrics},
        }
    return result

"""Scoring a finished run's saved adapters on any labeled data (``fedloom eval``), in the
label space they were trained for (:mod:`fedloom.evaluation.run_task`), on data checked to
fit the run (:mod:`fedloom.evaluation.run_data`).

Checkpoints are verified against their checksum; when the newest one is damaged (empty,
truncated, altered) the previous good one (``global.prev.safetensors``,
``personal.prev/``) is used and a warning says so. Every call also reports which round
the checkpoint is from and whether the run finished (``status.json``/``summary.json``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedloom.config import ConfigError, ExperimentConfig, load_config
from fedloom.data import summarize
from fedloom.data.examples import Example
from fedloom.evaluation.run_data import load_examples
from fedloom.evaluation.run_task import RunTask, run_task
from fedloom.evaluation.score import evaluate
from fedloom.experiment import align_backbones, backbones
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature
from fedloom.params import Params
from fedloom.runtime.rundir import (
    CheckpointError,
    checkpoint_metadata,
    load_checkpoint,
    previous_checkpoint,
    read_status,
)
from fedloom.train.mixture import evaluate_mixture, is_mixture

_CLIENT_FILE = re.compile(r"client_(\d+)\.safetensors")

#: receives every line ``fedloom eval`` says on stderr; warnings start with "warning: "
Notify = Callable[[str], None]

_log = logging.getLogger("fedloom.scoring")


def _default_notify(message: str) -> None:
    if message.startswith("warning: "):
        _log.warning(message.removeprefix("warning: "))
    else:
        _log.info(message)


def describe_run_state(run_dir: Path, cfg: ExperimentConfig) -> tuple[bool, str]:
    """(finished, a phrase about the run's state) from status.json, else summary.json."""
    status = read_status(run_dir)
    if status is not None:
        state = status.get("state")
        total = status.get("rounds") or cfg.federation.rounds
        done = f"{status.get('round', '?')} of {total} rounds"
        if state == "finished":
            return True, f"the run finished ({done})"
        detail = f"; {status['error']}" if status.get("error") else ""
        return False, f"the run is not finished (status.json: {state!r}, {done} completed{detail})"
    if (run_dir / "summary.json").is_file():
        return True, f"the run finished ({cfg.federation.rounds} rounds; summary.json)"
    return False, "the run has no status.json or summary.json: it may not have finished"


def load_verified(path: Path, notify: Notify) -> tuple[Params, str, Path]:
    """(tensors, round, the file used): ``path``, or its previous good checkpoint when
    ``path`` is damaged or missing, with a warning naming both files and rounds."""
    try:
        params, meta = load_checkpoint(path)
        return params, meta.get("round", "?"), path
    except (CheckpointError, FileNotFoundError) as err:
        problem = str(err)
    previous = previous_checkpoint(path)
    try:
        params, meta = load_checkpoint(previous)
    except FileNotFoundError:
        raise CheckpointError(
            f"{problem}; there is no previous checkpoint to fall back on"
        ) from None
    except CheckpointError as err:
        raise CheckpointError(f"{problem}; the previous one is damaged too: {err}") from None
    damaged_round = checkpoint_metadata(path).get("round", "unknown")
    round_ = meta.get("round", "?")
    notify(
        f"warning: {problem}; using the previous good checkpoint {previous} (round {round_}) "
        f"instead of {path.name} (round {damaged_round})"
    )
    return params, round_, previous


def _score(
    model: FedModel, params: Params, path: Path, features: list, batch_size: int
) -> dict[str, float | None]:
    try:
        if is_mixture(params):  # a FedEM client's mixture of component adapters
            return evaluate_mixture(model, params, features, batch_size)
        return evaluate(model, params, features, batch_size)
    except (KeyError, ValueError) as err:
        detail = str(err.args[0]) if err.args else ""
        if not detail.startswith("adapter"):  # FedModel.set_params: names or shapes differ
            raise
        raise CheckpointError(f"{path}: does not fit the run's model ({detail})") from None


def scoring_models(
    run_dir: Path, cfg: ExperimentConfig, run: RunTask, examples: list[Example]
) -> Callable[[str], tuple[FedModel, list[Feature]]]:
    """The run's model for a backbone, with ``examples`` encoded for it, each built once on
    its first request. A mixed-backbone FedMosaic run's models are rebuilt with the PQ-LoRA
    factors aligned before its training (kept in the run's ``alignment`` folder)."""

    def build(backbone: str) -> FedModel:
        return FedModel.build(
            cfg.model.for_backbone(backbone),
            run.spec,
            cfg.data.max_length,
            cfg.seed,
            truncate_responses=cfg.data.truncate_responses,
            generation=cfg.eval.generation,
        )

    built: dict[str, tuple[FedModel, list[Feature]]] = {}
    if cfg.model.groups and cfg.model.adapters == "mosaic" and cfg.model.alignment.texts:
        folder = run_dir / "alignment"
        if not folder.is_dir():
            raise CheckpointError(
                f"{folder}: missing; this mixed-backbone run's aligned PQ-LoRA "
                "factors are needed to rebuild its models"
            )
        models = {b: build(b) for b in backbones(cfg)}
        align_backbones(cfg, models, folder)
        built = {b: (m, m.encode(examples)) for b, m in models.items()}

    def model_for(backbone: str) -> tuple[FedModel, list[Feature]]:
        if backbone not in built:
            model = build(backbone)
            built[backbone] = (model, model.encode(examples))
        return built[backbone]

    return model_for


def score_run(
    run_dir: Path,
    data: Path,
    *,
    task: str | None = None,
    split: str = "dev",
    personal: bool = False,
    batch_size: int = 64,
    text_fields: list[str] | None = None,
    label_field: str | None = None,
    fmt: str | None = None,
    notify: Notify | None = None,
) -> dict[str, Any]:
    """Metrics of the run's global (and with ``personal``, every client's) adapter on
    ``data``; JSONL/CSV fields default to the ones the run was configured with.

    ``notify`` receives what ``fedloom eval`` prints on stderr: the checkpoint's round
    and the run's state, and warnings (unfinished run, a fallback to the previous
    checkpoint). Raises ConfigError/DataError for data that do not fit the run,
    CheckpointError for damaged checkpoints without a good fallback."""
    notify = notify or _default_notify
    run_dir, data = Path(run_dir), Path(data)
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.toml)")
    cfg = load_config(config_path)
    run = run_task(cfg, task)
    checkpoints = run_dir / "checkpoints"
    # one global adapter, or one per backbone of a mixed federation run within architecture
    globals_: dict[str | None, Path] = {
        None: checkpoints / "global.safetensors",
        **{g.backbone: checkpoints / f"global-{g.backbone}.safetensors" for g in cfg.model.groups},
        **(
            {cfg.model.backbone: checkpoints / f"global-{cfg.model.backbone}.safetensors"}
            if cfg.model.groups
            else {}
        ),
    }
    globals_ = {
        b: path
        for b, path in globals_.items()
        if path.is_file() or previous_checkpoint(path).is_file()
    }
    global_path = checkpoints / "global.safetensors"
    personal_ids = sorted(
        {
            int(m.group(1))
            for folder in ("personal", "personal.prev")
            for p in (checkpoints / folder).glob("client_*.safetensors")
            if (m := _CLIENT_FILE.fullmatch(p.name))
        }
    )
    if not globals_ and not (personal and personal_ids):
        raise FileNotFoundError(f"{global_path}: no global adapter in this run")
    if personal and not personal_ids:
        raise FileNotFoundError(f"{checkpoints / 'personal'}: this run saved no personal adapters")
    examples = load_examples(
        data, run, split=split, text_fields=text_fields, label_field=label_field, fmt=fmt
    )
    finished, state = describe_run_state(run_dir, cfg)
    # (name, params, round, file, backbone)
    adapters: list[tuple[str, Params, str, Path, str]] = []
    for backbone, path in globals_.items():
        params, round_, used = load_verified(path, notify)
        adapters.append(("global", params, round_, used, backbone or cfg.model.backbone))
    if personal:
        for cid in personal_ids:
            path = checkpoints / "personal" / f"client_{cid:03d}.safetensors"
            params, round_, used = load_verified(path, notify)
            adapters.append((str(cid), params, round_, used, cfg.model.backbone_of(cid)))
    rounds = sorted({a[2] for a in adapters}, key=lambda r: (len(r), r))
    what = f"{adapters[0][3].name}" if len(adapters) == 1 else f"{len(adapters)} checkpoints"
    line = f"{what} from round {', '.join(rounds)} of {cfg.federation.rounds}; {state}"
    notify(line if finished else f"warning: {line}")
    model_for = scoring_models(run_dir, cfg, run, examples)
    result: dict[str, Any] = {}
    per: dict[str, dict[str, float | None]] = {}
    for name, params, _, used, backbone in adapters:
        model, features = model_for(backbone)
        scores = _score(model, params, used, features, batch_size)
        if name != "global":
            per[name] = scores
        elif cfg.model.groups:
            result.setdefault("global_by_backbone", {})[backbone] = scores
        else:
            result["global"] = scores
    if personal:
        result["personal"] = {
            "clients": per,
            "summary": {m: summarize([v[m] for v in per.values()]) for m in run.spec.metrics},
        }
    return result

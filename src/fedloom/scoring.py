"""Scoring a finished run's saved adapters on any labeled data (``fedloom eval``).

The run's ``config.toml`` says what its adapters were trained for: the task (label space
and metrics), how many texts an example has, and which fields of a JSONL/CSV file hold
them. Data that do not fit the run are refused with one line naming both sides (another
GLUE task, a single-sentence file for a sentence-pair task, a label outside the run's
label space, GLUE files for a custom-data run) instead of being scored into a silently
wrong number.

Checkpoints are verified against their checksum; when the newest one is damaged (empty,
truncated, altered) the previous good one (``global.prev.safetensors``,
``personal.prev/``) is used and a warning says so. Every call also reports which round
the checkpoint is from and whether the run finished (``status.json``/``summary.json``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedloom.config import ConfigError, ExperimentConfig, load_config
from fedloom.data import DataError, Example, TaskSpec, get_task, load_glue, load_table, summarize
from fedloom.data.glue import glue_file_task, glue_text_fields, read_glue_tsv
from fedloom.data.tables import table_format
from fedloom.experiment import align_backbones, backbones
from fedloom.federation import resolve_task, tag_example, union_task
from fedloom.models.fedmodel import FedModel
from fedloom.params import Params
from fedloom.runtime.rundir import (
    CheckpointError,
    checkpoint_metadata,
    load_checkpoint,
    previous_checkpoint,
    read_status,
)
from fedloom.train.evaluate import evaluate
from fedloom.train.mixture import evaluate_mixture, is_mixture

_CLIENT_FILE = re.compile(r"client_(\d+)\.safetensors")

#: values of ``--format``: GLUE's layout for the run's task, or a table with named fields
FORMATS = ("glue", "jsonl", "csv", "tsv")

#: receives every line ``fedloom eval`` says on stderr; warnings start with "warning: "
Notify = Callable[[str], None]

_log = logging.getLogger("fedloom.scoring")


def _default_notify(message: str) -> None:
    if message.startswith("warning: "):
        _log.warning(message.removeprefix("warning: "))
    else:
        _log.info(message)


@dataclass(frozen=True)
class RunTask:
    """What a run's adapters were trained for, as far as scoring data is concerned."""

    spec: TaskSpec  # the label space of the model's head
    data_spec: TaskSpec  # the task of the data to score (a multi-task run: one of its tasks)
    offset: int  # multi-task runs: where data_spec's labels start in spec's
    glue: bool  # data_spec is a GLUE task (its files have GLUE's layout)
    text_fields: tuple[str, ...]  # the run's configured JSONL/CSV text fields
    label_field: str

    @property
    def num_texts(self) -> int:
        """1 for single texts, 2 for pairs."""
        return len(glue_text_fields(self.data_spec)) if self.glue else len(self.text_fields)

    def describe(self) -> str:
        spec = self.data_spec
        labels = f"labels {list(spec.label_names)}" if spec.label_names else "a numeric label"
        if self.glue:
            kind = "sentence pairs" if self.num_texts == 2 else "single sentences"
            return f"{spec.name} ({kind}, {labels})"
        return (
            f"the custom task {spec.name!r} (text field(s) {list(self.text_fields)}, "
            f"label field {self.label_field!r}, {labels})"
        )


def run_task(cfg: ExperimentConfig, task: str | None = None) -> RunTask:
    """The run's task; ``task`` (``--task``) must be it, or one task of a multi-task run."""
    fields, label = tuple(cfg.data.text_fields), cfg.data.label_field
    if cfg.partition.tasks is not None:
        specs = [get_task(name) for name in cfg.partition.tasks.names]
        names = [s.name for s in specs]
        if task is None:
            raise ConfigError(
                f"--task: this multi-task run ({', '.join(names)}) has a union label space; "
                "pass --task to score its adapter on one task's data"
            )
        chosen = _glue_task(task)
        if chosen.name not in names:
            raise ConfigError(
                f"--task {task}: the run was trained on the tasks {names}, not {chosen.name}"
            )
        index = names.index(chosen.name)
        offset = sum(s.num_labels for s in specs[:index])
        return RunTask(union_task(specs), chosen, offset, True, fields, label)
    spec = resolve_task(cfg.data)
    glue = spec.name in _glue_names()
    run = RunTask(spec, spec, 0, glue, fields, label)
    if task is not None:
        if not glue and _same_name(task, spec.name):
            return run
        try:
            other = get_task(task)
        except ValueError as err:
            if glue:
                raise ConfigError(f"--task: {err}") from None
            raise ConfigError(
                f"--task {task}: the run was trained on {run.describe()}; leave --task out"
            ) from None
        if other.name != spec.name:
            raise ConfigError(
                f"--task {task}: the run was trained on {run.describe()}, not {other.name}; "
                f"its adapter cannot score {other.name} data"
            )
    return run


def _glue_task(name: str) -> TaskSpec:
    try:
        return get_task(name)
    except ValueError as err:
        raise ConfigError(f"--task: {err}") from None


def _glue_names() -> set[str]:
    from fedloom.data import TASKS

    return set(TASKS)


def _same_name(a: str, b: str) -> bool:
    return a.strip().lower() == b.strip().lower()


# --- data -----------------------------------------------------------------------------


def load_examples(
    data: Path,
    run: RunTask,
    *,
    split: str = "dev",
    text_fields: list[str] | None = None,
    label_field: str | None = None,
    fmt: str | None = None,
) -> list[Example]:
    """Labeled examples of ``data`` in the run's label space, or a one-line refusal.

    ``data`` is a GLUE directory (``<dir>/<TASK>/<split>.tsv`` or the task folder), a file
    in the run's GLUE layout whatever its name or extension (``dev.tsv``,
    ``msr_paraphrase_test.txt``), or a JSONL/CSV/TSV table with named fields. ``fmt``
    (``--format``) says which when the extension does not: ``.jsonl``/``.json`` and
    ``.csv`` are tables, ``.tsv`` and other extensions GLUE's layout for a GLUE task; a
    custom task's data are tables."""
    data = Path(data)
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not data.exists():
        raise DataError(f"--data: {data} does not exist")
    spec = run.data_spec
    if data.is_dir():
        if fmt not in (None, "glue"):
            raise DataError(f"--format {fmt}: {data} is a directory, not a {fmt} file")
        if not run.glue:
            raise DataError(
                f"--data {data}: a directory is read as GLUE data, but the run was trained on "
                f"{run.describe()}; pass a .jsonl/.csv/.tsv file of it"
            )
        _check_folder(data, data, run)
        examples = _loading(lambda: load_glue(spec, split, data), run)
    else:
        form = fmt or _implied_format(data, run)
        if form == "glue":
            if not run.glue:
                raise DataError(
                    f"--data {data}: GLUE's layout, but the run was trained on {run.describe()}; "
                    "pass a table with its fields (--format jsonl, csv or tsv)"
                )
            _check_folder(data.parent, data, run)
            hint = "" if fmt else "; a table with named columns needs --format tsv"
            examples = _loading(lambda: read_glue_tsv(spec, data), run, hint)
        else:
            other = glue_file_task(data) if form == "tsv" and not run.glue else None
            if other is not None:
                raise DataError(
                    f"--data {data}: a GLUE {other} file, but the run was trained on "
                    f"{run.describe()}"
                )
            fields = _text_fields(run, text_fields)
            label = label_field or run.label_field
            examples = _loading(lambda: load_table(data, fields, label, task=spec, fmt=form), run)
    if not examples:
        raise DataError(f"{data}: no examples")
    if run.spec is not run.data_spec:  # a multi-task run: its inputs carry the task name
        examples = [tag_example(e, spec, run.offset) for e in examples]
    return examples


def _implied_format(path: Path, run: RunTask) -> str:
    form = table_format(path)
    if form in ("jsonl", "csv"):
        return form
    if run.glue:
        return "glue"
    if form == "tsv":
        return "tsv"
    raise DataError(
        f"--data {path}: cannot tell its format from the extension {path.suffix!r}; "
        "pass --format jsonl, csv or tsv"
    )


def _check_folder(folder: Path, data: Path, run: RunTask) -> None:
    """Refuse files kept in another GLUE task's folder (``glue/SST-2/dev.tsv``)."""
    try:
        other = get_task(folder.name)
    except ValueError:
        return
    if other.name != run.data_spec.name:
        raise DataError(
            f"--data {data}: {other.name} data (in a {folder.name} folder), but the run was "
            f"trained on {run.describe()}"
        )


def _text_fields(run: RunTask, given: list[str] | None) -> list[str]:
    fields = list(given or run.text_fields)
    if len(fields) != run.num_texts:
        source = "--text-fields" if given else "the run's data.text_fields"
        want = "A,B" if run.num_texts == 2 else "A"
        hub = ",".join(glue_text_fields(run.data_spec)) if run.glue else None
        raise DataError(
            f"{source} {fields}: {len(fields)} text field(s), but the run was trained on "
            f"{run.describe()}, {run.num_texts} text(s) per example; pass --text-fields {want}"
            + (f" (the hub's names: {hub})" if hub else "")
        )
    return fields


def _loading(load: Callable[[], list[Example]], run: RunTask, hint: str = "") -> list[Example]:
    try:
        return load()
    except DataError as err:
        message = str(err)
        if hint and ", line 1:" not in message:
            hint = ""
        raise DataError(f"{message}{hint}; the run was trained on {run.describe()}") from None


# --- checkpoints and the run's status ---------------------------------------------------


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
    built: dict[str, tuple[FedModel, list]] = {}
    if cfg.model.groups and cfg.model.adapters == "mosaic" and cfg.model.alignment.texts:
        # FedMosaic's models carry PQ-LoRA factors aligned before training: the run keeps them
        folder = run_dir / "alignment"
        if not folder.is_dir():
            raise CheckpointError(
                f"{folder}: missing; this mixed-backbone run's aligned PQ-LoRA "
                "factors are needed to rebuild its models"
            )
        models = {
            b: FedModel.build(cfg.model.for_backbone(b), run.spec, cfg.data.max_length, cfg.seed)
            for b in backbones(cfg)
        }
        align_backbones(cfg, models, folder)
        built = {b: (m, m.encode(examples)) for b, m in models.items()}
    result: dict[str, Any] = {}
    per: dict[str, dict[str, float | None]] = {}
    for name, params, _, used, backbone in adapters:
        if backbone not in built:
            model = FedModel.build(
                cfg.model.for_backbone(backbone), run.spec, cfg.data.max_length, cfg.seed
            )
            built[backbone] = (model, model.encode(examples))
        model, features = built[backbone]
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

"""What a finished run's adapters were trained for (:class:`RunTask`), read from its
``config.toml``: the task (label space and metrics), how many texts an example has, and
which fields of a JSONL/CSV file hold them; ``fedloom eval --task`` is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedloom.config import ConfigError, ExperimentConfig
from fedloom.data import TaskSpec, get_task
from fedloom.data.glue import glue_text_fields
from fedloom.federation import multi_task, resolve_task, scored_task, union_task


@dataclass(frozen=True)
class RunTask:
    """What a run's adapters were trained for, as far as scoring data is concerned."""

    spec: TaskSpec  # the label space of the model's head
    data_spec: TaskSpec  # the task of the data to score (a multi-task run: one of its tasks)
    offset: int  # multi-task runs: where data_spec's labels start in spec's
    glue: bool  # data_spec is a GLUE task (its files have GLUE's layout)
    text_fields: tuple[str, ...]  # the run's configured JSONL/CSV text fields
    label_field: str
    #: a generative run on chat records: the field of their turns (data.messages_field)
    messages_field: str | None = None

    @property
    def num_texts(self) -> int:
        """1 for single texts, 2 for pairs."""
        return len(glue_text_fields(self.data_spec)) if self.glue else len(self.text_fields)

    def describe(self) -> str:
        spec = self.data_spec
        if spec.generative:
            fields = (
                f"chat records in {self.messages_field!r}"
                if self.messages_field
                else f"prompt field {self.text_fields[0]!r}, response field {self.label_field!r}"
            )
            return f"the generative task {spec.name!r} ({fields})"
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
        if multi_task(cfg.partition.tasks.names).generative:
            raise ConfigError(
                "--data: this run federates several generative tasks, each with its own "
                "data; score it per task with fedloom generate and the task's metrics"
            )
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
    spec = scored_task(cfg, resolve_task(cfg.data))
    glue = spec.name in _glue_names()
    if spec.generative:
        fields, label = (cfg.data.prompt_field,), cfg.data.response_field
    run = RunTask(spec, spec, 0, glue, fields, label, cfg.data.messages_field)
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

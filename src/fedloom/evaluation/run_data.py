"""Labeled data for scoring a finished run's adapters (``fedloom eval --data``).

The run's ``config.toml`` says what its adapters were trained for
(:mod:`fedloom.evaluation.run_task`): the task (label space and metrics), how many texts an
example has, and which fields of a JSONL/CSV file hold them. Data that do not fit the run
are refused with one line naming both sides (another GLUE task, a single-sentence file for
a sentence-pair task, a label outside the run's label space, GLUE files for a custom-data
run) instead of being scored into a silently wrong number.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fedloom.config import ConfigError
from fedloom.data import DataError, Example, get_task, load_chat_table, load_glue, load_table
from fedloom.data.glue import glue_file_task, glue_text_fields, read_glue_tsv
from fedloom.data.tables import table_format
from fedloom.evaluation.run_task import RunTask
from fedloom.federation import tag_example

#: values of ``--format``: GLUE's layout for the run's task, or a table with named fields
FORMATS = ("glue", "jsonl", "csv", "tsv")


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
            chat = run.messages_field
            examples = _loading(
                lambda: (
                    load_chat_table(data, chat)
                    if chat is not None
                    else load_table(data, fields, label, task=spec, fmt=form)
                ),
                run,
            )
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

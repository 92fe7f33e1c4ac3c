"""Loaders for plain tabular data: JSON lines, CSV and TSV files.

The format follows the file extension: ``.jsonl``/``.json`` (one JSON object per line),
``.csv`` (comma-separated, standard quoting, header row) or ``.tsv`` (tab-separated,
no quoting, header row). Columns other than the text and label fields are kept in
``Example.meta`` as strings.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from .errors import DataError
from .examples import Example
from .tasks import TaskSpec, custom_task, int_like

Record = tuple[int, dict[str, Any]]  # (1-based line number, field values)


def load_table(
    path: str | Path,
    text_fields: Sequence[str],
    label_field: str = "label",
    label_names: Sequence[str] | None = None,
    *,
    task: TaskSpec | None = None,
    fmt: str | None = None,
) -> list[Example]:
    """Read examples with one or two text fields and a label from a JSONL/CSV/TSV file.

    With ``task``, labels are parsed into that task's label space (class names or ids,
    numbers for a regression task, a non-empty response for a generative one, whose
    prompt must not be empty either); a label outside it is an error naming the file
    and line. Otherwise, with ``label_names``, labels may be label names or integer class
    ids; without, labels that are all integers become class ids and anything else must
    be numeric and becomes a float regression target. ``fmt`` ("jsonl", "csv", "tsv")
    overrides the format the extension implies.
    """
    path = Path(path)
    text_fields = tuple(text_fields)
    if not 1 <= len(text_fields) <= 2:
        raise ValueError(f"expected one or two text fields, got {list(text_fields)}")
    if len(set(text_fields)) != len(text_fields) or label_field in text_fields:
        raise ValueError(
            f"text fields {list(text_fields)} and label field {label_field!r} must be distinct"
        )
    records = _read_records(path, fmt)
    if not records:
        raise DataError(f"{path}: no examples")
    for line, record in records:
        _check_fields(path, line, record, text_fields, label_field)
        if task is not None and task.generative and not record[text_fields[0]].strip():
            raise DataError(f"{path}, line {line}: field {text_fields[0]!r}: the prompt is empty")
    spec = task if task is not None else _label_spec(path, records, label_field, label_names)
    return [
        Example(
            text_a=record[text_fields[0]],
            text_b=record[text_fields[1]] if len(text_fields) == 2 else None,
            label=_parse(path, line, spec, record[label_field]),
            meta={
                key: _meta_str(value)
                for key, value in record.items()
                if key != label_field and key not in text_fields
            },
        )
        for line, record in records
    ]


#: the roles of a chat record's turns
CHAT_ROLES = ("system", "user", "assistant")


def load_chat_table(path: str | Path, messages_field: str = "messages") -> list[Example]:
    """Read chat records from a JSONL file: each record's ``messages_field`` is a list of
    ``{"role", "content"}`` turns (roles in :data:`CHAT_ROLES`, content non-empty text)
    whose last turn is the assistant's response; the turns before it (at least one, the
    last of them the user's) are the prompt (``Example.chat``). Other fields are metadata.
    A record that breaks this is a :class:`DataError` naming the file and line."""
    path = Path(path)
    if table_format(path) not in (None, "jsonl"):
        raise DataError(f"{path}: chat records ({messages_field!r}) are JSON lists: use .jsonl")
    records = read_jsonl(path)
    if not records:
        raise DataError(f"{path}: no examples")
    return [_chat_example(path, line, record, messages_field) for line, record in records]


def _chat_example(path: Path, line: int, record: dict[str, Any], field: str) -> Example:
    where = f"{path}, line {line}: field {field!r}"
    if field not in record:
        raise DataError(f"{path}, line {line}: missing field {field!r}")
    turns = record[field]
    if not isinstance(turns, list) or len(turns) < 2:
        raise DataError(f"{where}: a list of at least two {{role, content}} turns, found {turns!r}")
    parsed: list[tuple[str, str]] = []
    for i, turn in enumerate(turns):
        if not (isinstance(turn, dict) and set(turn) >= {"role", "content"}):
            raise DataError(f"{where}, turn {i}: expected {{role, content}}, found {turn!r}")
        role, content = turn["role"], turn["content"]
        if role not in CHAT_ROLES:
            raise DataError(f"{where}, turn {i}: role {role!r} is not one of {list(CHAT_ROLES)}")
        if not isinstance(content, str) or not content.strip():
            raise DataError(f"{where}, turn {i}: the content is empty or not text")
        parsed.append((role, content))
    if parsed[-1][0] != "assistant":
        raise DataError(f"{where}: the last turn is the response, the assistant's")
    if parsed[-2][0] != "user":
        raise DataError(f"{where}: the turn before the response is the user's")
    return Example(
        text_a=parsed[-2][1],
        text_b=None,
        label=parsed[-1][1],
        meta={key: _meta_str(value) for key, value in record.items() if key != field},
        chat=tuple(parsed[:-1]),
    )


#: file formats by extension
TABLE_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}


def table_format(path: Path) -> str | None:
    """ "jsonl", "csv" or "tsv" as ``path``'s extension says, None for other extensions."""
    return TABLE_FORMATS.get(path.suffix.lower())


def read_label_values(
    path: str | Path, label_field: str = "label", fmt: str | None = None
) -> list[Any]:
    """The raw values of ``label_field`` in a JSONL/CSV/TSV file (for label inference)."""
    path = Path(path)
    records = _read_records(path, fmt)
    if not records:
        raise DataError(f"{path}: no examples")
    for line, record in records:
        if label_field not in record:
            raise DataError(f"{path}, line {line}: missing field {label_field!r}")
    return [record[label_field] for _, record in records]


def read_jsonl(path: str | Path) -> list[Record]:
    """(1-based line number, record) of every JSON object of the JSONL file ``path``, blank
    lines skipped; a :class:`DataError` naming the file and line of the first line that
    is not a JSON object, or the file when it is missing or not UTF-8."""
    return _read_records(Path(path), "jsonl")


def _read_records(path: Path, fmt: str | None = None) -> list[Record]:
    fmt = fmt or table_format(path)
    if fmt == "jsonl":
        reader = _json_records
    elif fmt == "csv":
        reader = _csv_records
    elif fmt == "tsv":
        reader = _tsv_records
    else:
        raise DataError(
            f"{path}: unsupported file type {path.suffix.lower()!r}; use .jsonl, .json, .csv "
            "or .tsv (or name the format)"
        )
    if not path.is_file():
        raise DataError(f"file not found: {path}")
    try:
        return list(reader(path))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from None


def _json_records(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8-sig") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}, line {line}: invalid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}, line {line}: expected a JSON object, found {type(record).__name__}"
                )
            yield line, record


def _csv_records(path: Path) -> Iterator[Record]:
    return _delimited_records(path, ",", csv.QUOTE_MINIMAL)


def _tsv_records(path: Path) -> Iterator[Record]:
    return _delimited_records(path, "\t", csv.QUOTE_NONE)


def _delimited_records(
    path: Path, delimiter: str, quoting: Literal[0, 1, 2, 3]
) -> Iterator[Record]:
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter, quoting=quoting)
        header = next(reader, None)
        if header is None:
            return
        if len(set(header)) != len(header):
            raise DataError(f"{path}, line {reader.line_num}: duplicate column names {header}")
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise DataError(
                    f"{path}, line {reader.line_num}: expected {len(header)} columns, "
                    f"found {len(row)}"
                )
            yield reader.line_num, dict(zip(header, row))


def _check_fields(
    path: Path, line: int, record: dict[str, Any], text_fields: tuple[str, ...], label_field: str
) -> None:
    for name in (*text_fields, label_field):
        if name not in record:
            raise DataError(f"{path}, line {line}: missing field {name!r}")
    for name in text_fields:
        if not isinstance(record[name], str):
            raise DataError(
                f"{path}, line {line}: field {name!r} must be text, found {record[name]!r}"
            )


def _label_spec(
    path: Path, records: list[Record], label_field: str, label_names: Sequence[str] | None
) -> TaskSpec:
    """The task whose ``parse_label`` reads this file's labels."""
    if label_names is not None:
        return custom_task(path.name, label_names)
    maybe = [(line, int_like(record[label_field])) for line, record in records]
    class_ids = [(line, class_id) for line, class_id in maybe if class_id is not None]
    if len(class_ids) < len(maybe):
        return custom_task(path.name)
    for line, class_id in class_ids:
        if class_id < 0:
            raise DataError(
                f"{path}, line {line}: class id {class_id} is negative; "
                "pass label_names or use float labels for regression"
            )
    num_classes = max(max(class_id for _, class_id in class_ids) + 1, 2)
    return custom_task(path.name, [str(class_id) for class_id in range(num_classes)])


def _parse(path: Path, line: int, spec: TaskSpec, value: Any) -> int | float | str:
    try:
        return spec.parse_label(value)
    except ValueError as exc:
        raise DataError(f"{path}, line {line}: {exc}") from None


def _meta_str(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)

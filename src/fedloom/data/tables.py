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

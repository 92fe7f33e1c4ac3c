"""GLUE loaders: the original TSV files on disk, or the ``nyu-mll/glue`` hub dataset.

The TSV files are read with ``csv.QUOTE_NONE`` because GLUE sentences contain stray
quote characters; every row is one line. Labels are mapped to the Hugging Face label ids
recorded in :mod:`fedloom.data.tasks`.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .errors import DataError
from .examples import Example
from .tasks import TASKS, TaskSpec, get_task

HUB_DATASET = "nyu-mll/glue"
_FILE_SPLITS = {"train": "train", "dev": "dev", "validation": "dev"}
_HUB_SPLITS = {"train": "train", "dev": "validation", "validation": "validation"}
# MNLI's dev set comes in two: matched (the training genres, its "dev") and mismatched
_MNLI_FILE_SPLITS = {
    "train": "train",
    "dev": "dev_matched",
    "validation": "dev_matched",
    "dev_matched": "dev_matched",
    "validation_matched": "dev_matched",
    "dev_mismatched": "dev_mismatched",
    "validation_mismatched": "dev_mismatched",
}
_MNLI_HUB_SPLITS = {
    "train": "train",
    "dev": "validation_matched",
    "validation": "validation_matched",
    "dev_matched": "validation_matched",
    "validation_matched": "validation_matched",
    "dev_mismatched": "validation_mismatched",
    "validation_mismatched": "validation_mismatched",
}


def _splits(spec: TaskSpec) -> tuple[Mapping[str, str], Mapping[str, str]]:
    if spec.name == "MNLI":
        return _MNLI_FILE_SPLITS, _MNLI_HUB_SPLITS
    return _FILE_SPLITS, _HUB_SPLITS


@dataclass(frozen=True)
class _Layout:
    """Where a task's fields sit in its TSV file and in its hub rows."""

    header: tuple[str, ...] | None  # expected header row; None for headerless files
    text_a: int
    text_b: int | None
    label: int
    meta: Mapping[str, int]  # meta key -> column
    hub_text_a: str
    hub_text_b: str | None
    #: MNLI: the header starts with ``header`` and ends with this label column, with a
    #: varying number of annotator columns between (12 columns in train, 16 in dev)
    last_column: str | None = None

    @property
    def num_columns(self) -> int:
        return (
            len(self.header)
            if self.header
            else 1 + max(self.text_a, self.label, self.text_b or 0, *self.meta.values())
        )

    def matches(self, row: list[str] | tuple[str, ...]) -> bool:
        """Whether ``row`` is this layout's header row."""
        row = tuple(row)
        if self.header is None:
            return False
        if self.last_column is None:
            return row == self.header
        n = len(self.header)
        return len(row) > n and row[:n] == self.header and row[-1] == self.last_column

    @property
    def label_name(self) -> str:
        assert self.header is not None
        return self.last_column or self.header[self.label]


_PAIR_NLI = _Layout(
    header=("index", "sentence1", "sentence2", "label"),
    text_a=1,
    text_b=2,
    label=3,
    meta={"index": 0},
    hub_text_a="sentence1",
    hub_text_b="sentence2",
)

# QQP, QNLI and MNLI are not in ../shared/data; they load from the hub by name, or from
# a GLUE directory that has them.
_LAYOUTS: dict[str, _Layout] = {
    "QQP": _Layout(
        header=("id", "qid1", "qid2", "question1", "question2", "is_duplicate"),
        text_a=3,
        text_b=4,
        label=5,
        meta={"id": 0, "qid1": 1, "qid2": 2},
        hub_text_a="question1",
        hub_text_b="question2",
    ),
    "QNLI": _Layout(
        header=("index", "question", "sentence", "label"),
        text_a=1,
        text_b=2,
        label=3,
        meta={"index": 0},
        hub_text_a="question",
        hub_text_b="sentence",
    ),
    "MNLI": _Layout(
        header=(
            "index",
            "promptID",
            "pairID",
            "genre",
            "sentence1_binary_parse",
            "sentence2_binary_parse",
            "sentence1_parse",
            "sentence2_parse",
            "sentence1",
            "sentence2",
        ),
        text_a=8,
        text_b=9,
        label=-1,
        meta={"index": 0, "promptID": 1, "pairID": 2, "genre": 3},
        hub_text_a="premise",
        hub_text_b="hypothesis",
        last_column="gold_label",
    ),
    "MRPC": _Layout(
        header=("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"),
        text_a=3,
        text_b=4,
        label=0,
        meta={"id1": 1, "id2": 2},
        hub_text_a="sentence1",
        hub_text_b="sentence2",
    ),
    "RTE": _PAIR_NLI,
    "WNLI": _PAIR_NLI,
    "SST-2": _Layout(
        header=("sentence", "label"),
        text_a=0,
        text_b=None,
        label=1,
        meta={},
        hub_text_a="sentence",
        hub_text_b=None,
    ),
    "CoLA": _Layout(
        header=None,
        text_a=3,
        text_b=None,
        label=1,
        meta={"source": 0, "original_label": 2},
        hub_text_a="sentence",
        hub_text_b=None,
    ),
    "STS-B": _Layout(
        header=(
            "index",
            "genre",
            "filename",
            "year",
            "old_index",
            "source1",
            "source2",
            "sentence1",
            "sentence2",
            "score",
        ),
        text_a=7,
        text_b=8,
        label=9,
        meta={
            "index": 0,
            "genre": 1,
            "filename": 2,
            "year": 3,
            "old_index": 4,
            "source1": 5,
            "source2": 6,
        },
        hub_text_a="sentence1",
        hub_text_b="sentence2",
    ),
}


#: the repository root when fedloom runs from a source checkout (src layout)
SOURCE_CHECKOUT = Path(__file__).resolve().parents[3]


def default_glue_dir() -> Path | None:
    """``../shared/data/glue`` beside the working directory or beside the source checkout
    (for editable installs run from elsewhere), if that folder exists."""
    for base in (Path.cwd().parent, SOURCE_CHECKOUT.parent):
        candidate = base / "shared" / "data" / "glue"
        if candidate.is_dir():
            return candidate
    return None


def load_glue(
    task: TaskSpec | str, split: str = "train", data_dir: str | Path | None = None
) -> list[Example]:
    """Load one split ("train", or "dev"/"validation") of a GLUE task.

    With ``data_dir``, read ``<data_dir>/<TASK>/<split>.tsv`` (``data_dir`` may also be
    the task folder itself); without, download the split from the Hugging Face hub.
    """
    spec = get_task(task) if isinstance(task, str) else task
    # a run may score a GLUE task with metrics of its choice (eval.metrics): the rest of the
    # spec must be the task's
    scored = spec.name in TASKS and replace(TASKS[spec.name], metrics=spec.metrics)
    if spec.name not in _LAYOUTS or scored != spec:
        raise ValueError(f"{spec.name!r} is not a GLUE task; known tasks: {', '.join(TASKS)}")
    file_splits, hub_splits = _splits(spec)
    if split not in file_splits:
        raise DataError(f"unknown GLUE split {split!r}; use one of {sorted(file_splits)}")
    if data_dir is None:
        return _load_from_hub(spec, hub_splits[split])
    return read_glue_tsv(spec, _find_tsv(spec, Path(data_dir), file_splits[split]))


def _find_tsv(spec: TaskSpec, data_dir: Path, split: str) -> Path:
    candidates = [data_dir / folder / f"{split}.tsv" for folder in (spec.name, spec.hub_config)]
    candidates.append(data_dir / f"{split}.tsv")
    for path in candidates:
        if path.is_file():
            return path
    raise DataError(
        f"GLUE {spec.name} {split} file not found: {candidates[0]} "
        f"(also looked for {', '.join(str(p) for p in candidates[1:])})"
    )


def read_glue_tsv(spec: TaskSpec, path: Path) -> list[Example]:
    """Parse a file in ``spec``'s GLUE layout (tab-separated, whatever its name or extension:
    ``dev.tsv``, MSR's ``msr_paraphrase_test.txt``); errors name the file and line, and
    a header of another GLUE task or one without the label column says so."""
    layout = _LAYOUTS[spec.name]
    examples = []
    columns = layout.num_columns
    for line, row in _tsv_rows(path):
        if layout.header is not None and line == 1:
            if not layout.matches(row):
                raise DataError(f"{path}, line 1: {_header_mismatch(spec, row)}")
            columns = len(row)
            continue
        if len(row) != columns:
            raise DataError(
                f"{path}, line {line}: expected {columns} tab-separated columns, found {len(row)}"
            )
        try:
            label = spec.parse_label(row[layout.label])
        except ValueError as exc:
            raise DataError(f"{path}, line {line}: {exc}") from None
        examples.append(
            Example(
                text_a=row[layout.text_a],
                text_b=None if layout.text_b is None else row[layout.text_b],
                label=label,
                meta={key: row[col] for key, col in layout.meta.items()},
            )
        )
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def _header_mismatch(spec: TaskSpec, row: list[str]) -> str:
    layout = _LAYOUTS[spec.name]
    assert layout.header is not None
    expected = list(layout.header) + ([f"..., {layout.last_column}"] if layout.last_column else [])
    mismatch = f"expected the {spec.name} header {expected}, found {row}"
    other = sniff_glue_task(row)
    if other is not None:
        return f"{mismatch}: {other}'s GLUE layout, not {spec.name}'s"
    label = layout.label_name
    if label not in row and all(name in row for name in layout.header if name != label):
        return (
            f"{mismatch}: no label column {label!r}; an unlabeled file (e.g. a GLUE test "
            "split) cannot be scored"
        )
    return mismatch


def sniff_glue_task(header: list[str] | tuple[str, ...]) -> str | None:
    """The GLUE task(s) whose file header ``header`` is, e.g. "SST-2" or "RTE or WNLI"
    (which share one); None for any other line (headerless CoLA cannot be told)."""
    row = tuple(name.lstrip("\ufeff") for name in header)
    names = [name for name, layout in _LAYOUTS.items() if layout.matches(row)]
    return " or ".join(names) or None


def glue_file_task(path: Path) -> str | None:
    """The GLUE task whose header the first line of ``path`` is, if any."""
    try:
        for _, row in _tsv_rows(path):
            return sniff_glue_task(row)
    except DataError:
        return None
    return None


def glue_text_fields(spec: TaskSpec) -> tuple[str, ...]:
    """The hub's text field names of a GLUE task: one for single sentences, two for pairs."""
    layout = _LAYOUTS[spec.name]
    return (layout.hub_text_a,) + ((layout.hub_text_b,) if layout.hub_text_b else ())


def _tsv_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Yield (1-based line number, fields) for each non-blank line of a TSV file."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as handle:
            reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
            for row in reader:
                if row:
                    yield reader.line_num, row
    except FileNotFoundError:
        raise DataError(f"file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from None


def _load_from_hub(spec: TaskSpec, split: str) -> list[Example]:
    from datasets import load_dataset

    try:
        rows = load_dataset(HUB_DATASET, spec.hub_config, split=split)
    except Exception as exc:  # the hub fails with many error types (network, auth, cache)
        raise DataError(
            f"could not load {HUB_DATASET}/{spec.hub_config} ({split}) from the Hugging Face "
            f"hub: {exc}. Pass --data-dir pointing at a folder with <TASK>/{{train,dev}}.tsv."
        ) from exc
    return [hub_row_to_example(spec, row) for row in rows]


def hub_row_to_example(spec: TaskSpec, row: Mapping[str, Any]) -> Example:
    """Convert one ``nyu-mll/glue`` row (already in Hugging Face label ids) to an Example."""
    layout = _LAYOUTS[spec.name]
    try:
        label = spec.parse_label(row["label"])
    except ValueError as exc:
        raise DataError(f"{HUB_DATASET}/{spec.hub_config} row {row.get('idx')}: {exc}") from None
    return Example(
        text_a=row[layout.hub_text_a],
        text_b=None if layout.hub_text_b is None else row[layout.hub_text_b],
        label=label,
        meta={"idx": str(row["idx"])} if "idx" in row else {},
    )

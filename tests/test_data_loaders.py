"""GLUE and tabular loaders, and the task registry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import GLUE_DIR, needs_glue

from fedloom.data import (
    TASKS,
    DataError,
    Example,
    custom_task,
    default_glue_dir,
    get_task,
    load_glue,
    load_table,
)

# The counts of /work/shared/data/README.md.
README_COUNTS = {
    ("MRPC", "train"): 3668,
    ("MRPC", "dev"): 408,
    ("RTE", "train"): 2490,
    ("RTE", "dev"): 277,
    ("SST-2", "train"): 67349,
    ("SST-2", "dev"): 872,
    ("CoLA", "train"): 8551,
    ("CoLA", "dev"): 1043,
    ("STS-B", "train"): 5749,
    ("STS-B", "dev"): 1500,
    ("WNLI", "train"): 635,
    ("WNLI", "dev"): 71,
}
# The shared MRPC train.tsv has 3,668 lines *including* its header, i.e. 3,667 examples,
# one fewer than the README (and the hub's 3,668). The loader reads every line, as
# test_mrpc_train_has_one_example_per_data_line checks; this xfail turns into a failure
# once the file is corrected, so the marker can then be removed.
MRPC_TRAIN_SHORT = pytest.mark.xfail(
    strict=True, reason="shared MRPC/train.tsv holds 3,667 data rows, README says 3,668"
)


@needs_glue(*sorted({task for task, _split in README_COUNTS}))
@pytest.mark.parametrize(
    ("task", "split", "expected"),
    [
        pytest.param(*key, count, marks=MRPC_TRAIN_SHORT if key == ("MRPC", "train") else ())
        for key, count in README_COUNTS.items()
    ],
)
def test_glue_counts_match_readme(task: str, split: str, expected: int) -> None:
    assert len(load_glue(task, split, GLUE_DIR)) == expected


@needs_glue
def test_mrpc_train_has_one_example_per_data_line() -> None:
    lines = (GLUE_DIR / "MRPC" / "train.tsv").read_bytes().count(b"\n")
    assert len(load_glue("MRPC", "train", GLUE_DIR)) == lines - 1


@needs_glue
def test_mrpc_first_example() -> None:
    first = load_glue("MRPC", "train", GLUE_DIR)[0]
    assert first.text_a == (
        'Amrozi accused his brother , whom he called " the witness " , '
        "of deliberately distorting his evidence ."
    )
    assert first.text_b == (
        'Referring to him as only " the witness " , Amrozi accused his brother '
        "of deliberately distorting his evidence ."
    )
    assert first.label == 1
    assert first.meta == {"id1": "702876", "id2": "702977"}


@needs_glue("RTE")
def test_rte_labels_follow_hub_ids() -> None:
    examples = load_glue("rte", "train", GLUE_DIR)
    assert get_task("RTE").label_names == ("entailment", "not_entailment")
    assert examples[0].text_b == "Weapons of Mass Destruction Found in Iraq."
    assert examples[0].label == 1  # not_entailment
    assert examples[1].label == 0  # entailment
    assert sum(e.label == 0 for e in examples) == 1249


@needs_glue("CoLA")
def test_cola_is_headerless() -> None:
    examples = load_glue("CoLA", "train", GLUE_DIR)
    first = examples[0]
    assert first.text_a == "Our friends won't buy this analysis, let alone the next one we propose."
    assert first.text_b is None
    assert first.label == 1
    assert first.meta == {"source": "gj04", "original_label": ""}
    assert {e.label for e in examples} == {0, 1}


@needs_glue("STS-B")
def test_stsb_float_labels_and_genre() -> None:
    examples = load_glue("STS-B", "train", GLUE_DIR)
    assert examples[0].label == 5.0 and isinstance(examples[0].label, float)
    assert examples[1].label == pytest.approx(3.8)
    assert examples[0].meta["genre"] == "main-captions"
    assert {e.meta["genre"] for e in examples} == {"main-captions", "main-news", "main-forum"}
    assert all(0.0 <= e.label <= 5.0 for e in examples)


@needs_glue("SST-2")
def test_sst2_single_sentence_and_dev_aliases() -> None:
    dev = load_glue("sst2", "dev", GLUE_DIR)
    assert dev == load_glue("SST-2", "validation", GLUE_DIR / "SST-2")
    assert dev[0] == Example("it 's a charming and often affecting journey . ", None, 1)


def test_default_glue_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    main = tmp_path / "main"
    main.mkdir()
    monkeypatch.chdir(main)
    monkeypatch.setattr("fedloom.data.glue.SOURCE_CHECKOUT", tmp_path / "elsewhere" / "repo")
    assert default_glue_dir() is None
    glue = tmp_path / "shared" / "data" / "glue"
    glue.mkdir(parents=True)
    assert default_glue_dir().resolve() == glue.resolve()


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


MRPC_HEADER = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"


def test_glue_tsv_with_stray_quotes_and_blank_line(tmp_path: Path) -> None:
    _write(tmp_path / "MRPC" / "train.tsv", MRPC_HEADER + '0\t1\t2\t" a\tb "\n1\t3\t4\tc\td\n\n')
    examples = load_glue("MRPC", "train", tmp_path)
    assert [(e.text_a, e.text_b, e.label) for e in examples] == [('" a', 'b "', 0), ("c", "d", 1)]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("1\t5\t6\tonly three\n", "expected 5 tab-separated columns, found 4"),
        ("2\t5\t6\ta\tb\n", "label '2'"),
        ("yes\t5\t6\ta\tb\n", "label 'yes'"),
    ],
)
def test_malformed_glue_row_names_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    path = _write(tmp_path / "MRPC" / "train.tsv", MRPC_HEADER + "1\t3\t4\tc\td\n" + row)
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}, line 3: .*{message}"):
        load_glue("MRPC", "train", tmp_path)


def test_rte_unknown_label_name(tmp_path: Path) -> None:
    header = "index\tsentence1\tsentence2\tlabel\n"
    path = _write(tmp_path / "RTE" / "dev.tsv", header + "0\ta\tb\tmaybe\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}, line 2: label 'maybe'"):
        load_glue("RTE", "dev", tmp_path)


def test_wrong_header_is_reported(tmp_path: Path) -> None:
    path = _write(tmp_path / "WNLI" / "train.tsv", "sentence\tlabel\nhello\t1\n")
    with pytest.raises(DataError, match=re.escape(f"{path}, line 1: expected the WNLI header")):
        load_glue("WNLI", "train", tmp_path)


def test_missing_glue_file_names_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "CoLA" / "dev.tsv"))):
        load_glue("CoLA", "dev", tmp_path)


def test_unknown_split(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="unknown GLUE split 'test'"):
        load_glue("CoLA", "test", tmp_path)


def test_hub_failure_says_to_pass_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="no network.*--data-dir"):
        load_glue("MRPC")


def test_hub_rows_become_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def fake(path: str, name: str, split: str) -> list[dict[str, object]]:
        calls.append((path, name, split))
        return [{"sentence1": "a", "sentence2": "b", "label": 3.2, "idx": 7}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert load_glue("STS-B", "dev") == [Example("a", "b", 3.2, {"idx": "7"})]
    assert calls == [("nyu-mll/glue", "stsb", "validation")]


def test_get_task_aliases_and_unknown() -> None:
    assert get_task("sst2") is get_task("SST-2") is TASKS["SST-2"]
    assert get_task("stsb") is get_task("sts-b") is TASKS["STS-B"]
    assert get_task("mrpc").hub_config == "mrpc"
    with pytest.raises(ValueError, match="unknown task 'ax'.*MRPC, RTE, SST-2, CoLA, STS-B, QQP"):
        get_task("ax")


def test_task_specs() -> None:
    assert TASKS["MRPC"].metrics == ("accuracy", "f1")
    assert TASKS["CoLA"].main_metric == "matthews"
    assert TASKS["STS-B"].is_regression and TASKS["STS-B"].num_labels == 1
    assert TASKS["WNLI"].label_names == ("not_entailment", "entailment")
    for spec in TASKS.values():
        assert len(spec.verbalizer) == len(spec.label_names)


def test_custom_task() -> None:
    spec = custom_task("topic", ["sports", "world_news"])
    assert spec.num_labels == 2 and spec.verbalizer == ("sports", "world news")
    assert spec.metrics == ("accuracy", "macro_f1") and spec.main_metric == "accuracy"
    regression = custom_task("score")
    assert regression.is_regression and regression.main_metric == "pearson"
    with pytest.raises(ValueError, match="not classification metrics"):
        custom_task("topic", ["a", "b"], metrics=["pearson"])
    with pytest.raises(ValueError, match="'f1' needs exactly two labels"):
        custom_task("topic", ["a", "b", "c"], metrics=["f1"])


def test_load_jsonl_pairs_with_label_names(tmp_path: Path) -> None:
    rows = [
        {"q": "is it?", "p": "it is", "label": "yes", "source": "web", "n": 3},
        {"q": "was it?", "p": "no", "label": 0, "source": "book", "n": None},
    ]
    path = _write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    examples = load_table(path, ["q", "p"], label_names=["no", "yes"])
    assert examples == [
        Example("is it?", "it is", 1, {"source": "web", "n": "3"}),
        Example("was it?", "no", 0, {"source": "book", "n": "null"}),
    ]


def test_load_csv_int_labels_become_class_ids(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.csv", 'text,label,lang\n"hello, world",1,en\nbye,0,fr\n')
    examples = load_table(path, ["text"])
    assert examples == [
        Example("hello, world", None, 1, {"lang": "en"}),
        Example("bye", None, 0, {"lang": "fr"}),
    ]
    assert all(type(e.label) is int for e in examples)


def test_load_tsv_mixed_numbers_become_floats(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.tsv", 'a\tb\tscore\n"x\ty"\t4\nz\tw\t2.5\n')
    examples = load_table(path, ["a", "b"], label_field="score")
    assert [(e.text_a, e.text_b, e.label) for e in examples] == [('"x', 'y"', 4.0), ("z", "w", 2.5)]
    assert all(type(e.label) is float for e in examples)


@pytest.mark.parametrize(
    ("name", "text", "kwargs", "message"),
    [
        ("d.jsonl", '{"text": "a", "label": 1}\n{"label": 0}\n', {},
         "line 2: missing field 'text'"),
        ("d.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": "x"}\n', {},
         "line 2: label 'x' is not a number"),
        ("d.jsonl", '{"text": "a", "label": 1}\n{"text": "a", "label": 2}\n',
         {"label_names": ["n", "p"]}, "line 2: label 2 is neither a class id 0..1"),
        ("d.jsonl", '{"text": "a", "label": 1}\n\n{"text": \n', {}, "line 3: invalid JSON"),
        ("d.jsonl", '[1, 2]\n', {}, "line 1: expected a JSON object"),
        ("d.jsonl", '{"text": 5, "label": 1}\n', {}, "line 1: field 'text' must be text"),
        ("d.csv", "text,label\na,1\nb,1,extra\n", {}, "line 3: expected 2 columns, found 3"),
        ("d.csv", "text,label\na,1\nb,-1\n", {}, "line 3: class id -1 is negative"),
        ("d.tsv", "text\tlabel\na\t1\nb\tnan\n", {}, "line 3: label 'nan' is not a finite number"),
    ],
)
def test_table_errors_name_file_and_line(
    tmp_path: Path, name: str, text: str, kwargs: dict[str, object], message: str
) -> None:
    path = _write(tmp_path / name, text)
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}, {message}"):
        load_table(path, ["text"], **kwargs)


def test_table_missing_file_and_bad_extension(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file not found: " + re.escape(str(tmp_path / "nope.csv"))):
        load_table(tmp_path / "nope.csv", ["text"])
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        load_table(_write(tmp_path / "d.txt", "x"), ["text"])
    with pytest.raises(DataError, match="no examples"):
        load_table(_write(tmp_path / "empty.csv", "text,label\n"), ["text"])


def test_default_glue_dir_beside_the_source_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a working directory with nothing beside it
    repo = tmp_path / "work" / "repo"
    glue = tmp_path / "work" / "shared" / "data" / "glue"
    glue.mkdir(parents=True)
    monkeypatch.setattr("fedloom.data.glue.SOURCE_CHECKOUT", repo)
    assert default_glue_dir().resolve() == glue.resolve()

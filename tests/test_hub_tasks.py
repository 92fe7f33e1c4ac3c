"""QQP, QNLI and MNLI: not on disk in ../shared/data, they load from the Hugging Face hub by
name (mocked here: the tests run offline), or from a GLUE directory that has them."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedloom.config import ConfigError, validate
from fedloom.data import get_task, load_glue
from fedloom.data.glue import hub_row_to_example
from fedloom.federation import load_split


def test_specs() -> None:
    assert get_task("qqp").label_names == ("not_duplicate", "duplicate")
    assert get_task("QQP").metrics == ("accuracy", "f1")
    assert get_task("qnli").label_names == ("entailment", "not_entailment")
    mnli = get_task("MNLI")
    assert mnli.label_names == ("entailment", "neutral", "contradiction") and mnli.num_labels == 3


@pytest.mark.parametrize(
    ("task", "row", "expected"),
    [
        ("QQP", {"question1": "a?", "question2": "b?", "label": 1, "idx": 4}, ("a?", "b?", 1)),
        ("QNLI", {"question": "q?", "sentence": "s.", "label": 0, "idx": 0}, ("q?", "s.", 0)),
        ("MNLI", {"premise": "p.", "hypothesis": "h.", "label": 2, "idx": 9}, ("p.", "h.", 2)),
    ],
)
def test_hub_rows(task: str, row: dict, expected: tuple) -> None:
    example = hub_row_to_example(get_task(task), row)
    assert (example.text_a, example.text_b, example.label) == expected


@pytest.fixture
def hub_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []

    def fake_hub(spec, split):
        calls.append((spec.name, split))
        return []

    monkeypatch.setattr("fedloom.data.glue._load_from_hub", fake_hub)
    return calls


def test_by_name_from_the_hub_when_the_local_glue_dir_lacks_them(
    hub_calls: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "shared" / "data" / "glue"
    (local / "MRPC").mkdir(parents=True)
    (local / "MRPC" / "train.tsv").write_text("x")
    monkeypatch.setattr("fedloom.federation.default_glue_dir", lambda: local)
    for name in ("QQP", "QNLI", "MNLI"):
        cfg = validate({"data": {"task": name}}).data
        load_split(cfg, get_task(name), "train")
        load_split(cfg, get_task(name), "dev")
    assert hub_calls == [("QQP", "train"), ("QQP", "validation"), ("QNLI", "train"),
                         ("QNLI", "validation"), ("MNLI", "train"), ("MNLI", "validation_matched")]
    load_glue("MNLI", "dev_mismatched")
    assert hub_calls[-1] == ("MNLI", "validation_mismatched")
    # a data_dir given explicitly must have the task
    cfg = validate({"data": {"task": "QQP", "data_dir": str(local)}}).data
    with pytest.raises(ConfigError, match="data.task: QQP is not in"):
        load_split(cfg, get_task("QQP"), "train")


MNLI_HEAD = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
             "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]


def test_glue_files_of_the_hub_tasks(tmp_path: Path) -> None:
    (tmp_path / "QQP").mkdir()
    (tmp_path / "QQP" / "dev.tsv").write_text(
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n7\t1\t2\tHow?\tWhy?\t0\n")
    (qqp,) = load_glue("QQP", "dev", tmp_path)
    assert (qqp.text_a, qqp.text_b, qqp.label, qqp.meta["qid1"]) == ("How?", "Why?", 0, "1")
    (tmp_path / "QNLI").mkdir()
    (tmp_path / "QNLI" / "train.tsv").write_text(
        "index\tquestion\tsentence\tlabel\n0\tWho?\tHim.\tnot_entailment\n")
    assert load_glue("QNLI", "train", tmp_path)[0].label == 1
    # MNLI: 12 columns in train, 16 (five annotators) in dev; the label is gold_label, last
    (tmp_path / "MNLI").mkdir()
    parse = ["(a)", "(b)", "(a)", "(b)"]
    train = "\t".join(MNLI_HEAD + ["label1", "gold_label"]) + "\n"
    train += "\t".join(["0", "1", "1e", "fiction", *parse, "A man.", "A person.", "entailment",
                        "entailment"]) + "\n"
    (tmp_path / "MNLI" / "train.tsv").write_text(train)
    dev = "\t".join(MNLI_HEAD + [f"label{i}" for i in range(1, 6)] + ["gold_label"]) + "\n"
    dev += "\t".join(["0", "1", "1c", "slate", *parse, "Up.", "Down.", *["contradiction"] * 5,
                      "contradiction"]) + "\n"
    (tmp_path / "MNLI" / "dev_matched.tsv").write_text(dev)
    (first,) = load_glue("MNLI", "train", tmp_path)
    assert (first.text_a, first.text_b, first.label, first.meta["genre"]) == (
        "A man.", "A person.", 0, "fiction")
    (matched,) = load_glue("MNLI", "dev", tmp_path)
    assert matched.label == 2 and matched.text_b == "Down."

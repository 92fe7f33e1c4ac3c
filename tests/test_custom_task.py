"""Custom data is a task of its own: named, with its own label space and metrics, recorded
in the run directory, and scored by ``fedloom eval`` on held-out files of it (issue 8)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from conftest import tiny_raw
from sklearn.metrics import accuracy_score, f1_score
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.config import ConfigError, load_config, validate
from fedloom.data import DataError, compute_metrics, custom_task, infer_label_names, load_table
from fedloom.federation import FederatedData, resolve_task
from fedloom.models.fedmodel import FedModel
from fedloom.runtime.rundir import load_params

runner = CliRunner()

INTENT_WORDS = {
    "billing": ["invoice", "charge", "refund", "payment", "bill"],
    "tech": ["crash", "error", "bug", "login", "screen"],
    "other": ["weather", "hello", "thanks", "lunch", "music"],
}


def write_intents(path: Path, n: int, seed: int, label_field: str = "intent") -> Path:
    """A three-class JSONL file: one text field, the class name as the label."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            label = rng.choice(sorted(INTENT_WORDS))
            a, b = rng.sample(INTENT_WORDS[label], 2)
            f.write(json.dumps({"text": f"my {a} and the {b} today", label_field: label}) + "\n")
    return path


def custom_raw(tmp: Path, **data: object) -> dict:
    """The tiny run of conftest on a three-class JSONL task instead of MRPC."""
    raw = tiny_raw(output_dir=tmp / "runs")
    raw["name"] = "intents"
    raw["data"] = {
        "train_path": str(write_intents(tmp / "train.jsonl", 60, 0)),
        "dev_path": str(write_intents(tmp / "dev.jsonl", 30, 1)),
        "label_field": "intent",
        "max_length": 32,
        **data,
    }
    return raw


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


# --- the task of a config ---------------------------------------------------------------


def test_own_files_without_a_task_name_are_not_mrpc(tmp_path: Path) -> None:
    cfg = validate(custom_raw(tmp_path))
    assert cfg.data.task == "custom"
    task = resolve_task(cfg.data)
    assert task.name == "custom" and task.hub_config == ""
    assert task.label_names == ("billing", "other", "tech")  # inferred, sorted
    assert task.metrics == ("accuracy", "macro_f1") and task.main_metric == "accuracy"


def test_label_names_set_the_class_order(tmp_path: Path) -> None:
    raw = custom_raw(tmp_path, task="intents", label_names=["tech", "billing", "other"])
    task = resolve_task(validate(raw).data)
    assert task.name == "intents" and task.label_names == ("tech", "billing", "other")
    examples = load_table(tmp_path / "train.jsonl", ["text"], "intent", task=task)
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert examples[0].label == task.label_names.index(first["intent"])


def test_a_numeric_label_is_regression(tmp_path: Path) -> None:
    path = tmp_path / "scores.csv"
    path.write_text("a,b,score\nx,y,0.5\nu,v,4.25\nx,z,3\n")
    raw = custom_raw(tmp_path, train_path=str(path), dev_path=None, text_fields=["a", "b"],
                     label_field="score", task="similarity")
    task = resolve_task(validate(raw).data)
    assert task.is_regression and task.metrics == ("pearson", "spearman")
    labels = [e.label for e in load_table(path, ["a", "b"], "score", task=task)]
    assert labels == [0.5, 4.25, 3.0]
    # integer scores are class ids unless label_type says "number"
    path.write_text("a,b,score\nx,y,1\nu,v,5\nx,z,3\n")
    assert resolve_task(validate(raw).data).label_names == tuple("012345")
    raw["data"]["label_type"] = "number"
    assert resolve_task(validate(raw).data).is_regression


@pytest.mark.parametrize(
    ("values", "label_type", "expected"),
    [
        ([0, 2, 1, "2"], "auto", ("0", "1", "2")),
        ([1, 1], "auto", ("0", "1")),
        (["b", "a", "c", "a"], "auto", ("a", "b", "c")),
        ([0.5, 1, "2.5"], "auto", None),
        ([1, 2, 3], "number", None),
        (["yes", "no"], "class", ("no", "yes")),
    ],
)
def test_label_inference_rule(values: list, label_type: str, expected: tuple | None) -> None:
    assert infer_label_names(values, label_type) == expected


@pytest.mark.parametrize(
    ("values", "label_type", "fragment"),
    [
        (["a", 1], "auto", "mix names"),
        (["a", "a"], "auto", "only one label"),
        ([-1, 0], "auto", "negative"),
        ([True, False], "auto", "neither a class name"),
        ([0.5, 1.0], "class", "not a class id"),
        (["x", "y"], "number", "not a number"),
    ],
)
def test_label_inference_refuses_with_what_to_set(values: list, label_type: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        infer_label_names(values, label_type)


def test_mrpc_with_other_label_names_is_refused(tmp_path: Path) -> None:
    raw = custom_raw(tmp_path, task="MRPC", label_names=["a", "b", "c"])
    with pytest.raises(ConfigError, match=r"data.label_names: .* not MRPC's labels .*data.task"):
        resolve_task(validate(raw).data)


def test_glue_task_name_on_own_files_parses_in_its_label_space(tmp_path: Path) -> None:
    # three classes read as MRPC: refused before any run directory exists
    raw = custom_raw(tmp_path, task="MRPC")
    with pytest.raises(DataError, match=r"train.jsonl, line 1: label '\w+' is neither"):
        FederatedData.build(validate(raw))


def test_unknown_task_without_files_names_what_to_set() -> None:
    with pytest.raises(ConfigError, match="data.task: unknown task 'mine'.*data.train_path"):
        resolve_task(validate({"data": {"task": "mine"}}).data)


def test_macro_f1_counts_every_class() -> None:
    task = custom_task("t", ["a", "b", "c"])
    preds, labels = np.array([0, 1, 2, 2, 0]), np.array([0, 1, 1, 2, 2])
    scores = compute_metrics(task, preds, labels)
    assert scores["macro_f1"] == pytest.approx(f1_score(labels, preds, average="macro"))
    assert scores["accuracy"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="'f1' needs exactly two labels"):
        custom_task("t", ["a", "b", "c"], metrics=("f1",))


# --- end to end: a three-class JSONL task trains and is scored --------------------------


@pytest.fixture(scope="module")
def intents_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    tmp = tmp_path_factory.mktemp("intents")
    config = tmp / "intents.toml"
    config.write_text(tomli_w.dumps(custom_raw(tmp)))
    result = invoke("run", "--no-report", config, "--quiet")
    assert result.exit_code == 0, result.stderr
    (run,) = [p for p in (tmp / "runs").iterdir() if p.is_dir()]
    return run, result.stdout, write_intents(tmp / "heldout.jsonl", 40, 2)


def test_three_class_jsonl_run_records_its_task(intents_run: tuple[Path, str, Path]) -> None:
    run, stdout, _ = intents_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "custom"
    assert summary["label_names"] == ["billing", "other", "tech"]
    assert set(summary["global"]["dev"]) == {"accuracy", "macro_f1", "loss", "n"}
    assert summary["global"]["dev"]["n"] == 30
    # the table names the task and its labels
    assert "intents: fedavg on custom" in stdout
    assert "labels: billing, other, tech" in stdout
    assert "macro-F1" in stdout
    # the run directory describes the task without the training file
    cfg = load_config(run / "config.toml")
    assert cfg.data.label_names == ["billing", "other", "tech"] and cfg.data.label_type == "class"
    partition = json.loads((run / "partition.json").read_text())
    assert partition["label_names"] == ["billing", "other", "tech"]


def test_eval_scores_a_held_out_jsonl_of_the_custom_task(
    intents_run: tuple[Path, str, Path], tmp_path: Path
) -> None:
    run, _, heldout = intents_run
    # the training file is not needed any more
    (Path(load_config(run / "config.toml").data.train_path)).rename(tmp_path / "moved.jsonl")
    result = invoke("eval", run, "--data", heldout)
    assert result.exit_code == 0, result.stderr
    scores = json.loads(result.stdout)["global"]
    assert set(scores) == {"accuracy", "macro_f1", "loss", "n"} and scores["n"] == 40
    assert "round 2 of 2; the run finished" in result.stderr

    cfg = load_config(run / "config.toml")
    task = custom_task("custom", ["billing", "other", "tech"])
    model = FedModel.build(cfg.model, task, cfg.data.max_length, cfg.seed)
    model.set_params(load_params(run / "checkpoints" / "global.safetensors"))
    examples = load_table(heldout, ["text"], "intent", task=task)
    preds, labels, loss = model.predict(model.encode(examples), 64)
    assert scores["accuracy"] == pytest.approx(accuracy_score(labels, preds), abs=1e-12)
    assert scores["macro_f1"] == pytest.approx(f1_score(labels, preds, average="macro"), abs=1e-12)
    assert scores["loss"] == pytest.approx(loss, rel=1e-6)


def test_eval_of_the_custom_task_with_other_fields_and_csv(
    intents_run: tuple[Path, str, Path], tmp_path: Path
) -> None:
    run, _, heldout = intents_run
    rows = [json.loads(line) for line in heldout.read_text().splitlines()]
    path = tmp_path / "heldout.data"
    path.write_text("utterance,gold\n" + "".join(f"{r['text']},{r['intent']}\n" for r in rows))
    result = invoke("eval", run, "--data", path, "--format", "csv",
                    "--text-fields", "utterance", "--label-field", "gold")
    assert result.exit_code == 0, result.stderr
    by_jsonl = json.loads(invoke("eval", run, "--data", heldout).stdout)
    assert json.loads(result.stdout) == by_jsonl


# --- end to end on MiniLM: the label space survives from training to `fedloom eval` ------


@pytest.mark.slow
def test_minilm_learns_a_custom_task_and_eval_maps_its_labels(tmp_path: Path) -> None:
    """A keyword-intent task MiniLM learns within a round or two: if training and scoring
    disagreed on which class id is which name, the held-out accuracy would collapse."""
    raw = custom_raw(tmp_path, task="intents", max_length=32)
    raw["data"]["train_path"] = str(write_intents(tmp_path / "train.jsonl", 150, 0))
    raw["model"] = {"backbone": "minilm"}
    raw["partition"]["test_fraction"] = 0.0
    raw["federation"]["rounds"] = 2
    raw["train"] = {"batch_size": 8, "local_epochs": 0.5, "lr": 2e-3, "head_lr": 5e-3}
    config = tmp_path / "intents.toml"
    config.write_text(tomli_w.dumps(raw))
    result = invoke("run", "--no-report", config, "--quiet")
    assert result.exit_code == 0, result.stderr
    assert "intents: fedavg on intents" in result.stdout
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    heldout = write_intents(tmp_path / "heldout.jsonl", 45, 2)
    by_name = json.loads(invoke("eval", run, "--data", heldout).stdout)["global"]
    assert by_name["n"] == 45 and by_name["accuracy"] >= 0.9, by_name
    # the same examples with class ids (indexing the recorded label_names) score the same
    names = load_config(run / "config.toml").data.label_names
    rows = [json.loads(line) for line in heldout.read_text().splitlines()]
    ids = tmp_path / "heldout_ids.csv"
    ids.write_text("text,intent\n" + "".join(
        f"{r['text']},{names.index(r['intent'])}\n" for r in rows))
    assert json.loads(invoke("eval", run, "--data", ids).stdout)["global"] == by_name

"""``fedloom run | eval``: exit status 2 with one line naming the mistake for bad input,
exit status 1 for a failed run, and (slow) an end-to-end MiniLM run on real MRPC data."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from conftest import GLUE_DIR, needs_glue, require_glue, tiny_raw
from sklearn.metrics import accuracy_score, f1_score
from typer.testing import CliRunner

from fedloom.algorithms import ClientContext, register
from fedloom.algorithms.fedavg import FedAvg
from fedloom.cli import app
from fedloom.config import load_config
from fedloom.data import get_task, load_glue
from fedloom.models.fedmodel import FedModel
from fedloom.runtime.rundir import load_params

runner = CliRunner()


def write_config(path: Path, raw: dict) -> Path:
    path.write_text(tomli_w.dumps(raw))
    return path


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def only_run_dir(output_dir: Path) -> Path:
    (run,) = [p for p in output_dir.iterdir() if p.is_dir()]
    return run


def assert_bad_input(result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert "error:" in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.fixture
def tiny_toml(tmp_path: Path) -> Path:
    return write_config(tmp_path / "tiny.toml", tiny_raw())


# --- fedloom run: bad input exits 2 -------------------------------------------------------


def test_missing_config_file(tmp_path: Path) -> None:
    result = invoke("run", tmp_path / "nope.toml", "--output-dir", tmp_path / "runs")
    assert_bad_input(result, "nope.toml", "config file not found")
    assert not (tmp_path / "runs").exists()


def test_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[train\nlr = 1\n")
    assert_bad_input(invoke("run", path), "invalid TOML")


def test_unknown_key_in_the_file(tmp_path: Path) -> None:
    raw = tiny_raw()
    raw["train"]["lrr"] = 0.1
    result = invoke("run", write_config(tmp_path / "c.toml", raw), "--output-dir", tmp_path / "runs")
    assert_bad_input(result, "train.lrr: unknown key")
    assert not (tmp_path / "runs").exists()  # no half-made run directory


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("federation.fraction=1.5", "federation.fraction:"),
        ("train.lrr=0.1", "train.lrr: unknown key"),
        ("model.lora.r=0", "model.lora.r:"),
        ("train.local_steps=0", "train.local_steps:"),
        ("train.lr", "--set 'train.lr': expected section.key=value"),
        ("algorithm.name=fedsgdx", "algorithm.name: unknown algorithm 'fedsgdx'"),
        ("algorithm.lr=0.1", "algorithm.lr: unknown hyperparameter for fedavg"),
        ("algorithm.weighting=median", "algorithm.weighting:"),
        ("data.task=NOPE", "data.task: unknown task 'NOPE'"),
    ],
)
def test_bad_override_exits_2_naming_the_key(tiny_toml: Path, tmp_path: Path, override: str,
                                             fragment: str) -> None:
    result = invoke("run", tiny_toml, "--set", override, "--output-dir", tmp_path / "runs")
    assert_bad_input(result, fragment)
    assert not (tmp_path / "runs").exists()


def test_data_dir_that_does_not_exist(tiny_toml: Path, tmp_path: Path) -> None:
    result = invoke("run", tiny_toml, "--data-dir", tmp_path / "nowhere")
    assert_bad_input(result, "data.data_dir:", "is not a directory")


def test_task_missing_from_the_data_dir(tiny_toml: Path, tmp_path: Path) -> None:
    data = tmp_path / "glue"
    (data / "SST-2").mkdir(parents=True)
    (data / "SST-2" / "train.tsv").write_text("sentence\tlabel\ngood\t1\n")
    result = invoke("run", tiny_toml, "--data-dir", data, "--output-dir", tmp_path / "runs")
    assert_bad_input(result, "data.task: MRPC is not in", "SST-2")
    assert not (tmp_path / "runs").exists()


def test_custom_data_file_that_does_not_exist(tmp_path: Path) -> None:
    raw = tiny_raw()
    raw["data"] = {"task": "mine", "train_path": str(tmp_path / "train.jsonl")}
    result = invoke("run", write_config(tmp_path / "c.toml", raw))
    assert_bad_input(result, "train.jsonl")


@needs_glue
def test_impossible_partition(tiny_toml: Path, tmp_path: Path) -> None:
    result = invoke("run", tiny_toml, "--set", "partition.num_clients=50",
                    "--output-dir", tmp_path / "runs")
    assert_bad_input(result, "partition:")


def test_installed_entry_point_exits_2(tmp_path: Path) -> None:
    """The real console script: status 2 and one error line on stderr, nothing on stdout."""
    exe = Path(sys.executable).with_name("fedloom")
    if not exe.exists():
        pytest.skip(f"{exe} not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(exe), "run", str(tmp_path / "missing.toml"), "--set", "federation.fraction=1.5"],
        check=False, capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing.toml" in lines[0]


# --- fedloom run: a failed run exits 1 ----------------------------------------------------


@register("test-cli-diverges")
@dataclass(frozen=True)
class Diverges(FedAvg):
    def local_train(self, ctx: ClientContext, payload):
        raise FloatingPointError(f"client {ctx.client_id}: non-finite loss at local step 0")


@needs_glue
def test_run_where_every_client_fails_exits_1(tiny_toml: Path, tmp_path: Path) -> None:
    result = invoke("run", tiny_toml, "--set", "algorithm.name=test-cli-diverges",
                    "--output-dir", tmp_path / "runs", "--quiet")
    assert result.exit_code == 1
    assert "run failed: round 1: every sampled client failed" in result.stderr
    run = only_run_dir(tmp_path / "runs")
    assert str(run) in result.stderr.replace("\n", "")  # the directory is kept and named
    assert (run / "config.toml").is_file()


# --- fedloom run + eval on tiny-bert ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_glue()
    tmp = tmp_path_factory.mktemp("tiny_cli")
    raw = tiny_raw()
    raw["data"]["text_fields"] = ["sentence1", "sentence2"]  # for the .jsonl scoring below
    config = write_config(tmp / "tiny.toml", raw)
    result = invoke("run", "--no-report", config, "--output-dir", tmp / "runs", "--quiet")
    assert result.exit_code == 0, result.stderr
    return only_run_dir(tmp / "runs")


def test_tiny_run_completes_the_run_dir(tiny_run: Path) -> None:
    for name in ("config.toml", "partition.json", "metrics.jsonl", "summary.json"):
        assert (tiny_run / name).is_file()
    assert (tiny_run / "checkpoints" / "global.safetensors").is_file()
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert summary["global"]["dev"]["n"] == 30


def in_process_scores(run_dir: Path, examples: list) -> tuple[np.ndarray, np.ndarray, float]:
    """Score the run's global adapter without the CLI: build, load, predict."""
    cfg = load_config(run_dir / "config.toml")
    model = FedModel.build(cfg.model, get_task("MRPC"), cfg.data.max_length, cfg.seed)
    model.set_params(load_params(run_dir / "checkpoints" / "global.safetensors"))
    return model.predict(model.encode(examples), 64)


def check_against(scores: dict, preds: np.ndarray, labels: np.ndarray) -> None:
    assert scores["n"] == len(labels)
    assert scores["accuracy"] == pytest.approx(accuracy_score(labels, preds), abs=1e-12)
    assert scores["f1"] == pytest.approx(f1_score(labels, preds), abs=1e-12)


def eval_json(*args: str) -> dict:
    result = invoke("eval", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def write_jsonl(path: Path, examples: list, names: tuple[str, ...]) -> Path:
    with path.open("w") as f:
        for e in examples:
            row = {"sentence1": e.text_a, "sentence2": e.text_b, "label": names[e.label], "id": 7}
            f.write(json.dumps(row) + "\n")
    return path


@needs_glue
def test_tiny_eval_on_glue_dir_tsv_file_and_jsonl(tiny_run: Path, tmp_path: Path) -> None:
    dev = load_glue("MRPC", "dev", GLUE_DIR)
    preds, labels, loss = in_process_scores(tiny_run, dev)
    by_dir = eval_json(tiny_run, "--data", GLUE_DIR, "--task", "MRPC")
    assert set(by_dir) == {"global"}
    check_against(by_dir["global"], preds, labels)
    assert by_dir["global"]["n"] == 408
    assert by_dir["global"]["loss"] == pytest.approx(loss, rel=1e-6)
    # the task defaults to the run's; a .tsv file of the task works as well
    assert eval_json(tiny_run, "--data", GLUE_DIR) == by_dir
    assert eval_json(tiny_run, "--data", GLUE_DIR / "MRPC" / "dev.tsv") == by_dir
    # a .jsonl file with the run's text fields and label names
    path = write_jsonl(tmp_path / "dev.jsonl", dev[:50], ("not_equivalent", "equivalent"))
    by_jsonl = eval_json(tiny_run, "--data", path)
    check_against(by_jsonl["global"], preds[:50], labels[:50])


@needs_glue
def test_tiny_personal_eval_of_a_local_run(tmp_path: Path) -> None:
    config = write_config(tmp_path / "local.toml", tiny_raw("algorithm.name=local", "federation.rounds=1"))
    result = invoke("run", "--no-report", config, "--output-dir", tmp_path / "runs", "--quiet")
    assert result.exit_code == 0, result.stderr
    run = only_run_dir(tmp_path / "runs")
    # no global adapter: plain eval refuses, --personal scores each client's adapter
    assert_bad_input(invoke("eval", run, "--data", GLUE_DIR), "no global adapter")
    scores = eval_json(run, "--data", GLUE_DIR, "--personal")
    assert "global" not in scores
    assert set(scores["personal"]["clients"]) == {"0", "1", "2"}
    assert all(v["n"] == 408 for v in scores["personal"]["clients"].values())
    assert set(scores["personal"]["summary"]) == {"accuracy", "f1"}


# --- fedloom eval: bad input exits 2 ------------------------------------------------------


def test_eval_of_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    assert_bad_input(invoke("eval", tmp_path, "--data", tmp_path), "not a run directory")


def test_eval_of_a_run_without_checkpoints(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_config(run / "config.toml", tiny_raw())
    assert_bad_input(invoke("eval", run, "--data", tmp_path), "global.safetensors", "no global adapter")


@needs_glue
def test_eval_with_a_missing_data_file(tiny_run: Path, tmp_path: Path) -> None:
    assert_bad_input(invoke("eval", tiny_run, "--data", tmp_path / "dev.jsonl"),
                     "--data:", "dev.jsonl", "does not exist")


@needs_glue
def test_eval_with_a_bad_data_file(tiny_run: Path, tmp_path: Path) -> None:
    path = tmp_path / "dev.jsonl"
    path.write_text(json.dumps({"sentence1": "a", "label": 1}) + "\n")
    assert_bad_input(invoke("eval", tiny_run, "--data", path), "missing field 'sentence2'")


@needs_glue
def test_eval_with_an_unknown_task(tiny_run: Path) -> None:
    assert_bad_input(invoke("eval", tiny_run, "--data", GLUE_DIR, "--task", "NOPE"),
                     "--task:", "unknown task 'NOPE'")


@needs_glue
def test_eval_personal_of_a_global_run(tiny_run: Path) -> None:
    assert_bad_input(invoke("eval", tiny_run, "--data", GLUE_DIR, "--personal"),
                     "saved no personal adapters")


# --- end to end: MiniLM on real MRPC ------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    require_glue()
    tmp = tmp_path_factory.mktemp("minilm_e2e")
    raw = {
        "name": "e2e",
        "seed": 0,
        "data": {"task": "MRPC", "max_train_examples": 120, "max_dev_examples": 40,
                 "text_fields": ["sentence1", "sentence2"]},
        "partition": {"scheme": "iid", "num_clients": 3, "test_fraction": 0.2},
        "model": {"backbone": "minilm"},
        "algorithm": {"name": "fedavg"},
        "federation": {"rounds": 2},
        "train": {"batch_size": 16},
        "eval": {"every": 1},
        # the gradient diagnostics (MiniLM forward/backward passes beside training, a
        # quarter of the run) measured once, before round 1, not again before round 2
        "diagnostics": {"every": 2},
    }
    config = write_config(tmp / "e2e.toml", raw)
    result = invoke("run", config, "--data-dir", GLUE_DIR, "--output-dir", tmp / "runs",
                    "--set", "train.head_lr=1e-3", "--quiet")
    assert result.exit_code == 0, result.stderr
    return only_run_dir(tmp / "runs"), result.stdout


@pytest.mark.slow
def test_e2e_minilm_run_lowers_the_training_loss(minilm_run: tuple[Path, str]) -> None:
    run, stdout = minilm_run
    for name in ("config.toml", "partition.json", "metrics.jsonl", "summary.json", "run.log"):
        assert (run / name).is_file(), name
    assert (run / "checkpoints" / "global.safetensors").is_file()
    # fedloom run writes the run's report unless --no-report (its content: test_report.py)
    assert (run / "report" / "report.html").is_file() and list((run / "report").glob("*.png"))
    cfg = load_config(run / "config.toml")
    assert cfg.train.head_lr == 1e-3 and cfg.data.data_dir == str(GLUE_DIR)  # overrides recorded
    partition = json.loads((run / "partition.json").read_text())
    assert sum(c["train"] + c["test"] for c in partition["clients"]) == 120

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = {r["round"]: r for r in rows if r["scope"] == "train"}
    dev = {r["round"]: r for r in rows if r["scope"] == "global/dev"}
    assert set(train) == set(dev) == {1, 2}
    assert all(r["failed"] == [] for r in train.values())
    # round 2's clients start from round 1's average: their loss is clearly lower
    # (by 0.029-0.066 over seeds 0-6 on these 120 examples, 0.037-0.069 on 240; the dev
    # loss is too noisy on 40 examples to be a robust check)
    assert train[2]["train_loss"] < train[1]["train_loss"] - 0.01, train
    assert dev[2]["n"] == 40

    summary = json.loads((run / "summary.json").read_text())
    assert summary["global"]["dev"] == {k: v for k, v in dev[2].items() if k not in ("round", "scope")}
    # the final table on stdout
    assert "e2e: fedavg on MRPC" in stdout
    assert "dev (n=40)" in stdout and "accuracy" in stdout and "clients" in stdout
    assert f"{100 * summary['global']['dev']['accuracy']:.1f}" in stdout


@pytest.mark.slow
def test_e2e_eval_matches_in_process_scores(minilm_run: tuple[Path, str], tmp_path: Path) -> None:
    """``fedloom eval`` of the MiniLM run scores its global adapter as this process does,
    from a GLUE directory and from a .jsonl file, on the first 48 dev pairs (the whole dev
    set read from GLUE_DIR, n = 408, is checked on tiny-bert by
    test_tiny_eval_on_glue_dir_tsv_file_and_jsonl: the same reading for any backbone)."""
    run, _ = minilm_run
    dev = load_glue("MRPC", "dev", GLUE_DIR)[:48]
    preds, labels, loss = in_process_scores(run, dev)
    glue = tmp_path / "glue" / "MRPC"
    glue.mkdir(parents=True)
    lines = (GLUE_DIR / "MRPC" / "dev.tsv").read_text().splitlines(True)
    (glue / "dev.tsv").write_text("".join(lines[:49]))  # the header and 48 pairs
    scores = eval_json(run, "--data", glue.parent, "--task", "MRPC")
    check_against(scores["global"], preds, labels)
    assert scores["global"]["n"] == 48
    assert scores["global"]["loss"] == pytest.approx(loss, rel=1e-6)
    assert 0.0 < scores["global"]["accuracy"] < 1.0

    path = write_jsonl(tmp_path / "dev.jsonl", dev, ("not_equivalent", "equivalent"))
    subset = eval_json(run, "--data", path)
    check_against(subset["global"], preds, labels)
    assert subset["global"]["loss"] == pytest.approx(loss, rel=1e-6)


@needs_glue
def test_tiny_eval_on_csv_with_named_fields(tiny_run: Path, tmp_path: Path) -> None:
    dev = load_glue("MRPC", "dev", GLUE_DIR)[:40]
    preds, labels, _ = in_process_scores(tiny_run, dev)
    path = tmp_path / "mine.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["first", "second", "gold"])
        writer.writerows([e.text_a, e.text_b, e.label] for e in dev)
    scores = eval_json(tiny_run, "--data", path, "--text-fields", "first,second", "--label-field", "gold")
    check_against(scores["global"], preds, labels)
    # without the field options the run's own fields are looked for, and are missing
    assert_bad_input(invoke("eval", tiny_run, "--data", path), "mine.csv")

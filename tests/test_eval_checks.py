"""``fedloom eval`` refuses data that do not fit the run (exit 2, one line naming both
sides), reads any file in the run's GLUE layout, says which round it scores and whether
the run finished, and never prints non-strict JSON (issue 8)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import tomli_w
from conftest import GLUE_DIR, require_glue, tiny_raw
from test_custom_task import custom_raw, write_intents
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.data import load_glue

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def make_run(tmp: Path, raw: dict) -> Path:
    config = tmp / "config.toml"
    config.write_text(tomli_w.dumps(raw))
    result = invoke("run", "--no-report", config, "--output-dir", tmp / "runs", "--quiet")
    assert result.exit_code == 0, result.stderr
    (run,) = [p for p in (tmp / "runs").iterdir() if p.is_dir()]
    return run


@pytest.fixture(scope="module")
def mrpc_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_glue()
    raw = tiny_raw()
    raw["data"]["text_fields"] = ["sentence1", "sentence2"]
    return make_run(tmp_path_factory.mktemp("mrpc_eval"), raw)


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("custom_eval")
    return make_run(tmp, custom_raw(tmp))


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mrpc_rows(n: int = 12, label=None) -> list[dict]:
    names = ("not_equivalent", "equivalent")
    return [{"sentence1": e.text_a, "sentence2": e.text_b,
             "label": names[e.label] if label is None else label}
            for e in load_glue("MRPC", "dev", GLUE_DIR)[:n]]


def unlabeled_mrpc(tmp: Path) -> Path:
    """MRPC in the layout of GLUE's test split: an index instead of the label column."""
    lines = (GLUE_DIR / "MRPC" / "dev.tsv").read_text(encoding="utf-8-sig").splitlines()[:6]
    out = ["index\t#1 ID\t#2 ID\t#1 String\t#2 String"]
    out += [f"{i}\t" + line.split("\t", 1)[1] for i, line in enumerate(lines[1:])]
    path = tmp / "test.tsv"
    path.write_text("\n".join(out) + "\n")
    return path


def renamed_sst2(tmp: Path) -> Path:
    path = tmp / "other.tsv"  # no SST-2 folder to give it away: the header does
    path.write_text((GLUE_DIR / "SST-2" / "dev.tsv").read_text(encoding="utf-8"))
    return path


# (which run, a function tmp -> eval arguments after the run dir, fragments of the line)
REFUSALS = [
    pytest.param("mrpc", lambda tmp: ["--data", GLUE_DIR, "--task", "SST-2"],
                 ["--task SST-2", "MRPC (sentence pairs", "cannot score SST-2"], id="mrpc-task-sst2"),
    pytest.param("mrpc", lambda tmp: ["--data", GLUE_DIR / "SST-2" / "dev.tsv"],
                 ["SST-2 data", "dev.tsv", "trained on MRPC"], id="mrpc-sst2-file"),
    pytest.param("mrpc", lambda tmp: ["--data", GLUE_DIR / "SST-2"],
                 ["SST-2 data", "trained on MRPC"], id="mrpc-sst2-folder"),
    pytest.param("mrpc", lambda tmp: ["--data", renamed_sst2(tmp)],
                 ["other.tsv, line 1", "SST-2's GLUE layout", "trained on MRPC"], id="mrpc-sst2-renamed"),
    pytest.param("mrpc", lambda tmp: ["--data", write_rows(tmp / "one.jsonl", [
                     {"sentence": "good", "label": 1}]), "--text-fields", "sentence"],
                 ["--text-fields ['sentence']: 1 text field(s)", "MRPC (sentence pairs", "2 text(s)"],
                 id="mrpc-one-text-field"),
    pytest.param("mrpc", lambda tmp: ["--data", write_rows(tmp / "maybe.jsonl", mrpc_rows(label="maybe"))],
                 ["maybe.jsonl, line 1", "label 'maybe'", "['not_equivalent', 'equivalent']", "trained on MRPC"],
                 id="mrpc-label-name-outside"),
    pytest.param("mrpc", lambda tmp: ["--data", write_rows(tmp / "three.jsonl", mrpc_rows(label=2))],
                 ["three.jsonl, line 1", "label 2", "class id 0..1", "trained on MRPC"],
                 id="mrpc-class-id-outside"),
    pytest.param("mrpc", lambda tmp: ["--data", unlabeled_mrpc(tmp)],
                 ["test.tsv, line 1", "no label column 'Quality'", "cannot be scored"], id="mrpc-unlabeled"),
    pytest.param("mrpc", lambda tmp: ["--data", GLUE_DIR, "--format", "xml"],
                 ["--format 'xml'", "glue, jsonl, csv, tsv"], id="bad-format"),
    pytest.param("custom", lambda tmp: ["--data", GLUE_DIR],
                 ["a directory is read as GLUE data", "the custom task 'custom'",
                  "['billing', 'other', 'tech']"], id="custom-glue-dir"),
    pytest.param("custom", lambda tmp: ["--data", GLUE_DIR / "MRPC" / "dev.tsv"],
                 ["a GLUE MRPC file", "the custom task 'custom'"], id="custom-glue-file"),
    pytest.param("custom", lambda tmp: ["--data", GLUE_DIR / "MRPC" / "dev.tsv", "--format", "glue"],
                 ["GLUE's layout", "the custom task 'custom'"], id="custom-format-glue"),
    pytest.param("custom", lambda tmp: ["--data", write_intents(tmp / "x.jsonl", 4, 0), "--task", "MRPC"],
                 ["--task MRPC", "the custom task 'custom'", "not MRPC"], id="custom-task-mrpc"),
    pytest.param("custom", lambda tmp: ["--data", write_rows(tmp / "new.jsonl", [
                     {"text": "a refund", "intent": "billing"}, {"text": "hi", "intent": "greeting"}])],
                 ["new.jsonl, line 2", "label 'greeting'", "['billing', 'other', 'tech']",
                  "the custom task 'custom'"], id="custom-label-outside"),
    pytest.param("custom", lambda tmp: ["--data", write_intents(tmp / "x.jsonl", 4, 0),
                                        "--text-fields", "text,intent"],
                 ["--text-fields ['text', 'intent']: 2 text field(s)", "the custom task 'custom'"],
                 id="custom-two-text-fields"),
    pytest.param("custom", lambda tmp: ["--data", shutil.copy(write_intents(tmp / "x.jsonl", 4, 0),
                                                              tmp / "x.txt")],
                 ["x.txt", "cannot tell its format", "--format jsonl, csv or tsv"], id="custom-txt"),
]


@pytest.mark.parametrize(("which", "args", "fragments"), REFUSALS)
def test_eval_refuses_data_that_do_not_fit_the_run(
    which: str, args, fragments: list[str], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    run = request.getfixturevalue(f"{which}_run")
    result = invoke("eval", run, *args(tmp_path))
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def eval_ok(*args: object) -> tuple[dict, str]:
    result = invoke("eval", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_any_file_in_the_runs_glue_layout(mrpc_run: Path, tmp_path: Path) -> None:
    by_dir, _ = eval_ok(mrpc_run, "--data", GLUE_DIR, "--task", "mrpc")  # an alias of the run's task
    # MSR's own file name and extension, same columns as GLUE's train/dev
    msr = shutil.copy(GLUE_DIR / "MRPC" / "dev.tsv", tmp_path / "msr_paraphrase_test.txt")
    assert eval_ok(mrpc_run, "--data", msr)[0] == by_dir
    odd = shutil.copy(GLUE_DIR / "MRPC" / "dev.tsv", tmp_path / "pairs.data")
    assert eval_ok(mrpc_run, "--data", odd, "--format", "glue")[0] == by_dir
    # a TSV table with named columns is --format tsv
    dev = load_glue("MRPC", "dev", GLUE_DIR)
    table = tmp_path / "named.tsv"
    table.write_text("a\tb\tgold\n" + "".join(f"{e.text_a}\t{e.text_b}\t{e.label}\n" for e in dev))
    named, _ = eval_ok(mrpc_run, "--data", table, "--format", "tsv", "--text-fields", "a,b",
                       "--label-field", "gold")
    assert named == by_dir
    # without --format the .tsv is read in GLUE's layout, and the line says what to pass
    result = invoke("eval", mrpc_run, "--data", table)
    assert result.exit_code == 2 and "--format tsv" in result.stderr


def test_eval_says_the_round_and_that_the_run_finished(mrpc_run: Path) -> None:
    _, stderr = eval_ok(mrpc_run, "--data", GLUE_DIR)
    assert "global.safetensors from round 2 of 2; the run finished (2 of 2 rounds)" in stderr
    assert "warning" not in stderr


def test_eval_warns_about_an_unfinished_run(mrpc_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(mrpc_run, tmp_path / "run"))
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "running", "round": 1}))
    scores, stderr = eval_ok(run, "--data", GLUE_DIR)
    assert "warning:" in stderr and "round 2 of 2" in stderr
    assert "not finished (status.json: 'running', 1 of 2 rounds completed)" in stderr
    assert scores == eval_ok(mrpc_run, "--data", GLUE_DIR)[0]
    # a run directory without status.json or summary.json
    (run / "status.json").unlink()
    (run / "summary.json").unlink()
    _, stderr = eval_ok(run, "--data", GLUE_DIR)
    assert "warning:" in stderr and "no status.json or summary.json" in stderr


def test_non_finite_scores_print_as_null(mrpc_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def diverged(model, params, features, batch_size):
        return {"accuracy": 0.5, "f1": math.nan, "loss": math.inf, "n": len(features)}

    monkeypatch.setattr("fedloom.evaluation.finished_run.evaluate", diverged)
    result = invoke("eval", mrpc_run, "--data", GLUE_DIR)
    assert result.exit_code == 0, result.stderr

    def refuse(constant: str):
        raise AssertionError(f"non-strict JSON: {constant}")

    scores = json.loads(result.stdout, parse_constant=refuse)
    assert scores == {"global": {"accuracy": 0.5, "f1": None, "loss": None, "n": 408}}
    assert "warning: non-finite values printed as null: global.f1, global.loss" in result.stderr


def test_multi_task_run_scores_one_of_its_tasks(tmp_path: Path) -> None:
    require_glue("MRPC", "SST-2")
    raw = tiny_raw("federation.rounds=1", "partition.num_clients=2", "data.max_train_examples=40")
    raw["partition"]["tasks"] = {"names": ["MRPC", "SST-2"]}
    run = make_run(tmp_path, raw)
    scores, _stderr = eval_ok(run, "--data", GLUE_DIR, "--task", "sst2")
    assert set(scores["global"]) == {"accuracy", "loss", "n"} and scores["global"]["n"] == 872
    for args, fragment in [([], "multi-task run (MRPC, SST-2)"),
                           (["--task", "RTE"], "trained on the tasks ['MRPC', 'SST-2'], not RTE")]:
        result = invoke("eval", run, "--data", GLUE_DIR, *args)
        assert result.exit_code == 2 and fragment in result.stderr, result.stderr


def test_run_files_are_strict_json(tmp_path: Path) -> None:
    from fedloom.runtime.rundir import RunDir

    run = RunDir(tmp_path)

    def refuse(constant: str):
        raise AssertionError(f"non-strict JSON: {constant}")

    run.write_json("summary.json", {"global": {"dev": {"loss": math.nan, "n": 3}}})
    run.append_metrics({"round": 1, "scope": "train", "train_loss": -math.inf})
    assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse) == {
        "global": {"dev": {"loss": None, "n": 3}}}
    row = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert row["train_loss"] is None

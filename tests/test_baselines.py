"""The baselines every client's score is read against (``[eval] baselines``), and the
balanced accuracy that a constant prediction cannot win."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from conftest import tiny_config
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.config import ConfigError, to_toml_dict
from fedloom.data import compute_metrics, get_task
from fedloom.evaluation.majority import majority_label, majority_scores
from fedloom.experiment import Experiment
from fedloom.federation import FederatedData
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

SST2 = get_task("SST-2")


def _balanced(predictions: list[int], labels: list[int], weights: list[float] | None = None):
    from dataclasses import replace

    task = replace(SST2, metrics=("accuracy", "balanced_accuracy"))
    w = None if weights is None else np.array(weights)
    return compute_metrics(task, np.array(predictions), np.array(labels), w)


def test_balanced_accuracy_is_the_mean_recall_of_the_classes_present() -> None:
    # recall of class 0: 1/2, of class 1: 3/3 -> 0.75 (accuracy 4/5)
    scores = _balanced([0, 1, 1, 1, 1], [0, 0, 1, 1, 1])
    assert scores == {"accuracy": pytest.approx(0.8), "balanced_accuracy": pytest.approx(0.75)}
    # a constant prediction scores 1/2 however skewed the labels; accuracy rewards it
    skewed = _balanced([1] * 10, [0] + [1] * 9)
    assert skewed["balanced_accuracy"] == 0.5 and skewed["accuracy"] == pytest.approx(0.9)
    # weights that depend on the class only leave every recall, so the score, unchanged
    weighted = _balanced([0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [3.0, 3.0, 0.5, 0.5, 0.5])
    assert weighted["balanced_accuracy"] == pytest.approx(0.75)
    # an example of weight 0 is not there: its class does not count as present
    assert _balanced([1, 1, 0], [0, 1, 1], [0.0, 1.0, 1.0])["balanced_accuracy"] == 0.5


def test_majority_label_breaks_ties_towards_the_lowest_class() -> None:
    assert majority_label([{"label": 1}, {"label": 1}, {"label": 0}], 2) == 1
    assert majority_label([{"label": 1}, {"label": 0}], 2) == 0
    assert majority_label([{"label": 2}], 3) == 2


def test_majority_scores_predict_one_label_weighted_as_the_split() -> None:
    from dataclasses import replace

    task = replace(SST2, metrics=("accuracy", "balanced_accuracy", "macro_f1"))
    split = [{"label": 1, "weight": 3.0}, {"label": 0, "weight": 1.0}, {"label": 1, "weight": 3.0}]
    scores = majority_scores(task, 1, split)
    assert scores["accuracy"] == pytest.approx(6 / 7)  # the weighted share of label 1
    assert scores["balanced_accuracy"] == 0.5 and scores["n"] == 3
    # macro-F1: F1 of class 1 = 2 * (6/7) / (1 + 6/7), F1 of class 0 = 0
    assert scores["macro_f1"] == pytest.approx((12 / 7) / (13 / 7) / 2)


BASELINES = (
    "algorithm.name='fedavg_ft'",
    "partition.scheme='dirichlet'",
    "partition.alpha=0.5",
    "eval.every=2",
    "eval.metrics=['accuracy','balanced_accuracy','f1']",
)


def test_the_baselines_land_beside_the_run_and_local_is_the_local_algorithm(
    glue_dir: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(*BASELINES, "eval.baselines=['local','majority']", output_dir=tmp_path)
    config = tmp_path / "baselines.toml"
    config.write_text(tomli_w.dumps(to_toml_dict(cfg)))
    result = CliRunner().invoke(app, ["run", str(config), "--no-report"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    # stderr is not a terminal: a line per round and per evaluation, the baseline's too
    phases = [line.split(":")[0] for line in result.stderr.splitlines() if ": " in line]
    assert phases.count("evaluation") == 1 and phases.count("round 2/2") == 1, result.stderr
    assert phases.count("local baseline") == 3  # its two rounds and its evaluation
    assert "evaluation: 3/3 clients scored" in result.stderr
    assert "local baseline: round 2/2" in result.stderr
    # the final table: a row per adapter and baseline
    rows = {line.split("│")[1].strip() for line in result.stdout.splitlines() if "│" in line}
    assert {"personal", "global", "local", "majority"} <= rows
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith(f"{cfg.name}-")]
    run = RunDir(path)
    summary = json.loads((run.path / "summary.json").read_text())
    assert set(summary) >= {"global", "personal", "local", "majority"}
    for kind in ("personal", "local", "majority"):
        assert set(summary[kind]["clients"]) == {"accuracy", "balanced_accuracy", "f1"}
    # the local baseline is its own run directory, and it is exactly a `local` run
    alone = run.path / "baselines" / "local"
    assert json.loads((alone / "status.json").read_text())["state"] == "finished"
    assert json.loads((alone / "summary.json").read_text())["personal"] == summary["local"]
    reference = tiny_config(
        *BASELINES, "algorithm.name='local'", "eval.others='never'", output_dir=tmp_path
    )
    direct = simulate(Experiment.build(reference), RunDir.create(tmp_path, "direct"))
    assert direct["personal"] == summary["local"]
    # the majority label, scored where the adapters are: per client, from its own labels
    data = FederatedData.build(cfg)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    majority = [r for r in rows if r.get("scope") == "majority/clients"][-1]["per_client"]
    counts = data.label_counts()
    for cid, scores in majority.items():
        label = int(np.argmax(counts[int(cid)]))
        assert scores["balanced_accuracy"] in (0.5, 1.0)  # 1.0 only if its split has one class
        if label == 0:
            assert scores["f1"] in (0.0, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("algorithm.name='local'", "eval.baselines=['local']"),
            "eval.baselines: \"local\" is this run's own algorithm",
        ),
        (
            ("runtime.name='flower'", "eval.baselines=['local']"),
            'eval.baselines: "local" trains every client alone in this process',
        ),
        (("eval.baselines=['majority','majority']",), "eval.baselines: names a value twice"),
        (("eval.baselines=['median']",), "eval.baselines"),
        (("eval.metrics=[]",), "eval.metrics"),
    ],
)
def test_bad_baselines_are_refused_by_key(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        tiny_config(*overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("eval.metrics=['accuracy','pearson']",), "eval.metrics: .*not classification metrics"),
        (("eval.metrics=['f1']",), "eval.metrics: .*main_metric 'accuracy' is not one of"),
        (
            ("data.task='STS-B'", "eval.baselines=['majority']"),
            'eval.baselines: "majority" predicts a class; STS-B is a regression task',
        ),
    ],
)
def test_metrics_and_baselines_the_task_cannot_have_are_refused(
    glue_dir: Path, overrides: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        FederatedData.build(tiny_config(*overrides))

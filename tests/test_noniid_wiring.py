"""The non-IID toolbox wired into experiments, runs and the CLI: concept-shifted clients
train on their own labels, drifting clients move during a run, multi-task federations
share one union label space, and ``fedloom partition`` / ``fedloom diagnose`` report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from conftest import needs_glue, tiny_raw
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.config import ConfigError
from fedloom.experiment import Experiment
from fedloom.federation import FederatedData
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

runner = CliRunner()


def rows_of(run: RunDir) -> list[dict]:
    return [json.loads(line) for line in run.metrics_path.read_text().splitlines()]


def toml_file(tmp_path: Path, *overrides: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(tomli_w.dumps(tiny_raw(*overrides, output_dir=tmp_path / "runs")))
    return path


# --- concept shift ------------------------------------------------------------------------


@needs_glue
def test_concept_shifted_clients_train_and_test_on_their_own_labels(make_config) -> None:
    cfg = make_config("partition.num_clients=4", "partition.concept={fraction = 0.5, kind = 'swap'}")
    exp = Experiment.build(cfg)
    shifted = [s for s in exp.data.splits if s.label_map is not None]
    assert len(shifted) == 2
    for client, split in zip(exp.clients, exp.data.splits, strict=True):
        pool = [int(exp.data.train[i].label) for i in split.train]
        seen = [int(f["label"]) for f in client.train]
        expected = pool if split.label_map is None else [int(split.label_map[y]) for y in pool]
        assert seen == expected
        test_pool = [int(exp.data.train[i].label) for i in split.test]
        expected_test = (test_pool if split.label_map is None
                         else [1 - y for y in test_pool])  # swap of the two MRPC labels
        assert [int(f["label"]) for f in client.test] == expected_test
    # the partition statistics count labels as the clients see them
    counts = np.array([c["label_counts"] for c in exp.partition_stats()["clients"]])
    assert counts.tolist() == [
        np.bincount([int(f["label"]) for f in c.train], minlength=2).tolist() for c in exp.clients
    ]


# --- temporal drift -----------------------------------------------------------------------


@needs_glue
def test_drifting_clients_move_during_the_run(make_config, tmp_path: Path) -> None:
    cfg = make_config(
        "federation.rounds=3", "partition.min_size=5",
        "partition.temporal={start_round = 1, end_round = 3, scheme = 'dirichlet', alpha = 0.1}",
    )
    exp = Experiment.build(cfg)
    for client, split in zip(exp.clients, exp.data.splits, strict=True):
        assert split.drift is not None
        for r in (1, 2, 3):
            now = client.at(r)
            assert len(now.train) == len(split.train_at(r))
            assert [f["label"] for f in now.train] == [exp.data.train[i].label for i in split.train_at(r)]
        assert client.at(1).train == client.train  # no move before the start round
    # round 3 is the second partition: the clients hold its (skewed) splits
    assert [len(c.at(3).train) for c in exp.clients] == [len(s.drift.target_train) for s in exp.data.splits]
    run = RunDir.create(tmp_path / "runs", "drift")
    simulate(exp, run)
    diag = [r for r in rows_of(run) if r["scope"] == "diagnostics"]
    js = [r["label_js"]["mean"] for r in diag]
    assert js[0] == pytest.approx(exp.partition_stats(1)["mean_js_to_global"])
    assert js[-1] == pytest.approx(exp.partition_stats(3)["mean_js_to_global"])
    assert js[-1] > js[0]  # IID -> Dirichlet(0.1)
    # clients are scored on their test split of the last round
    final = [r for r in rows_of(run) if r["scope"] == "global/clients"][-1]
    sizes = {str(c.client_id): len(c.at(3).test) for c in exp.clients}
    assert {k: v["n"] for k, v in final["per_client"].items()} == sizes


# --- task heterogeneity -------------------------------------------------------------------


@needs_glue
def test_multitask_federation_shares_a_union_label_space(make_config, tmp_path: Path) -> None:
    cfg = make_config(
        "partition.num_clients=4", "partition.tasks={names = ['MRPC', 'SST-2'], mix = 0.0}",
        "data.max_train_examples=40", "data.max_dev_examples=10",
    )
    data = FederatedData.build(cfg)
    assert data.task.label_names == (
        "MRPC/not_equivalent", "MRPC/equivalent", "SST-2/negative", "SST-2/positive")
    assert len(data.train) == 80 and len(data.dev) == 20
    for e in data.train:
        task = e.meta["task"]
        assert e.text_a.startswith(f"{task}: ")
        assert (e.label < 2) == (task == "MRPC")
    for split in data.splits:  # mix = 0: client k holds task k % 2 only
        tasks = {data.train[i].meta["task"] for i in np.concatenate([split.train, split.test])}
        assert tasks == {("MRPC", "SST-2")[split.client_id % 2]}
    exp = Experiment.build(cfg)
    summary = simulate(exp, RunDir.create(tmp_path / "runs", "tasks"))
    assert summary["task"] == "MRPC+SST-2" and summary["global"]["dev"]["n"] == 20


@needs_glue
def test_multitask_prefix_is_optional(make_config) -> None:
    """Without the prefix the texts are the tasks' own; labels stay in the union space."""
    tasks = "partition.tasks={names = ['MRPC', 'SST-2'], prefix = false}"
    plain = FederatedData.build(make_config(tasks, "data.max_train_examples=40"))
    tagged = FederatedData.build(make_config(tasks.replace("false", "true"),
                                             "data.max_train_examples=40"))
    for a, b in zip(plain.train, tagged.train):
        assert b.text_a == f"{a.meta['task']}: {a.text_a}" and a.label == b.label
    assert not any(e.text_a.startswith(("MRPC: ", "SST-2: ")) for e in plain.train + plain.dev)


def test_multitask_rejects_regression_tasks(make_config) -> None:
    cfg = make_config("partition.tasks={names = ['MRPC', 'STS-B']}")
    with pytest.raises(ConfigError, match=r"partition.tasks.names: STS-B is a regression task"):
        FederatedData.build(cfg)


# --- fedloom partition ---------------------------------------------------------------------


@needs_glue
def test_partition_command_prints_the_table_and_writes_heatmap_and_stats(tmp_path: Path) -> None:
    config = toml_file(tmp_path, "partition.scheme=shards", "partition.shards_per_client=1",
                       "partition.num_clients=4")
    png, stats = tmp_path / "labels.png", tmp_path / "stats.json"
    result = runner.invoke(app, ["partition", str(config), "--heatmap", str(png),
                                 "--json", str(stats)])
    assert result.exit_code == 0, result.output
    assert "4 clients: shards" in result.output and "JS to mix" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads(stats.read_text())
    assert [sum(1 for n in c["label_counts"] if n) for c in written["clients"]] == [1, 1, 1, 1]
    assert not (tmp_path / "runs").exists()  # no run, no model


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("partition.scheme=feature", "partition: scheme 'feature' needs feature"),
        ("partition.shards_per_client=3", "partition: "),  # MRPC has 2 labels
        ("partition.concept={fraction = 2.0}", "partition.concept.fraction"),
    ],
)
@needs_glue
def test_partition_command_names_the_bad_setting(tmp_path: Path, override: str, message: str) -> None:
    extra = ["partition.scheme=shards"] if "shards_per_client" in override else []
    config = toml_file(tmp_path, override, *extra)
    result = runner.invoke(app, ["partition", str(config), "--heatmap", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "x.png").exists()


# --- fedloom diagnose ---------------------------------------------------------------------


@needs_glue
def test_diagnose_command_measures_and_advises(tmp_path: Path) -> None:
    config = toml_file(tmp_path, "partition.num_clients=4", "partition.min_size=5",
                       "partition.concept={fraction = 0.5, kind = 'swap'}")
    out = tmp_path / "diagnosis.json"
    result = runner.invoke(app, ["diagnose", str(config), "--batches", "2", "--examples", "8",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "gradient dissimilarity G²" in result.output and "Recommended" in result.output
    diagnosis = json.loads(out.read_text())
    gradient = diagnosis["gradient"]
    assert set(gradient["per_client"]) == {"0", "1", "2", "3"}
    assert gradient["g2"] == pytest.approx(
        sum(c["train"] * gradient["per_client"][str(c["client_id"])]
            for c in diagnosis["partition"]["clients"])
        / sum(c["train"] for c in diagnosis["partition"]["clients"]))
    assert len(gradient["cosine"]) == 4
    assert diagnosis["advice"]["recommendations"]
    assert not (tmp_path / "runs").exists()

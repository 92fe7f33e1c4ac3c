"""Client faults: drop-outs, stragglers, crashes and garbage updates leave exactly the
expected clients out of each round, with the reason in metrics.jsonl; the server rejects
garbage whatever its source; a round below quorum fails, is skipped or is retried by
policy, never averaged over nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import identical, needs_glue, tiny_raw

from fedloom.config import ConfigError, validate
from fedloom.experiment import Experiment
from fedloom.runtime import faults
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import AllClientsFailed, simulate


def _config(tmp_path: Path, *overrides: str, faults_section: dict | None = None):
    raw = tiny_raw("partition.num_clients=4", "data.max_train_examples=80",
                   "federation.rounds=3", "eval.every=3", *overrides, output_dir=tmp_path)
    if faults_section:
        raw["faults"] = faults_section
    return validate(raw)


def _train_rows(cfg, tmp_path: Path) -> tuple[list[dict], RunDir]:
    run = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(Experiment.build(cfg), run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    return [r for r in rows if r["scope"] == "train"], run


@needs_glue
def test_stragglers_miss_every_round_and_the_others_report(tmp_path: Path) -> None:
    cfg = _config(tmp_path, faults_section={"speeds": {"3": 0.25, "1": 0.6}, "deadline": 2.0})
    rows, _ = _train_rows(cfg, tmp_path)
    for row in rows:
        assert row["clients"] == [0, 1, 2, 3]
        assert row["failed"] == [3] and sorted(row["per_client"]) == ["0", "1", "2"]
        assert row["missing"] == {"3": "straggler: needs 4 round times, the deadline is 2"}


@needs_glue
@pytest.mark.parametrize(("kind", "reason"), [
    ("nan", "non-finite values"), ("shape", "classifier.bias: shape (3,), sent as (2,)"),
    ("dtype", "dtype torch.float64, sent as torch.float32"),
    ("oversize", "oversize update"),
])
def test_garbage_updates_are_rejected_with_their_reason(kind: str, reason: str,
                                                        tmp_path: Path) -> None:
    cfg = _config(tmp_path, faults_section={"garbage": {"2": kind}})
    rows, run = _train_rows(cfg, tmp_path)
    for row in rows:
        assert row["failed"] == [2] and sorted(row["per_client"]) == ["0", "1", "3"]
        assert row["missing"]["2"].startswith("rejected: ") and reason in row["missing"]["2"]
    params = load_params(run.checkpoints / "global.safetensors")
    assert all(torch.isfinite(t).all() and t.dtype == torch.float32 for t in params.values())


@needs_glue
def test_dropouts_and_crashes_match_their_draws(
        tmp_path: Path) -> None:
    cfg = _config(tmp_path, "algorithm.name=ditto", "federation.rounds=4",
                  faults_section={"dropout": 0.3, "crash": 0.2})
    rows, _ = _train_rows(cfg, tmp_path)
    left_out = 0
    for r, row in enumerate(rows):
        expected = {}
        for c in range(4):
            fate = faults.fate(cfg, r, 0, c)
            if fate.crashes:
                expected[str(c)] = "crashed in local training (simulated)"
            elif fate.drops_out:
                expected[str(c)] = "dropped out mid-round (simulated)"
        assert row["missing"] == expected
        assert sorted(row["per_client"]) == sorted(set("0123") - set(expected))
        left_out += len(expected)
    assert 0 < left_out < 16  # both kinds of rounds happen at this seed


def test_fault_draws_have_their_rates() -> None:
    cfg = _config(Path("."), faults_section={"dropout": 0.3, "crash": 0.1})
    fates = [faults.fate(cfg, r, 0, c) for r in range(500) for c in range(4)]
    n = len(fates)
    for p, hits in ((0.3, sum(f.drops_out for f in fates)), (0.1, sum(f.crashes for f in fates))):
        assert abs(hits - p * n) < 4 * np.sqrt(n * p * (1 - p))  # binomial, 4 sigma


@needs_glue
def test_below_quorum_fails_by_default(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "federation.min_clients=3",
                  faults_section={"garbage": {"1": "nan", "2": "nan"}})
    with pytest.raises(AllClientsFailed, match=r"round 1: 2 of the 4 sampled clients reported, "
                                               r"fewer than federation.min_clients = 3"):
        simulate(Experiment.build(cfg), RunDir.create(tmp_path / "runs", cfg.name))


@needs_glue
def test_a_skipped_round_leaves_the_server_state_unchanged(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "federation.min_clients=3", "federation.below_quorum=skip",
                  faults_section={"garbage": {"1": "nan", "2": "nan"}})
    exp = Experiment.build(cfg)
    start = exp.model.get_params()
    run = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    train = [r for r in rows if r["scope"] == "train"]
    assert all(r["skipped"].startswith(f"round {r['round']}: 2 of the 4") for r in train)
    assert all(r["train_loss"] is not None for r in train)  # the two that reported
    assert identical(load_params(run.checkpoints / "global.safetensors"), start)


@needs_glue
def test_a_retried_round_draws_a_fresh_sample(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "federation.fraction=0.5", "federation.min_clients=2",
                  "federation.below_quorum=retry", "federation.retries=5",
                  faults_section={"garbage": {"0": "nan"}})
    rows, _ = _train_rows(cfg, tmp_path)
    for row in rows:
        for attempt in row.get("retried", []):
            assert 0 in attempt["clients"] and attempt["missing"] == {
                "0": "rejected: " + attempt["missing"]["0"][len("rejected: "):]}
        assert 0 not in row["clients"] and len(row["per_client"]) == 2
    assert any(row.get("retried") for row in rows)


def test_update_checks_on_constructed_updates() -> None:
    w = torch.zeros(3, 2)
    payload = {"a.weight": w, "b.weight": torch.zeros(4)}
    ok = {"a.weight": w + 1, "scaffold.dc/a.weight": w, "rela.task_vector": torch.zeros(7)}
    assert faults.update_problem(ok, payload, None) is None
    assert "shape (3, 3)" in faults.update_problem(
        {"scaffold.dc/a.weight": torch.zeros(3, 3)}, payload, None)
    assert "dtype torch.float16" in faults.update_problem(
        {"rela.task_vector": torch.zeros(7, dtype=torch.float16)}, payload, None)
    assert "oversize update: 56 bytes, the limit is 40" in faults.update_problem(
        {"a.weight": w, "b.weight": torch.zeros(8)}, payload, 40)


def test_fault_clients_must_exist(tmp_path: Path) -> None:
    raw = tiny_raw(output_dir=tmp_path)
    raw["faults"] = {"garbage": {"7": "nan"}}
    with pytest.raises(ConfigError, match=r"faults.garbage: \[7\] are not clients"):
        validate(raw)

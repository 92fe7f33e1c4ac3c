"""Every registered algorithm runs through the embedded simulator on tiny-bert and a small
real MRPC subset: the tiny config of conftest.py (3 clients, 2 rounds of 2 local steps,
evaluated every round), so the second round trains from what the first aggregated. A new
algorithm is covered by registering it; one that cannot run on this federation with its
defaults gets its settings in ``REQUIRED_SETTINGS``.

Each run must finish with a complete run directory, finite losses, scores for what the
method defines (a global adapter, personal ones, or both), a global checkpoint holding
exactly the model's adapter tensors and the method's merged updates (SCAFFOLD's control
variates never leak into it) and moved by training, and personal adapters that the last
round moved. All of them take about a minute in one process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import needs_glue

from fedloom import algorithms
from fedloom.config import ExperimentConfig
from fedloom.experiment import Experiment
from fedloom.models.merged import MERGED
from fedloom.params import Params
from fedloom.runtime.rundir import RunDir, load_params, previous_checkpoint
from fedloom.server import simulate

#: what an algorithm cannot run the tiny federation (3 clients, all sampled every round)
#: without, and why; every other algorithm runs with its defaults
REQUIRED_SETTINGS: dict[str, list[str]] = {
    # q-FFL's Lipschitz estimate is L = 1 / client_learning_rate, which has no default
    "qfedavg": ["algorithm.client_learning_rate=0.005"],
    # the default beta = 0.2 trims floor(0.2 x 3) = 0 of 3 clients, refused as the plain
    # mean: 0.34 trims one from each end
    "trimmed_mean": ["aggregation.beta=0.34"],
}

RUN_FILES = ("config.toml", "versions.json", "partition.json", "metrics.jsonl",
             "summary.json", "status.json", "run.log")


def test_the_required_settings_name_registered_algorithms() -> None:
    assert set(REQUIRED_SETTINGS) <= set(algorithms.available())


def metrics_rows(run: RunDir) -> list[dict[str, Any]]:
    return [json.loads(line) for line in run.metrics_path.read_text().splitlines()]


def check_run_dir(run: RunDir, cfg: ExperimentConfig) -> None:
    for name in RUN_FILES:
        assert (run.path / name).is_file(), name
    assert not list(run.path.rglob("*.tmp"))  # no leftovers of atomic writes
    status = json.loads((run.path / "status.json").read_text())
    assert (status["state"], status["round"]) == ("finished", cfg.federation.rounds)


def check_global(run: RunDir, summary: dict[str, Any], start: Params) -> None:
    """The global adapter: scored on the dev set, checkpointed with exactly the model's
    adapter tensors plus any merged updates, and moved by training."""
    assert math.isfinite(summary["global"]["dev"]["loss"])
    final = load_params(run.checkpoints / "global.safetensors")
    assert set(start) <= set(final)
    assert all(name.endswith(MERGED) for name in set(final) - set(start))
    assert any(not torch.equal(final[n], start[n]) for n in start)


def check_personal(run: RunDir, summary: dict[str, Any], num_clients: int) -> None:
    """Every client's own adapter: scored on its own split, checkpointed, and moved by the
    last round (its checkpoint differs from the one the round before wrote)."""
    scores = summary["personal"]["clients_split"][summary["main_metric"]]
    assert scores["n"] == num_clients and math.isfinite(scores["mean"])
    for client_id in range(num_clients):
        path = run.checkpoints / "personal" / f"client_{client_id:03d}.safetensors"
        mine, before = load_params(path), load_params(previous_checkpoint(path))
        assert set(mine) == set(before)
        assert any(not torch.equal(mine[n], before[n]) for n in mine), client_id


@needs_glue
@pytest.mark.parametrize("name", algorithms.available())
def test_algorithm_runs_end_to_end(name: str, make_config, tmp_path: Path) -> None:
    cfg = make_config(f"algorithm.name={name}", *REQUIRED_SETTINGS.get(name, []))
    exp = Experiment.build(cfg)
    start = exp.model.get_params()
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)

    assert summary["algorithm"] == name
    check_run_dir(run, cfg)
    rows = metrics_rows(run)
    losses = [r["train_loss"] for r in rows if r["scope"] == "train"]
    assert len(losses) == cfg.federation.rounds and all(map(math.isfinite, losses)), losses
    scored = {r["round"] for r in rows if r["scope"] in ("global/dev", "personal/clients")}
    assert scored == set(range(1, cfg.federation.rounds + 1))  # eval.every = 1

    alg = exp.algorithm
    assert ("global" in summary) == alg.has_global
    assert ("personal" in summary) == alg.personalized
    if alg.has_global:
        check_global(run, summary, start)
    if alg.personalized:
        check_personal(run, summary, len(exp.clients))

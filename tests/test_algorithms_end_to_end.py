"""Every algorithm of issue 4 runs through the embedded simulator on tiny-bert and a small
real MRPC subset: finite losses, a moved global adapter, and a checkpoint holding exactly
the model's adapter tensors (SCAFFOLD's control variates never leak into it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import needs_glue

from fedloom.experiment import Experiment
from fedloom.runtime.local import simulate
from fedloom.runtime.rundir import RunDir, load_params

CASES = {
    "fedavgm": ["algorithm.server_momentum=0.9"],
    "fedadagrad": ["algorithm.eta=0.01"],
    "fedadam": ["algorithm.eta=0.01"],
    "fedyogi": [],
    "qfedavg": ["algorithm.client_learning_rate=0.005", "algorithm.q=1.0"],
    "fedprox": ["algorithm.proximal_mu=0.1"],
    "median": [],
    "trimmed_mean": ["aggregation.beta=0.34"],
    "krum": [],
    "multikrum": ["aggregation.num_nodes_to_select=2"],
    "fedsgd": [],
    "scaffold": [],
    "fednova": [],
    "fedmgda_plus": [],
}


@needs_glue
@pytest.mark.parametrize("name", sorted(CASES))
def test_algorithm_runs_end_to_end(name: str, make_config, tmp_path: Path) -> None:
    cfg = make_config(f"algorithm.name={name}", *CASES[name])
    exp = Experiment.build(cfg)
    start = exp.model.get_params()
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    assert summary["algorithm"] == name
    assert math.isfinite(summary["global"]["dev"]["loss"])
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    losses = [r["train_loss"] for r in rows if r["scope"] == "train"]
    assert len(losses) == cfg.federation.rounds and all(math.isfinite(v) for v in losses)
    final = load_params(run.checkpoints / "global.safetensors")
    assert set(final) == set(start)
    assert any(not torch.equal(final[n], start[n]) for n in start)

"""benchmarks/fedmosaic_gates.py: the gate values of a finished mixed-backbone FedMosaic
run, read from the models `fedloom eval` rebuilds (aligned PQ-LoRA factors included)."""

from __future__ import annotations

import math
from pathlib import Path

from conftest import GLUE_DIR, needs_glue, tiny_raw

from benchmarks.fedmosaic_gates import client_gates
from fedloom.config import validate
from fedloom.evaluation.finished_run import score_run
from fedloom.experiment import Experiment
from fedloom.runtime.local import simulate
from fedloom.runtime.rundir import RunDir, load_params, save_params


@needs_glue
def test_gates_are_read_per_client_and_follow_the_checkpoint(tmp_path: Path) -> None:
    raw = tiny_raw("algorithm.name=fedmosaic", "diagnostics.every=0", "federation.rounds=2",
                   "partition.num_clients=4", output_dir=tmp_path)
    raw["model"]["groups"] = [{"clients": [2, 3], "backbone": "tiny-llama"}]
    cfg = validate(raw)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(Experiment.build(cfg), run)

    gates = client_gates(run.path, GLUE_DIR, examples=100_000)  # the whole dev split
    assert sorted(gates) == [0, 1, 2, 3]
    assert [gates[c]["backbone"] for c in range(4)] == ["tiny-bert"] * 2 + ["tiny-llama"] * 2
    scored = score_run(run.path, GLUE_DIR, personal=True, notify=lambda _: None)
    for cid, r in gates.items():  # the same models and adapters as `fedloom eval --personal`
        assert r["layers"] > 0 and r["n"] == scored["personal"]["clients"][str(cid)]["n"]
        assert r["accuracy"] == scored["personal"]["clients"][str(cid)]["accuracy"]
        assert 0 < r["g_p10"] <= r["g_mean"] <= r["g_p90"] < 1
        assert r["g_mean"] != 0.5  # two rounds of training moved the gates off their start

    # b = +inf pins every gate of client 1 to its global slot: g = 1 exactly, σ(b) = 1
    path = run.checkpoints / "personal" / "client_001.safetensors"
    params = load_params(path)
    biases = [k for k in params if ".lora_gate." in k and k.endswith("proj.bias")]
    assert biases
    save_params(path, {k: v.fill_(math.inf) if k in biases else v for k, v in params.items()})
    pinned = client_gates(run.path, GLUE_DIR, examples=100_000)
    assert pinned[1]["g_mean"] == pinned[1]["g_p10"] == 1.0 and pinned[1]["sigmoid_bias"] == 1.0
    assert pinned[0] == gates[0]  # the other clients' gates are read from their own files

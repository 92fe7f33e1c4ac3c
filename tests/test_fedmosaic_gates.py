"""benchmarks/fedmosaic_gates.py: the gate values of a finished mixed-backbone FedMosaic
run, read from the models `fedloom eval` rebuilds (aligned PQ-LoRA factors included), and
each adapter scored on its client's own labeling with its gates pinned to one branch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import GLUE_DIR, needs_glue, tiny_raw

from benchmarks.fedmosaic_gates import client_gates, pinned
from fedloom.config import validate
from fedloom.evaluation.finished_run import score_run
from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir, load_params, save_params
from fedloom.server import simulate


@needs_glue
def test_gates_are_read_per_client_and_follow_the_checkpoint(tmp_path: Path) -> None:
    raw = tiny_raw("algorithm.name=fedmosaic", "diagnostics.every=0", "federation.rounds=2",
                   "partition.num_clients=4", output_dir=tmp_path)
    raw["model"]["groups"] = [{"clients": [2, 3], "backbone": "tiny-llama"}]
    raw["partition"]["concept"] = {"clients": [0, 2], "kind": "swap"}
    cfg = validate(raw)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(Experiment.build(cfg), run)

    # the first 100 pairs of the dev split, in its GLUE layout: what `fedloom eval` and the
    # gates read alike (the relations below hold pair by pair)
    dev = tmp_path / "dev.tsv"
    dev.write_text("".join((GLUE_DIR / "MRPC" / "dev.tsv").read_text().splitlines(True)[:101]))
    gates = client_gates(run.path, dev, examples=100_000)  # the whole file
    assert sorted(gates) == [0, 1, 2, 3]
    assert [gates[c]["backbone"] for c in range(4)] == ["tiny-bert"] * 2 + ["tiny-llama"] * 2
    scored = score_run(run.path, dev, personal=True, notify=lambda _: None)
    assert all(r["n"] == 100 for r in gates.values())
    for cid, r in gates.items():  # the same models and adapters as `fedloom eval --personal`
        assert r["layers"] > 0 and r["n"] == scored["personal"]["clients"][str(cid)]["n"]
        assert r["accuracy"] == scored["personal"]["clients"][str(cid)]["accuracy"]
        # the own labeling of a swapped client is the other label of every dev pair
        assert r["own"] == pytest.approx(1 - r["accuracy"] if cid in (0, 2) else r["accuracy"])
        assert 0 < r["g_p10"] <= r["g_mean"] <= r["g_p90"] < 1
        assert r["g_mean"] != 0.5  # two rounds of training moved the gates off their start

    # b = +inf pins every gate of client 1 to its global slot: g = 1 exactly, σ(b) = 1
    path = run.checkpoints / "personal" / "client_001.safetensors"
    params = load_params(path)
    biases = [k for k in params if ".lora_gate." in k and k.endswith("proj.bias")]
    assert biases
    for bias in (math.inf, -math.inf):  # pinning changes the gates' biases and nothing else
        out = pinned(params, bias)
        assert sorted(k for k in params if not torch.equal(out[k], params[k])) == sorted(biases)
        assert all(torch.all(out[k] == bias) for k in biases)
    save_params(path, {k: v.fill_(math.inf) if k in biases else v for k, v in params.items()})
    slot = client_gates(run.path, dev, examples=100_000)
    assert slot[1]["g_mean"] == slot[1]["g_p10"] == 1.0 and slot[1]["sigmoid_bias"] == 1.0
    assert slot[0] == gates[0]  # the other clients' gates are read from their own files
    # pinned to the slot, the gated adapter is the slot alone, and its local branch is unused
    assert slot[1]["own"] == slot[1]["slot"] == gates[1]["slot"]
    assert slot[1]["local"] == gates[1]["local"]

    # b = -inf pins client 2's gates to its local adapter: the gated score is the local one
    path = run.checkpoints / "personal" / "client_002.safetensors"
    params = load_params(path)
    save_params(path, {k: v.fill_(-math.inf) if k.endswith(".lora_gate.proj.bias") else v
                       for k, v in params.items()})
    local = client_gates(run.path, dev, examples=100_000)[2]
    assert local["g_mean"] == local["g_p90"] == 0.0
    assert local["own"] == local["local"] == gates[2]["local"]
    assert local["slot"] == gates[2]["slot"]

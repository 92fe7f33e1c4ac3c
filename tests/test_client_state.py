"""Client-side state: stored and restored exactly, written by the simulator for every
client, and never changed by scoring; the local method sends nothing to the server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import needs_glue

from fedloom.algorithms import ClientResult
from fedloom.experiment import Experiment
from fedloom.runtime.client_state import load_client_state, save_client_state
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate


def test_state_round_trips_exactly(tmp_path: Path) -> None:
    w = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([{"params": [w], "lr": 1e-3, "kind": "adapters"}])
    w.grad = torch.randn(3, 2)
    opt.step()
    state = {
        "optimizer": opt.state_dict(),
        "adapter": {"layer.lora_A.weight": torch.randn(4, 5), "head.bias": torch.zeros(2)},
        "alpha": 0.25, "steps": 7, "note": "x", "nothing": None, "flags": [True, False],
    }
    path = tmp_path / "c.safetensors"
    save_client_state(path, state, round_=3, client_id=5)
    back = load_client_state(path)
    assert back["alpha"] == 0.25 and back["steps"] == 7 and back["note"] == "x"
    assert back["nothing"] is None and back["flags"] == [True, False]
    assert set(back["optimizer"]["state"]) == {0}  # int keys stay ints
    for k, v in state["optimizer"]["state"][0].items():
        assert torch.equal(back["optimizer"]["state"][0][k], v)
    for k, v in state["adapter"].items():
        assert torch.equal(back["adapter"][k], v)
    restored = torch.optim.AdamW([{"params": [w], "lr": 1e-3, "kind": "adapters"}])
    restored.load_state_dict(back["optimizer"])  # usable as an optimizer state


def test_unstorable_state_is_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="/model"):
        save_client_state(tmp_path / "c.safetensors", {"model": object()}, 1, 0)


@needs_glue
def test_local_keeps_adapters_on_clients(make_config, tmp_path: Path, monkeypatch) -> None:
    exp = Experiment.build(make_config("algorithm.name=local", "partition.val_fraction=0.25"))
    sent: list[ClientResult] = []
    aggregate = type(exp.algorithm).aggregate

    def spy(self, state, results):
        sent.extend(results)
        return aggregate(self, state, results)

    monkeypatch.setattr(type(exp.algorithm), "aggregate", spy)
    run = RunDir.create(tmp_path / "runs", "local")
    summary = simulate(exp, run)
    assert sent and all(r.params == {} for r in sent)  # nothing reaches the server
    assert "global" not in summary
    assert set(summary["personal"]) == {"clients", "val", "clients_split"}
    for c in exp.clients:
        state = load_client_state(run.checkpoints / "clients" / f"client_{c.client_id:03d}.safetensors")
        personal = load_params(run.checkpoints / "personal" / f"client_{c.client_id:03d}.safetensors")
        assert personal.keys() == state["adapter"].keys()
        for name, value in personal.items():
            assert torch.equal(value, state["adapter"][name])
        assert c.val and len(c.val) + len(c.train) == 16  # 20 of 60 examples per client, 4 test


@needs_glue
def test_local_is_sent_the_initial_adapter_once(make_config, tmp_path: Path) -> None:
    """A client holds its adapter after its first accepted round: it is sent nothing
    after that, so the bytes down count each client's first hand-out only."""
    from fedloom.algorithms.lora_factors import wire_bytes

    exp = Experiment.build(make_config(
        "algorithm.name=local", "partition.num_clients=4", "federation.fraction=0.5",
        "federation.rounds=4",
    ))
    initial = wire_bytes(exp.model.get_params())
    run = RunDir.create(tmp_path / "runs", "local")
    simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    train = [r for r in rows if r["scope"] == "train"]
    seen: set[int] = set()
    for row in train:  # two of four clients a round, each sent the adapter on its first
        sampled = set(map(int, row["per_client"]))
        assert row["bytes_down"] == initial * len(sampled - seen)
        seen |= sampled
    assert sum(r["bytes_down"] for r in train) == initial * len(seen) < initial * 8

    state = exp.algorithm.init(exp.model.get_params())
    state = exp.algorithm.aggregate(state, [ClientResult(1, {}, 10)])
    assert exp.algorithm.payload(state, 1) == {}
    assert exp.algorithm.payload(state, 0) is state.global_params  # not a holder yet


def test_local_names_a_client_that_lost_its_adapter() -> None:
    from types import SimpleNamespace

    from fedloom.algorithms.local import Local

    ctx = SimpleNamespace(client_id=3, state={})  # what client_adapter reads of a context
    with pytest.raises(RuntimeError, match="client 3: .* its local state has none"):
        Local().client_adapter(ctx, {})


@needs_glue
def test_scoring_does_not_change_client_state(make_config, monkeypatch) -> None:
    """The runtime hands scoring a copy: even a client_adapter that scribbles over its
    state (here: in place) cannot change what the client trains on next."""
    from fedloom.algorithms.local import Local
    from fedloom.evaluation.round import evaluate_state
    from fedloom.runtime.clients import ClientHost

    def careless(self, ctx, payload):
        for t in ctx.state["adapter"].values():
            t.add_(1.0)
        return ctx.state["adapter"]

    monkeypatch.setattr(Local, "client_adapter", careless)
    exp = Experiment.build(make_config("algorithm.name=local"))
    state = exp.algorithm.init(exp.model.get_params())
    adapter = {n: t + 1.0 for n, t in exp.model.get_params().items()}
    local = {c.client_id: {"adapter": dict(adapter)} for c in exp.clients}
    host = ClientHost(exp, [c.client_id for c in exp.clients])
    host.states.update(local)
    evaluation = evaluate_state(exp, state, 1, host)
    assert set(evaluation.adapters) == {c.client_id for c in exp.clients}
    for c in exp.clients:
        for name, value in local[c.client_id]["adapter"].items():
            assert torch.equal(value, adapter[name])

"""Many clients, one pass (fedloom.train.together): K clients trained as one batched
forward and backward equal training them one by one with train_locally (adapters,
metrics, persisted optimizer moments), clip per client, and fail alone."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import needs_glue, tiny_config
from torch import nn

from fedloom.experiment import Experiment
from fedloom.runtime.clients import client_context
from fedloom.train.local import train_locally
from fedloom.train.together import group_key, supported, train_together

pytestmark = needs_glue


def _without_dropout(exp: Experiment) -> Experiment:
    for module in exp.model.head.modules():  # the backbone's too: masks are random
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return exp


def _one_by_one(exp: Experiment, starts: dict, states: dict, round_: int) -> dict:
    out = {}
    for client in exp.clients:
        ctx = client_context(exp, client, round_, states[client.client_id])
        exp.model.set_params(starts[client.client_id])
        metrics = train_locally(ctx)
        out[client.client_id] = (exp.model.get_params(), metrics)
    return out


def _together(exp: Experiment, starts: dict, states: dict, round_: int) -> dict:
    ctxs = [client_context(exp, c, round_, states[c.client_id]) for c in exp.clients]
    before = exp.model.get_params()
    results = train_together(ctxs, [starts[c.client_id] for c in exp.clients])
    after = exp.model.get_params()
    assert all(torch.equal(before[n], after[n]) for n in before)  # the model is untouched
    return {c.client_id: (params, metrics) for c, (params, metrics, _) in zip(exp.clients, results)}


def _close(a: dict, b: dict, tol: float) -> None:
    for name, tensor in a.items():
        assert torch.allclose(tensor, b[name], rtol=tol, atol=tol), name


@pytest.mark.parametrize("overrides", [
    ("train.optimizer=\"adamw\"", "train.clip_norm=1.0"),
    ("train.optimizer=\"sgd\"", "train.clip_norm=0.05", "train.schedule=\"cosine\""),
    ("train.local_steps=3", "train.batch_size=7", "model.pooling=\"cls\"",
     "partition.scheme=\"dirichlet\"", "partition.alpha=1.0"),  # unequal clients
])
def test_clients_trained_together_equal_one_by_one_over_rounds(overrides: tuple) -> None:
    cfg = tiny_config("model.lora.dropout=0.0", "model.head_dropout=0.0", *overrides)
    exp = _without_dropout(Experiment.build(cfg))
    start = exp.model.get_params()
    torch.manual_seed(1)  # a different start per client
    starts = {c.client_id: {n: t + 0.01 * torch.randn_like(t) for n, t in start.items()}
              for c in exp.clients}
    alone = {c.client_id: {} for c in exp.clients}
    together = copy.deepcopy(alone)
    for round_ in range(2):  # the second round starts from persisted moments
        assert len({group_key(client_context(exp, c, round_, together[c.client_id]))
                    for c in exp.clients}) == 1
        expected = _one_by_one(exp, starts, alone, round_)
        got = _together(exp, starts, together, round_)
        for cid, (params, metrics) in expected.items():
            _close(params, got[cid][0], 1e-5)
            assert got[cid][1].keys() == metrics.keys()
            for key, value in metrics.items():
                assert got[cid][1][key] == pytest.approx(value, rel=1e-5), key
            assert not torch.equal(params[next(iter(params))], starts[cid][next(iter(params))])
        for cid in alone:
            a, b = alone[cid]["optimizer"]["state"], together[cid]["optimizer"]["state"]
            assert a.keys() == b.keys()
            for index in a:
                for key, value in a[index].items():
                    assert torch.allclose(value, b[index][key], rtol=1e-5, atol=1e-7), key
        starts = {cid: params for cid, (params, _) in expected.items()}


def test_a_client_with_a_non_finite_loss_fails_alone() -> None:
    cfg = tiny_config("model.lora.dropout=0.0", "model.head_dropout=0.0")
    exp = _without_dropout(Experiment.build(cfg))
    start = exp.model.get_params()
    head = next(n for n in start if n.startswith("classifier.weight"))
    broken = {**start, head: torch.full_like(start[head], float("nan"))}
    ctxs = [client_context(exp, c, 0, {}) for c in exp.clients]
    results = train_together(ctxs, [start, broken, start])
    assert results[1][0] is None and "non-finite loss at local step 0" in results[1][2]
    assert "optimizer" not in ctxs[1].state
    exp.model.set_params(start)
    alone = client_context(exp, exp.clients[0], 0, {})
    train_locally(alone)
    _close(exp.model.get_params(), results[0][0], 1e-5)


def test_what_cannot_train_together_says_why() -> None:
    assert supported(Experiment.build(tiny_config()).model, tiny_config().train) is None
    verbalizer = Experiment.build(tiny_config('model.backbone="tiny-llama"'))
    assert "classifier head" in supported(verbalizer.model, verbalizer.cfg.train)
    accum = tiny_config("train.grad_accum=2")
    assert "grad_accum" in supported(Experiment.build(accum).model, accum.train)
    dual = Experiment.build(tiny_config('algorithm.name="fedmosaic"'))
    assert "linear layer" in supported(dual.model, dual.cfg.train)


def _final_global(tmp_path: Path, *overrides: str) -> tuple[dict, list]:
    from fedloom.runtime.rundir import RunDir, load_params
    from fedloom.server import simulate

    cfg = tiny_config("model.lora.dropout=0.0", "model.head_dropout=0.0", *overrides,
                      output_dir=tmp_path)
    exp = _without_dropout(Experiment.build(cfg))
    run = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    losses = [r["per_client"] for r in rows if r.get("scope") == "train"]
    return load_params(run.checkpoints / "global.safetensors"), losses


def test_a_simulation_with_clients_together_equals_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fedloom.runtime import clients

    one, one_losses = _final_global(tmp_path / "one", "train.clients_per_pass=1")
    passes = []
    monkeypatch.setattr(clients, "train_together", lambda ctxs, starts: passes.append(
        [c.client_id for c in ctxs]) or train_together(ctxs, starts))
    together, losses = _final_global(tmp_path / "together", "train.clients_per_pass=3")
    assert passes == [[0, 1, 2], [0, 1, 2]]
    _close(one, together, 1e-5)
    assert len(losses) == 2 and [r.keys() for r in losses] == [r.keys() for r in one_losses]
    for a, b in zip(one_losses, losses):
        assert b == pytest.approx(a, rel=1e-5)


def test_simulated_faults_hit_clients_trained_together_as_one_by_one(tmp_path: Path) -> None:
    faults = ("federation.rounds=5", "faults.crash=0.3", "faults.dropout=0.3",
              'faults.garbage={"2" = "nan"}', 'federation.below_quorum="skip"')
    one, one_losses = _final_global(tmp_path / "one", *faults)
    together, losses = _final_global(tmp_path / "together", "train.clients_per_pass=3", *faults)
    _close(one, together, 1e-5)
    assert [r.keys() for r in losses] == [r.keys() for r in one_losses]
    assert {len(r) for r in losses} != {3}  # some client failed in some round


@pytest.mark.parametrize(("overrides", "groups"), [
    (("train.clients_per_pass=2",), [[0, 1], [2]]),
    (("train.clients_per_pass=8",), [[0, 1, 2]]),
    (("train.clients_per_pass=8", 'algorithm.name="fedprox"'), [[0], [1], [2]]),
    (("train.clients_per_pass=8", "train.local_steps=null", "train.local_epochs=1.0",
      'partition.scheme="dirichlet"', "partition.alpha=1.0"), [[0], [1], [2]]),
])
def test_who_trains_together(overrides: tuple, groups: list) -> None:
    from fedloom.runtime.clients import ClientHost

    exp = Experiment.build(tiny_config(*overrides))
    assert ClientHost(exp, [0, 1, 2]).passes(0, [0, 1, 2]) == groups

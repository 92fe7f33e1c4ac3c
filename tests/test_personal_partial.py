"""Partial personalization (FedPer, LG-FedAvg, FedRep, FedSA-LoRA) and FedAvg-FT on
tiny-bert and a small real MRPC subset: what crosses the client/server boundary, which
tensors each FedRep phase moves, what fine-tuning does to a client's loss and state,
and what the run's checkpoints hold."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from conftest import identical, needs_glue, require_glue, tiny_config

from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedavg_ft import HOLDOUT_SALT, FedAvgFT
from fedloom.algorithms.partial import PERSONAL, PartialFedAvg
from fedloom.config import load_config
from fedloom.data.holdout import hold_out
from fedloom.experiment import VALIDATION_SALT, Experiment
from fedloom.params import Params
from fedloom.runtime.client_state import load_client_state
from fedloom.runtime.clients import EVAL_SALT, client_context
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate


def run(exp: Experiment, tmp_path: Path) -> tuple[RunDir, dict]:
    rundir = RunDir.create(tmp_path / "runs", exp.cfg.name)
    return rundir, simulate(exp, rundir)


def spy_on(exp: Experiment) -> dict[str, list[set[str]]]:
    """Replace ``exp.algorithm`` by a subclass that records the names of every payload,
    every ClientResult.params and every set of results the server aggregates."""
    seen: dict[str, list[set[str]]] = {"payload": [], "sent": [], "aggregated": []}
    base = type(exp.algorithm)

    class Spy(base):  # type: ignore[misc, valid-type]
        log: ClassVar[dict[str, list[set[str]]]] = seen

        def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
            self.log["payload"].append(set(payload))
            result = super().local_train(ctx, payload)
            self.log["sent"].append(set(result.params))
            return result

        def aggregate(self, state: ServerState, results: list[ClientResult]) -> ServerState:
            self.log["aggregated"].extend(set(r.params) for r in results)
            return super().aggregate(state, results)

    alg = exp.algorithm
    exp.algorithm = Spy(**{f.name: getattr(alg, f.name) for f in dataclasses.fields(alg)})
    return seen


def crossing(seen: dict[str, list[set[str]]]) -> set[str]:
    return set().union(*seen["payload"], *seen["sent"], *seen["aggregated"])


# --- configuration ------------------------------------------------------------------------


def test_personal_patterns_come_from_the_config_as_a_list(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text('[algorithm]\nname = "fedper"\npersonal = ["lora_B", "head"]\n')
    cfg = load_config(path)
    alg = algorithms.create(cfg.algorithm.name, **cfg.algorithm.hyperparameters)
    assert alg.personal == ("lora_B", "head")  # a tuple: the algorithm stays hashable
    hash(alg)
    assert algorithms.create("fedsa_lora").personal == ("lora_B", "head")
    assert algorithms.create("lg_fedavg").personal == ("lora_",)
    assert algorithms.create("fedper").personal == algorithms.create("fedrep").personal == ("head",)


@pytest.mark.parametrize(
    ("hp", "message"),
    [
        ({"personal": ["lora_(B"]}, "algorithm.personal: 'lora_(B' is not a regular expression"),
        ({"personal": []}, "algorithm.personal: name at least one pattern"),
        ({"personal": "head"}, "algorithm.personal: expected a list"),
        ({"head_epochs": 0.0}, "algorithm.head_epochs: must be > 0"),
    ],
)
def test_bad_personal_settings_name_the_key(hp: dict[str, Any], message: str) -> None:
    with pytest.raises(algorithms.AlgorithmError, match=message.replace("(", r"\(")):
        algorithms.create("fedrep", **hp)


def test_patterns_that_select_nothing_or_everything_are_rejected() -> None:
    params = {"x.lora_A.weight": torch.zeros(1), "classifier.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="algorithm.personal: .* selects no tensor"):
        PartialFedAvg(personal=("lora_C",)).check_model(params)
    with pytest.raises(ValueError, match="algorithm.personal: .* selects every tensor"):
        PartialFedAvg(personal=("lora_", "head")).check_model(params)
    PartialFedAvg(personal=("lora_B", "head")).check_model(params)  # A shared: a split


# --- what crosses the boundary ------------------------------------------------------------


@needs_glue
@pytest.mark.parametrize(
    ("name", "crosses", "stays"),
    [
        ("fedper", r"lora_", r"^(?!.*lora_)"),  # the head never leaves the client
        ("lg_fedavg", r"^(?!.*lora_)", r"lora_"),  # the LoRA factors never leave it
        ("fedsa_lora", r"lora_A", r"lora_B|^(?!.*lora_)"),  # only A reaches the server
        ("fedrep", r"lora_", r"^(?!.*lora_)"),
    ],
)
def test_only_the_shared_tensors_cross(name: str, crosses: str, stays: str, tmp_path: Path) -> None:
    exp = Experiment.build(tiny_config(f"algorithm.name={name}", output_dir=tmp_path / "runs"))
    seen = spy_on(exp)
    rundir, summary = run(exp, tmp_path)
    names = exp.model.param_names
    shared = {n for n in names if re.search(crosses, n)}
    personal = {n for n in names if re.search(stays, n)}
    assert shared and personal and shared.isdisjoint(personal) and shared | personal == set(names)
    assert len(seen["payload"]) == len(seen["sent"]) == 6  # 3 clients x 2 rounds
    assert all(s == shared for s in seen["payload"] + seen["sent"] + seen["aggregated"])
    assert crossing(seen) == shared  # not a single personal name, ever
    # no global model to score; each client scored its own adapter
    assert "global" not in summary and set(summary["personal"]["clients"]) == {"accuracy", "f1"}
    assert not (rundir.checkpoints / "global.safetensors").exists()
    # checkpoints/personal: the final shared part, identical on every client, merged with
    # the client's own personal part (the one in its saved local state)
    adapters, states = {}, {}
    for cid in range(3):
        file = f"client_{cid:03d}.safetensors"
        adapters[cid] = load_params(rundir.checkpoints / "personal" / file)
        states[cid] = load_client_state(rundir.checkpoints / "clients" / file)
        assert set(adapters[cid]) == set(names)
        assert set(states[cid][PERSONAL]) == personal
        for n in personal:
            assert torch.equal(adapters[cid][n], states[cid][PERSONAL][n])
    for n in shared:
        assert all(torch.equal(adapters[0][n], adapters[c][n]) for c in (1, 2))
    # the personal parts trained apart: every client's differs from the others' and from
    # the initial values
    for n in personal:
        if "lora_B" in n or "lora_" not in n:  # LoRA A starts random, B and the head move
            values = [adapters[c][n] for c in range(3)]
            assert not torch.equal(values[0], values[1]) and not torch.equal(values[1], values[2])
            assert not torch.equal(values[0], exp.model.initial_params[n])


# --- FedRep's two phases ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_exp(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    require_glue()
    return Experiment.build(tiny_config(output_dir=tmp_path_factory.mktemp("runs")))


def context(exp: Experiment, client: int, state: dict, round_: int = 0) -> ClientContext:
    c = exp.clients[client]
    return ClientContext(c.client_id, exp.model, c.train, exp.cfg.train, round_,
                         exp.cfg.federation.rounds, state, seed=7)


def test_fedrep_head_phase_moves_only_the_head_then_body_phase_only_the_body(
    tiny_exp: Experiment, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fedloom.algorithms.fedrep as fedrep_mod

    snapshots: list[tuple[Params, Params, dict[str, Any]]] = []
    real = fedrep_mod.train_locally

    def recording(ctx: ClientContext, *args: Any, **kwargs: Any) -> dict[str, float]:
        before = ctx.model.get_params()
        metrics = real(ctx, *args, **kwargs)
        snapshots.append((before, ctx.model.get_params(), kwargs))
        return metrics

    monkeypatch.setattr(fedrep_mod, "train_locally", recording)
    alg = algorithms.create("fedrep", head_epochs=2.0)
    state = alg.init(tiny_exp.model.get_params())
    ctx = context(tiny_exp, 0, {})
    result = alg.local_train(ctx, alg.payload(state, 0))
    names = tiny_exp.model.param_names
    head = {n for n in names if "lora_" not in n}
    body = set(names) - head
    (h0, h1, head_kw), (b0, b1, body_kw) = snapshots
    assert set(head_kw["only"]) == head and head_kw["state_key"] == "optimizer_head"
    assert set(body_kw["only"]) == body and body_kw["state_key"] == "optimizer_body"
    # head phase: 2 epochs of ceil(n / batch) steps; the body bit-for-bit unchanged
    steps = math.ceil(2.0 * len(ctx.train) / tiny_exp.cfg.train.batch_size)
    assert head_kw["steps"] == steps == result.metrics["head_local_steps"]
    assert all(torch.equal(h0[n], h1[n]) for n in body)
    assert all(not torch.equal(h0[n], h1[n]) for n in head)
    # body phase starts where the head phase ended; the head bit-for-bit unchanged
    assert all(torch.equal(h1[n], b0[n]) for n in names)
    assert all(torch.equal(b0[n], b1[n]) for n in head)
    assert any(not torch.equal(b0[n], b1[n]) for n in body if "lora_B" in n)
    assert result.metrics["local_steps"] == tiny_exp.cfg.train.local_steps
    # what is sent is the trained body; the trained head is kept
    assert set(result.params) == body and all(torch.equal(result.params[n], b1[n]) for n in body)
    assert all(torch.equal(ctx.state[PERSONAL][n], b1[n]) for n in head)
    assert {"optimizer_head", "optimizer_body"} <= set(ctx.state)


# --- FedAvg-FT ----------------------------------------------------------------------------


def test_hold_out_is_seeded_disjoint_ordered_and_never_empty() -> None:
    features = [{"input_ids": [i]} for i in range(10)]
    train, held = hold_out(features, 0.2, (3, HOLDOUT_SALT))
    assert len(train) == 8 and len(held) == 2
    assert [f["input_ids"][0] for f in train] == sorted(f["input_ids"][0] for f in train)
    assert sorted(f["input_ids"][0] for f in train + held) == list(range(10))
    assert hold_out(features, 0.2, (3, HOLDOUT_SALT)) == (train, held)
    assert hold_out(features, 0.2, (4, HOLDOUT_SALT)) != (train, held)
    assert hold_out(features, 0.2, (3, VALIDATION_SALT)) != (train, held)  # its own draw
    assert len(hold_out(features[:2], 0.01, (0,))[1]) == 1  # at least one held out
    assert len(hold_out(features[:2], 0.99, (0,))[0]) == 1  # at least one trained on
    assert hold_out(features[:1], 0.2, (0,)) == (features[:1], [])
    assert hold_out(features, 0.0, (0,)) == (features, [])


def test_fine_tuning_leaves_the_client_state_alone(tiny_exp: Experiment) -> None:
    alg = FedAvgFT(ft_epochs=2.0)
    state = alg.init(tiny_exp.model.get_params())
    ctx = context(tiny_exp, 1, {})
    alg.local_train(ctx, alg.payload(state, 1))  # FedAvg training fills ctx.state["optimizer"]
    before = copy.deepcopy(ctx.state)
    adapter = alg.client_adapter(ctx, state.global_params)
    assert set(ctx.state) == {"optimizer"} and identical(ctx.state, before)
    assert any(not torch.equal(adapter[n], state.global_params[n]) for n in adapter)


def test_fine_tuning_keeps_the_best_holdout_adapter_and_stops_after_patience(
    tiny_exp: Experiment, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fedloom.algorithms.fedavg_ft as scoring

    measured: list[tuple[Params, float]] = []
    real = scoring.evaluate

    def recording(model: Any, params: Params, features: Any, batch_size: int) -> dict:
        scores = real(model, params, features, batch_size)
        measured.append((params, scores["loss"]))
        return scores

    monkeypatch.setattr(scoring, "evaluate", recording)
    payload = tiny_exp.model.get_params()
    ctx = context(tiny_exp, 0, {})
    # a learning rate that overshoots: the holdout loss rises after the first step
    ctx.settings = tiny_exp.cfg.train.model_copy(update={"lr": 0.5, "clip_norm": 0.0})
    alg = FedAvgFT(ft_epochs=8.0, ft_eval_every=1, ft_patience=2)
    kept = alg.client_adapter(ctx, payload)
    losses = [loss for _, loss in measured]
    best = int(np.argmin(losses))
    assert all(torch.equal(kept[n], measured[best][0][n]) for n in kept)
    # stopped after two measurements without improvement (or at the end of the budget)
    steps = math.ceil(8.0 * len(hold_out(ctx.train, 0.2, (7, HOLDOUT_SALT))[0]) / 8)
    assert len(losses) == min(best + 1 + 2, steps) and len(losses) < steps
    assert all(loss >= losses[best] for loss in losses[best + 1 :])
    # the global adapter is never a candidate (it trained on the holdout)
    assert any(not torch.equal(kept[n], payload[n]) for n in payload)
    # no holdout: the whole budget, the last adapter
    measured.clear()
    full = FedAvgFT(ft_epochs=2.0, ft_holdout=0.0).client_adapter(ctx, payload)
    assert not measured and any(not torch.equal(full[n], payload[n]) for n in payload)


@needs_glue
def test_fedavg_ft_personal_adapters_beat_the_global_one_on_skewed_clients(tmp_path: Path) -> None:
    cfg = tiny_config(
        "algorithm.name=fedavg_ft", "partition.scheme=shards",
        "partition.shards_per_client=1", "partition.num_clients=2",
        "data.max_train_examples=80", output_dir=tmp_path / "runs",
    )
    exp = Experiment.build(cfg)
    rundir, summary = run(exp, tmp_path)
    rows = [json.loads(line) for line in rundir.metrics_path.read_text().splitlines()]
    last = {r["scope"]: r for r in rows if r["round"] == 2}
    per_global = last["global/clients"]["per_client"]
    per_personal = last["personal/clients"]["per_client"]
    # measured: client 0 0.675 -> 0.435, client 1 0.672 -> 0.003 (one label)
    for c in per_global:
        assert per_personal[c]["loss"] < 0.8 * per_global[c]["loss"]
    accuracy = {s: summary[s]["clients"]["accuracy"]["mean"] for s in ("global", "personal")}
    assert accuracy["personal"] >= accuracy["global"]
    # both are saved: the global adapter and each client's fine-tuned one, which the
    # client rebuilds bit for bit from the global one and its own data
    glob = load_params(rundir.checkpoints / "global.safetensors")
    for client in exp.clients:
        file = f"client_{client.client_id:03d}.safetensors"
        mine = load_params(rundir.checkpoints / "personal" / file)
        assert set(mine) == set(glob) and any(not torch.equal(mine[n], glob[n]) for n in glob)
        ctx = client_context(exp, client, 2, {}, salt=EVAL_SALT)
        again = exp.algorithm.client_adapter(ctx, glob)
        assert all(torch.equal(again[n], mine[n]) for n in mine)

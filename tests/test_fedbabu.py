"""FedBABU on tiny-bert and a small real MRPC subset: the head frozen at its
initialization and identical on every client, the body FedAvg's (one round equals FedAvg
with the head's learning rate at 0, the official code's implementation), the scoring
fine-tuning (only the head, never the client's state, its passes counted)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from conftest import identical, needs_glue, require_glue, tiny_config

from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.fedbabu import FedBABU
from fedloom.experiment import Experiment
from fedloom.params import Params
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate
from fedloom.train.passes import counting

BATCH = 8


@pytest.fixture(scope="module")
def tiny_exp(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    require_glue()
    return Experiment.build(tiny_config(output_dir=tmp_path_factory.mktemp("runs")))


def context(exp: Experiment, client: int, state: dict, **settings: float) -> ClientContext:
    c = exp.clients[client]
    train = exp.cfg.train.model_copy(update=settings)
    return ClientContext(c.client_id, exp.model, c.train, train, 0, 2, state, seed=11 + client)


def split(params: Params) -> tuple[Params, Params]:
    """(body, head): the LoRA factors and every other tensor."""
    body = {n: t for n, t in params.items() if "lora_" in n}
    return body, {n: t for n, t in params.items() if n not in body}


# --- hyperparameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hp", "message"),
    [
        ({"ft_epochs": 0.0}, "algorithm.ft_epochs: must be > 0"),
        ({"finetune": "body"}, "algorithm.finetune: expected one of 'head', 'all'"),
    ],
)
def test_bad_hyperparameters_name_the_key(hp: dict, message: str) -> None:
    with pytest.raises(algorithms.AlgorithmError, match=message):
        algorithms.create("fedbabu", **hp)


def test_an_adapter_without_a_head_is_refused() -> None:
    with pytest.raises(ValueError, match="model.head: fedbabu freezes the classifier head"):
        FedBABU().check_model(
            {"q.lora_A.weight": torch.zeros(2), "q.lora_B.weight": torch.zeros(2)}
        )
    FedBABU().check_model({"q.lora_A.weight": torch.zeros(2), "classifier.bias": torch.zeros(2)})


# --- training -----------------------------------------------------------------------------


@needs_glue
def test_one_round_is_fedavg_with_the_head_at_learning_rate_zero(tiny_exp: Experiment) -> None:
    """The official code trains the body with the head in the optimizer at lr 0; here the
    head is left out of it. With gradient clipping off (the head's gradient would count in
    the clipped norm) the bodies agree bit for bit (the same kernels on the same batches),
    and the head stays h⁰."""
    initial = tiny_exp.model.initial_params
    alg = FedBABU()
    state = alg.init(initial)
    babu = [
        alg.local_train(context(tiny_exp, c, {}, clip_norm=0.0), alg.payload(state, c))
        for c in range(3)
    ]
    after = alg.aggregate(state, babu)

    fedavg = FedAvg()
    reference = []
    for c in range(3):
        ctx = context(tiny_exp, c, {}, clip_norm=0.0, head_lr=0.0)
        reference.append(fedavg.local_train(ctx, initial))
    _, ref_head = split(reference[0].params)
    assert all(torch.equal(r.params[n], initial[n]) for r in reference for n in ref_head)
    expected = fedavg.aggregate(fedavg.init(initial), reference).global_params

    body, head = split(after.global_params)
    assert set(after.global_params) == set(initial) and head.keys() == ref_head.keys()
    assert all(torch.equal(head[n], initial[n]) for n in head)  # h⁰, bit for bit
    for n in body:
        assert torch.equal(body[n], expected[n]), n
    assert any(not torch.equal(body[n], initial[n]) for n in body if "lora_B" in n)
    # what crossed: the body down and up, never the head
    assert all(set(alg.payload(state, c)) == set(body) for c in range(3))
    assert all(set(r.params) == set(body) for r in babu)


@needs_glue
def test_the_head_never_changes_and_is_the_same_on_every_client(tmp_path: Path) -> None:
    """A 2-round run: every client trains from h⁰ and ends with h⁰; the server's global
    adapter keeps h⁰; the global adapter and each client's fine-tuned one are scored, the
    fine-tuning's passes counted as ``adapt_passes``."""
    exp = Experiment.build(tiny_config("algorithm.name=fedbabu", output_dir=tmp_path))
    heads: list[tuple[Params, Params]] = []

    class Spy(FedBABU):
        log: ClassVar[list[tuple[Params, Params]]] = heads

        def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
            result = super().local_train(ctx, payload)
            trained = ctx.model.get_params()
            self.log.append((split(trained)[1], result.params))
            return result

    alg = exp.algorithm
    exp.algorithm = Spy(**{f.name: getattr(alg, f.name) for f in dataclasses.fields(alg)})
    rundir = RunDir.create(tmp_path / "runs", exp.cfg.name)
    summary = simulate(exp, rundir)

    initial = exp.model.initial_params
    body, head = split(initial)
    assert len(heads) == 6  # 3 clients x 2 rounds
    for trained_head, sent in heads:
        assert set(sent) == set(body)
        assert all(torch.equal(trained_head[n], initial[n]) for n in head)
    glob = load_params(rundir.checkpoints / "global.safetensors")
    assert all(torch.equal(glob[n], initial[n]) for n in head)
    assert any(not torch.equal(glob[n], initial[n]) for n in body if "lora_B" in n)
    # scored: the global adapter (φ, h⁰) and every client's fine-tuned head on that body
    assert {"global", "personal"} <= set(summary)
    for client in exp.clients:
        mine = load_params(
            rundir.checkpoints / "personal" / f"client_{client.client_id:03d}.safetensors"
        )
        assert all(torch.equal(mine[n], glob[n]) for n in body)
        assert all(not torch.equal(mine[n], glob[n]) for n in head)
    rows = [json.loads(line) for line in rundir.metrics_path.read_text().splitlines()]
    scored = [r for r in rows if r.get("scope") == "personal/clients"]
    expected = {str(c.client_id): math.ceil(5.0 * len(c.train) / BATCH) for c in exp.clients}
    assert len(scored) == 2
    assert all(
        {c: s["adapt_passes"] for c, s in r["per_client"].items()} == expected for r in scored
    )
    assert summary["compute"]["train_passes_per_client_round"] == exp.cfg.train.local_steps


# --- the scoring fine-tuning --------------------------------------------------------------


@needs_glue
def test_head_fine_tuning_moves_only_the_head_and_never_the_state(tiny_exp: Experiment) -> None:
    alg = FedBABU(ft_epochs=1.5)
    state = alg.init(tiny_exp.model.initial_params)
    ctx = context(tiny_exp, 1, {})
    alg.local_train(ctx, alg.payload(state, 1))  # fills ctx.state["optimizer"]
    before = copy.deepcopy(ctx.state)
    payload = alg.payload(state, 1)
    with counting() as counted:
        adapter = alg.client_adapter(ctx, payload)
    assert counted.passes == math.ceil(1.5 * len(ctx.train) / BATCH)
    assert set(ctx.state) == {"optimizer"} and identical(ctx.state, before)
    body, head = split(adapter)
    assert set(body) == set(payload) and all(torch.equal(body[n], payload[n]) for n in body)
    initial = tiny_exp.model.initial_params
    assert all(not torch.equal(head[n], initial[n]) for n in head)
    # the whole model with finetune = "all": the body moves too
    everything = FedBABU(ft_epochs=1.5, finetune="all").client_adapter(ctx, payload)
    assert any(not torch.equal(everything[n], payload[n]) for n in payload if "lora_B" in n)
    assert all(not torch.equal(everything[n], initial[n]) for n in head)
    assert identical(ctx.state, before)

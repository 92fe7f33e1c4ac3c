"""FedDBE on tiny-bert and a small real MRPC subset: the representation bias's hook, the
local objective (cross-entropy on z + z̄ᵖ plus the mean regularization) and the PRBM's
update against a NumPy transcription, the initialization round as FedAvg's local training
bit for bit, the global mean on the server, what crosses the client/server boundary, the
passes counted, the refused hyperparameters and a resumed run's exactness."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from conftest import identical, needs_glue, require_glue, tiny_config

from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult
from fedloom.algorithms.feddbe import (
    GLOBAL_MEAN,
    LOCAL_MEAN,
    MEAN_KEY,
    PRBM,
    FedDBE,
    mean_regularizer,
    representation_bias,
    running_mean,
)
from fedloom.evaluation.score import evaluate
from fedloom.experiment import Experiment
from fedloom.params import Params
from fedloom.runtime.client_state import load_client_state
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate
from fedloom.train.passes import counting

HIDDEN = 32  # tiny-bert's representation size


@pytest.fixture(scope="module")
def tiny_exp(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    require_glue()
    return Experiment.build(tiny_config(output_dir=tmp_path_factory.mktemp("runs")))


def context(exp: Experiment, state: dict, round_: int = 0, **train: Any) -> ClientContext:
    client = exp.clients[0]
    settings = exp.cfg.train.model_copy(update=train)
    return ClientContext(
        client.client_id,
        exp.model,
        client.train,
        settings,
        round_,
        exp.cfg.federation.rounds,
        state,
        seed=7,
    )


def vector(seed: int, scale: float = 0.1) -> torch.Tensor:
    return scale * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))


# --- the pieces -------------------------------------------------------------------------------


def test_running_mean_and_mean_regularizer_match_numpy() -> None:
    prev, batch, target = vector(1), torch.randn(5, HIDDEN), vector(2)
    prev.requires_grad_(True)
    m = running_mean(prev, batch, 0.3)
    assert np.allclose(
        m.detach().numpy(), 0.7 * prev.detach().numpy() + 0.3 * batch.numpy().mean(0), atol=1e-7
    )
    assert not m.requires_grad  # sg(previous): the old batches get no gradient
    mr = mean_regularizer(m, target)
    assert np.isclose(mr.item(), np.mean(0.5 * (m.numpy() - target.numpy()) ** 2))


def test_the_bias_is_added_to_the_classifiers_input_while_the_block_lasts(
    tiny_exp: Experiment,
) -> None:
    model, features = tiny_exp.model, tiny_exp.clients[0].train
    params = model.initial_params
    model.set_params(params)
    h = model.embed(features, 32).astype(np.float64)
    w = params["classifier.weight"].double().numpy()
    c = params["classifier.bias"].double().numpy()
    bias = vector(3, scale=1.0)
    pooled: list[torch.Tensor] = []
    with representation_bias(model, bias, pooled):
        log_p = model.log_probs(features, 32)
    z = (h + bias.double().numpy()) @ w.T + c
    assert np.allclose(log_p, z - np.log(np.exp(z).sum(1, keepdims=True)), atol=1e-5)
    assert np.allclose(np.concatenate([p.numpy() for p in pooled]).mean(0), h.mean(0), atol=1e-5)
    # removed on leaving: the plain classifier again
    z0 = h @ w.T + c
    assert np.allclose(
        model.log_probs(features, 32), z0 - np.log(np.exp(z0).sum(1, keepdims=True)), atol=1e-5
    )


# --- the defining update ------------------------------------------------------------------------


def test_one_step_matches_numpy(tiny_exp: Experiment, monkeypatch: pytest.MonkeyPatch) -> None:
    """One SGD step of two micro-batches (μ = 0.5, κ = 3, no head dropout): the reported
    loss is Σ_j ½ [CE(W(h_j + b) + c) + κ · mean ½ (z̄_j − z̄)²] with z̄_1 = μ m_1,
    z̄_2 = (1 − μ) z̄_1 + μ m_2, and b and W move by −lr times the cross-entropy's gradient
    (the MR term does not depend on them)."""
    model = tiny_exp.model
    monkeypatch.setattr(model.head.dropout, "p", 0.0)
    labels: list[np.ndarray] = []
    real = model.head.collate

    def recording(features):
        batch = real(features)
        labels.append(batch["labels"].numpy())
        return batch

    monkeypatch.setattr(model.head, "collate", recording)
    pooled: list[torch.Tensor] = []
    spy = model.head.dropout.register_forward_hook(
        lambda module, inputs, output: pooled.append(inputs[0].detach().clone())
    )
    lr, mu, kappa = 0.5, 0.5, 3.0
    b0, target = vector(4), vector(5)
    params = model.initial_params
    state: dict[str, Any] = {PRBM: b0.clone()}
    ctx = context(
        tiny_exp,
        state,
        local_steps=1,
        batch_size=8,
        grad_accum=2,
        optimizer="sgd",
        momentum=0.0,
        weight_decay=0.0,
        clip_norm=0.0,
        schedule="constant",
        warmup_ratio=0.0,
        lr=lr,
    )
    try:
        with counting() as counted:
            result = FedDBE(momentum=mu, mr_weight=kappa).local_train(
                ctx, {**params, GLOBAL_MEAN: target}
            )
    finally:
        spy.remove()
    assert counted.passes == 2 and len(pooled) == len(labels) == 2

    w = params["classifier.weight"].double().numpy()
    c = params["classifier.bias"].double().numpy()
    b, g = b0.double().numpy(), target.double().numpy()
    mean, loss, grad_b, grad_w = np.zeros(HIDDEN), 0.0, 0.0, 0.0
    for h, y in zip(pooled, labels):
        h = h.double().numpy()
        z = (h + b) @ w.T + c
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ce = -np.log(p[np.arange(len(y)), y]).mean()
        mean = (1 - mu) * mean + mu * h.mean(0)
        loss += 0.5 * (ce + kappa * np.mean(0.5 * (mean - g) ** 2))
        d = (p - np.eye(2)[y]) / len(y)
        grad_b = grad_b + 0.5 * d.sum(0) @ w
        grad_w = grad_w + 0.5 * d.T @ (h + b)
    assert np.isclose(result.metrics["train_loss"], loss, atol=1e-5)
    assert np.allclose(state[PRBM].numpy(), b - lr * grad_b, atol=1e-6)
    assert np.allclose(result.params["classifier.weight"].numpy(), w - lr * grad_w, atol=1e-6)
    assert set(result.params) == set(params)  # the PRBM stays home


def test_the_mean_regularization_reaches_the_body(tiny_exp: Experiment) -> None:
    params = {**tiny_exp.model.initial_params, GLOBAL_MEAN: vector(6, scale=5.0)}
    trained = [
        FedDBE(mr_weight=kappa).local_train(context(tiny_exp, {}), params).params
        for kappa in (0.0, 50.0)
    ]
    lora = [n for n in trained[0] if "lora_" in n]
    assert any(not torch.equal(trained[0][n], trained[1][n]) for n in lora)
    for n in ("classifier.weight", "classifier.bias"):  # the same gradient, the step's own
        assert not torch.equal(trained[0][n], params[n])


def test_the_initialization_round_is_fedavgs_local_training_bit_for_bit(
    tiny_exp: Experiment,
) -> None:
    payload = tiny_exp.model.initial_params
    settings = {"grad_accum": 2, "local_steps": 3}
    fedavg_state: dict[str, Any] = {}
    fedavg = algorithms.create("fedavg").local_train(
        context(tiny_exp, fedavg_state, **settings), payload
    )
    pooled: list[torch.Tensor] = []
    state: dict[str, Any] = {}
    spy = tiny_exp.model.head.dropout.register_forward_hook(
        lambda module, inputs, output: pooled.append(inputs[0].detach().clone())
    )
    try:
        with counting() as counted:
            dbe = FedDBE().local_train(context(tiny_exp, state, **settings), payload)
    finally:
        spy.remove()
    assert counted.passes == 6
    assert identical({n: dbe.params[n] for n in payload}, fedavg.params)
    assert dbe.metrics == fedavg.metrics
    # z̄_k uploaded (μ = 1: the last micro-batch's mean); no PRBM kept before z̄ is known
    assert set(dbe.params) == set(payload) | {LOCAL_MEAN}
    assert torch.allclose(dbe.params[LOCAL_MEAN], pooled[-1].mean(0), atol=1e-7)
    assert PRBM not in state and set(state) == {"optimizer"}


# --- the server ---------------------------------------------------------------------------------


def test_the_server_fixes_the_example_weighted_global_mean_once() -> None:
    alg = FedDBE()
    start = {"x.lora_A.weight": torch.zeros(2), "classifier.weight": torch.zeros(2)}
    state = alg.init(start)
    assert alg.payload(state, 0) == start  # no z̄ before the initialization round

    def result(cid: int, value: float, n: int, mean: torch.Tensor | None) -> ClientResult:
        params = {k: torch.full((2,), value) for k in start}
        return ClientResult(cid, params if mean is None else {**params, LOCAL_MEAN: mean}, n)

    with pytest.raises(ValueError, match="no client's mean representation"):
        alg.aggregate(state, [result(0, 1.0, 1, None)])  # lost on the way: refused, not ignored
    means = [torch.tensor([1.0, 0.0, 3.0]), torch.tensor([4.0, 2.0, 0.0])]
    state = alg.aggregate(state, [result(0, 1.0, 1, means[0]), result(1, 3.0, 3, means[1])])
    assert torch.allclose(state.extra[MEAN_KEY], (1 * means[0] + 3 * means[1]) / 4)
    assert set(state.global_params) == set(start)  # FedAvg over the adapter alone
    assert torch.allclose(state.global_params["classifier.weight"], torch.full((2,), 2.5))
    payload = alg.payload(state, 1)
    assert set(payload) == set(start) | {GLOBAL_MEAN}
    fixed = state.extra[MEAN_KEY]
    state = alg.aggregate(state, [result(0, 0.0, 1, None)])
    assert state.extra[MEAN_KEY] is fixed and state.round == 2


# --- scoring ------------------------------------------------------------------------------------


def test_scoring_adds_the_clients_bias_and_leaves_its_state_alone(tiny_exp: Experiment) -> None:
    model, features = tiny_exp.model, tiny_exp.clients[0].train
    params = model.initial_params
    payload = {**params, GLOBAL_MEAN: vector(7)}
    splits = {"test": features}
    plain = evaluate(model, params, features, 32)
    adapter, none = FedDBE().evaluate_local(context(tiny_exp, {}), payload, splits, 32)
    assert set(adapter) == set(params) and none["test"] == plain
    state = {PRBM: vector(8, scale=3.0)}
    before = copy.deepcopy(state)
    folded, mine = FedDBE().evaluate_local(context(tiny_exp, state), payload, splits, 32)
    assert identical(state, before)
    assert mine["test"]["loss"] != plain["loss"]
    # the bias folded into the classifier is the model with z̄ᵖ_k added to its representation
    assert set(folded) == set(params)
    assert [n for n in params if not torch.equal(folded[n], params[n])] == ["classifier.bias"]
    with representation_bias(model, state[PRBM]):
        hooked = evaluate(model, params, features, 32)
    assert hooked["accuracy"] == mine["test"]["accuracy"]
    assert np.isclose(hooked["loss"], mine["test"]["loss"], atol=1e-5)


# --- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hp", "key"),
    [
        ({"momentum": 0.0}, "momentum"),
        ({"momentum": 1.5}, "momentum"),
        ({"mr_weight": -1.0}, "mr_weight"),
        ({"mr_weight": "big"}, "mr_weight"),
    ],
)
def test_bad_hyperparameters_name_the_key(hp: dict[str, Any], key: str) -> None:
    with pytest.raises(algorithms.AlgorithmError, match=f"^algorithm.{key}: "):
        algorithms.create("feddbe", **hp)


def test_defaults_and_the_head_it_needs() -> None:
    alg = algorithms.create("feddbe")
    assert (alg.momentum, alg.mr_weight) == (1.0, 50.0) and alg.personalized and alg.has_global
    alg.check_model({"a.lora_A.weight": torch.zeros(1), "classifier.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="^model.head: feddbe .* no classifier"):
        alg.check_model({"a.lora_A.weight": torch.zeros(1)})


# --- runs ---------------------------------------------------------------------------------------


def spy_on(exp: Experiment) -> dict[str, list[set[str]]]:
    """Record the names of every payload and every ClientResult.params."""
    seen: dict[str, list[set[str]]] = {"payload": [], "sent": []}
    base = type(exp.algorithm)

    class Spy(base):  # type: ignore[misc, valid-type]
        log: ClassVar[dict[str, list[set[str]]]] = seen

        def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
            self.log["payload"].append(set(payload))
            result = super().local_train(ctx, payload)
            self.log["sent"].append(set(result.params))
            return result

    alg = exp.algorithm
    exp.algorithm = Spy(**{f.name: getattr(alg, f.name) for f in dataclasses.fields(alg)})
    return seen


class Stop(Exception):
    """Stands for a crash."""


def _stop_in_round(round_: int):
    def hook(kind: str, done: int, total: int) -> None:
        if kind == "client" and done == 1 and hook.rounds == round_ - 1:
            raise Stop
        if kind == "round":
            hook.rounds = done

    hook.rounds = 0
    return hook


def _outputs(run: Path) -> tuple[list[str], dict]:
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("wall_seconds")
    return (run / "metrics.jsonl").read_text().splitlines(), summary


@needs_glue
def test_what_crosses_and_a_resumed_run(tmp_path: Path) -> None:
    cfg = tiny_config("algorithm.name=feddbe", "federation.rounds=3", output_dir=tmp_path)
    exp = Experiment.build(cfg)
    seen = spy_on(exp)
    whole = RunDir.create(tmp_path / "whole", cfg.name)
    summary = simulate(exp, whole)
    names = set(exp.model.param_names)
    # round 1: the adapter down, the adapter and z̄_k up; then z̄ down, the adapter up
    assert seen["payload"] == [names] * 3 + [names | {GLOBAL_MEAN}] * 6
    assert seen["sent"] == [names | {LOCAL_MEAN}] * 3 + [names] * 6
    assert {"global", "personal"} <= set(summary)
    rows = [json.loads(line) for line in whole.metrics_path.read_text().splitlines()]
    passes = [r["train_passes"] for r in rows if r.get("scope") == "train"]
    assert passes == [{str(c): 2.0 for c in range(3)}] * 3  # FedAvg's compute
    for cid in range(3):
        state = load_client_state(whole.checkpoints / "clients" / f"client_{cid:03d}.safetensors")
        assert state[PRBM].shape == (HIDDEN,) and state[PRBM].abs().sum() > 0
    # stopped in round 3 after its first client trained, resumed: the same outputs
    broken = RunDir.create(tmp_path / "broken", cfg.name)
    with pytest.raises(Stop):
        simulate(Experiment.build(cfg), broken, _stop_in_round(3))
    simulate(Experiment.build(cfg), RunDir(broken.path), resume=True)
    assert _outputs(broken.path) == _outputs(whole.path)

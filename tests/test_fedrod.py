"""FedRoD on tiny-bert and a small real MRPC subset: the generic step minimizes the
balanced softmax of the client's own counts, the personal head is the NumPy transcription
of its update on the summed logits, it never leaves the client and is saved with the
client's state (a resumed run equals an uninterrupted one), a zero personal head scores
exactly as the generic model, and what the method cannot run with is refused."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from conftest import identical, needs_glue, require_glue, run_tiny_cli, tiny_config
from scipy.special import log_softmax, logsumexp, softmax

import fedloom.train.local as local_module
from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult
from fedloom.algorithms.fedrod import OPTIMIZER_PERSONAL, PERSONAL_HEAD, FedRoD
from fedloom.config import ConfigError
from fedloom.evaluation.score import evaluate, scores
from fedloom.evaluation.splits import scored_splits
from fedloom.experiment import Experiment, build_algorithm
from fedloom.models.heads import Feature
from fedloom.params import Params
from fedloom.runtime.client_state import load_client_state
from fedloom.runtime.clients import ClientHost
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate

STEPS = 2  # the tiny config's train.local_steps
WEIGHT, BIAS = "classifier.weight", "classifier.bias"


@pytest.fixture(scope="module")
def tiny_exp(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    require_glue()
    return Experiment.build(tiny_config(output_dir=tmp_path_factory.mktemp("runs")))


def sgd_context(exp: Experiment, train: list[Feature], steps: int, batch: int) -> ClientContext:
    """A context whose round is ``steps`` plain SGD steps (lr 0.1) of ``batch`` examples."""
    settings = exp.cfg.train.model_copy(
        update={
            "optimizer": "sgd",
            "momentum": 0.0,
            "weight_decay": 0.0,
            "clip_norm": 0.0,
            "schedule": "constant",
            "warmup_ratio": 0.0,
            "local_steps": steps,
            "batch_size": batch,
            "lr": 0.1,
        }
    )
    return ClientContext(0, exp.model, train, settings, 0, 1, {}, seed=5)


def with_labels(exp: Experiment, labels: list[int]) -> list[Feature]:
    pool = [f for c in exp.clients for f in c.train]
    out, used = [], set()
    for y in labels:
        i = next(i for i, f in enumerate(pool) if f["label"] == y and i not in used)
        used.add(i)
        out.append(pool[i])
    return out


# --- the generic step: the balanced softmax ---------------------------------------------------


@pytest.mark.parametrize(
    "labels", [[1, 0, 1, 1], [1, 1, 1, 1]], ids=["both-classes", "a-class-never-seen"]
)
def test_the_generic_step_minimizes_the_balanced_softmax(
    tiny_exp: Experiment, monkeypatch: pytest.MonkeyPatch, labels: list[int]
) -> None:
    model = tiny_exp.model
    seen: dict[str, list] = {"logits": [], "labels": [], "loss": []}
    hook = model.head.classifier.register_forward_hook(
        lambda module, inputs, output: seen["logits"].append(output.detach().double().clone())
    )
    real = model.loss

    def loss(batch: dict[str, Any]) -> torch.Tensor:
        value = real(batch)
        seen["labels"].append(batch["labels"].clone())
        seen["loss"].append(float(value.detach()))
        return value

    monkeypatch.setattr(model, "loss", loss)
    ctx = sgd_context(tiny_exp, with_labels(tiny_exp, labels), steps=1, batch=4)
    payload = model.initial_params
    try:
        result = FedRoD().local_train(ctx, payload)
    finally:
        hook.remove()
    z, y, value = seen["logits"][0].numpy(), seen["labels"][0].numpy(), seen["loss"][0]
    # by hand: z_y + log n_y (log 0 = −∞: a class never seen leaves the softmax)
    counts = np.bincount(np.array(labels), minlength=2).astype(float)
    with np.errstate(divide="ignore"):
        balanced = z + np.log(counts)
    rows = np.arange(len(y))
    expected = np.mean(logsumexp(balanced, axis=1) - balanced[rows, y])
    plain = np.mean(logsumexp(z, axis=1) - z[rows, y])
    assert value == pytest.approx(expected, abs=1e-5)
    assert abs(expected - plain) > 0.05  # the offset is in effect
    # that loss is the one the step descended: the classifier bias moved by −lr · its gradient
    grad = (softmax(balanced, axis=1) - np.eye(2)[y]).mean(0)
    moved = (result.params[BIAS] - payload[BIAS]).double().numpy()
    np.testing.assert_allclose(moved, -0.1 * grad, atol=1e-6)
    assert all(torch.isfinite(t).all() for t in result.params.values())
    assert model.head.logit_offset is None  # scoring reads raw logits


# --- the personal head ------------------------------------------------------------------------


def test_the_personal_head_is_fit_to_the_summed_logits_on_the_bodys_batches(
    tiny_exp: Experiment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NumPy transcription of S SGD steps from zero on CE(g(x) + W z(x) + b), with z the
    round's trained body's pooled features and g its trained generic logits, both fixed,
    over the very batches the body's steps drew."""
    drawn: list[np.ndarray] = []
    real = local_module.client_batches

    def recording(*args: Any) -> Iterator[np.ndarray]:
        for indices in real(*args):
            drawn.append(indices.copy())
            yield indices

    monkeypatch.setattr(local_module, "client_batches", recording)
    model, train = tiny_exp.model, list(tiny_exp.clients[0].train)
    ctx = sgd_context(tiny_exp, train, steps=3, batch=4)
    result = FedRoD(personal_lr=0.05).local_train(ctx, model.initial_params)
    assert len(drawn) == 3
    # the personal training leaves the body and generic head as trained, and they are sent
    assert identical(model.get_params(), result.params)
    features = model.embed(train, 16).astype(np.float64)
    generic = (
        features @ result.params[WEIGHT].double().numpy().T + result.params[BIAS].double().numpy()
    )
    labels = np.array([f["label"] for f in train])
    w, b = np.zeros((2, features.shape[1])), np.zeros(2)
    losses = []
    for rows in drawn:
        logits = generic[rows] + features[rows] @ w.T + b
        losses.append(np.mean(-log_softmax(logits, axis=1)[np.arange(len(rows)), labels[rows]]))
        delta = softmax(logits, axis=1) - np.eye(2)[labels[rows]]
        w -= 0.05 * delta.T @ features[rows] / len(rows)
        b -= 0.05 * delta.mean(0)
    head = ctx.state[PERSONAL_HEAD]
    np.testing.assert_allclose(head["weight"].double().numpy(), w, atol=1e-5)
    np.testing.assert_allclose(head["bias"].double().numpy(), b, atol=1e-6)
    assert np.abs(w).max() > 1e-3  # it moved
    assert result.metrics["personal_loss"] == pytest.approx(np.mean(losses), abs=1e-5)
    # the forward-only cost: each distinct example the steps drew, embedded once
    assert result.metrics["personal_embedded"] == len(np.unique(np.concatenate(drawn)))
    assert OPTIMIZER_PERSONAL in ctx.state  # its own moments (optimizer_state = "persist")


def test_a_zero_personal_head_scores_exactly_as_the_generic_model(tiny_exp: Experiment) -> None:
    """With no personal head yet, or a zero one, the personal scores are the generic
    model's, bit for bit, on the dev-weighted split (example weights) and the own split;
    a non-zero one scores argmax g(x) + W z(x) with the loss of those summed logits."""
    model, client = tiny_exp.model, tiny_exp.clients[0]
    splits = scored_splits(tiny_exp, client)
    assert "weight" in splits["clients"][0]  # the dev-weighted split carries weights
    torch.manual_seed(0)
    payload = {n: t + 0.05 * torch.randn_like(t) for n, t in model.initial_params.items()}
    generic = {name: evaluate(model, payload, f, 32) for name, f in splits.items() if f}
    zero = {"weight": torch.zeros(2, 32), "bias": torch.zeros(2)}
    for state in ({}, {PERSONAL_HEAD: zero}):
        ctx = ClientContext(0, model, client.train, tiny_exp.cfg.train, 1, 2, state, seed=0)
        scored = FedRoD().evaluate_local(ctx, payload, splits, 32)
        assert scored is not None and scored[1] == generic
    head = {"weight": 0.5 * torch.randn(2, 32), "bias": torch.tensor([0.3, -0.3])}
    ctx = ClientContext(
        0, model, client.train, tiny_exp.cfg.train, 1, 2, {PERSONAL_HEAD: head}, seed=0
    )
    kept = {PERSONAL_HEAD: {n: t.clone() for n, t in head.items()}}
    scored = FedRoD().evaluate_local(ctx, payload, splits, 32)
    assert scored is not None and identical(ctx.state, kept)  # scoring leaves the state alone
    adapter, personal = scored
    for name, f in splits.items():
        if not f:
            continue
        model.set_params(payload)
        z = model.embed(f, 32).astype(np.float64)
        logits = (
            z @ payload[WEIGHT].double().numpy().T
            + payload[BIAS].double().numpy()
            + z @ head["weight"].double().numpy().T
            + head["bias"].double().numpy()
        )
        labels = np.array([x["label"] for x in f])
        losses = -log_softmax(logits, axis=1)[np.arange(len(f)), labels]
        by_hand = scores(model, logits.argmax(1), labels, losses, f)
        assert personal[name]["loss"] == pytest.approx(by_hand["loss"], abs=1e-5)
        assert {k: v for k, v in personal[name].items() if k != "loss"} == {
            k: v for k, v in by_hand.items() if k != "loss"
        }
        assert personal[name]["loss"] != pytest.approx(generic[name]["loss"], abs=1e-3)
    # the adapter it scored (and saves): the generic one with the head added in
    assert torch.equal(adapter[WEIGHT], payload[WEIGHT] + head["weight"])
    assert identical(
        {n: t for n, t in adapter.items() if n not in (WEIGHT, BIAS)},
        {n: t for n, t in payload.items() if n not in (WEIGHT, BIAS)},
    )


def test_bad_or_default_hyperparameters() -> None:
    alg = algorithms.create("fedrod")
    assert (alg.gamma, alg.personal_lr) == (1.0, None)
    assert alg.personalized and alg.has_global and alg.adjusts_logits
    for hp, key in (
        ({"gamma": -1.0}, "gamma"),
        ({"personal_lr": 0.0}, "personal_lr"),
        ({"personal_lr": float("nan")}, "personal_lr"),
    ):
        with pytest.raises(
            algorithms.AlgorithmError, match=rf"^algorithm\.{key}: (must be|expected a finite)"
        ):
            algorithms.create("fedrod", **hp)


# --- the federation: what crosses, what is saved, what it costs -------------------------------


@needs_glue
def test_the_personal_head_never_leaves_the_client(tmp_path: Path) -> None:
    exp = Experiment.build(tiny_config("algorithm.name=fedrod", output_dir=tmp_path))
    sent: list[tuple[ClientResult, Params]] = []
    base = type(exp.algorithm)

    class Spy(base):  # type: ignore[misc, valid-type]
        log: ClassVar[list[tuple[ClientResult, Params]]] = sent

        def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
            result = super().local_train(ctx, payload)
            self.log.append((result, ctx.state[PERSONAL_HEAD]))
            return result

    alg = exp.algorithm
    exp.algorithm = Spy(**{f.name: getattr(alg, f.name) for f in dataclasses.fields(alg)})
    run = RunDir.create(tmp_path / "runs", exp.cfg.name)
    summary = simulate(exp, run)
    assert len(sent) == 6  # 3 clients x 2 rounds
    for result, head in sent:
        # the generic adapter, nothing more: its classifier is not the personal one
        assert set(result.params) == set(exp.model.param_names)
        assert head["weight"].abs().max() > 0
        assert not torch.equal(result.params[WEIGHT], result.params[WEIGHT] + head["weight"])
        assert all(isinstance(v, float) for v in result.metrics.values())
    # scored both ways; FedAvg's training passes (the embedding is forward only)
    assert {"global", "personal"} <= set(summary)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert [r["train_passes"] for r in rows if r["scope"] == "train"] == [
        {"0": STEPS, "1": STEPS, "2": STEPS}
    ] * 2
    # saved on the client's side: its state holds the head, its personal checkpoint is the
    # global adapter with the head added into the classifier
    glob = load_params(run.checkpoints / "global.safetensors")
    for cid in range(3):
        file = f"client_{cid:03d}.safetensors"
        head = load_client_state(run.checkpoints / "clients" / file)[PERSONAL_HEAD]
        mine = load_params(run.checkpoints / "personal" / file)
        assert torch.equal(mine[WEIGHT], glob[WEIGHT] + head["weight"])
        assert torch.equal(mine[BIAS], glob[BIAS] + head["bias"])


class Stop(Exception):
    """Stands for a crash at a chosen point."""


@needs_glue
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    """Stopped in round 2 after its first client trained, resumed from round 1's
    checkpoint: the personal heads and their moments come back with the client states."""
    cfg = tiny_config(
        "algorithm.name=fedrod",
        "federation.rounds=3",
        "train.optimizer_state=persist",
        output_dir=tmp_path,
    )
    whole = RunDir.create(tmp_path / "whole", cfg.name)
    simulate(Experiment.build(cfg), whole)

    def stop(kind: str, done: int, total: int) -> None:
        if kind == "round":
            stop.rounds = done  # type: ignore[attr-defined]
        elif kind == "client" and done == 1 and stop.rounds == 1:  # type: ignore[attr-defined]
            raise Stop

    stop.rounds = 0  # type: ignore[attr-defined]
    broken = RunDir.create(tmp_path / "broken", cfg.name)
    with pytest.raises(Stop):
        simulate(Experiment.build(cfg), broken, stop)
    simulate(Experiment.build(cfg), RunDir(broken.path), resume=True)

    def outputs(run: Path) -> tuple[list[str], dict]:
        summary = json.loads((run / "summary.json").read_text())
        summary.pop("wall_seconds")
        return (run / "metrics.jsonl").read_text().splitlines(), summary

    assert outputs(broken.path) == outputs(whole.path)


@needs_glue
def test_several_clients_per_pass_train_one_by_one() -> None:
    exp = Experiment.build(tiny_config("algorithm.name=fedrod", "train.clients_per_pass=2"))
    assert ClientHost(exp, [0, 1, 2]).passes(0, [0, 1, 2]) == [[0], [1], [2]]


# --- refusals ---------------------------------------------------------------------------------


def test_sample_level_dp_refuses_it() -> None:
    cfg = tiny_config(
        "algorithm.name=fedrod", "privacy.level=sample", "privacy.noise_multiplier=1.0"
    )
    with pytest.raises(
        ConfigError, match="privacy.level: DP-SGD does not cover algorithm 'fedrod'"
    ):
        build_algorithm(cfg)


@needs_glue
def test_a_regression_task_is_refused_in_one_line(tmp_path: Path) -> None:
    result = run_tiny_cli(tmp_path, "algorithm.name=fedrod", "data.task=STS-B")
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: algorithm.name: fedrod needs"), lines
    assert "STS-B has a regression output" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()

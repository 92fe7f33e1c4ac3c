"""FedLC on tiny-bert and a small real MRPC subset: the loss a local step minimizes is the
cross-entropy of the logits calibrated by the client's own class counts (a class it has
no example of included), the counts are read on the client and never sent, scoring uses
the raw logits, and what the method cannot run with is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from conftest import identical, needs_glue, require_glue, run_tiny_cli, tiny_config
from scipy.special import logsumexp, softmax

import fedloom.algorithms.fedlc as fedlc_module
from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult
from fedloom.algorithms.fedlc import FedLC
from fedloom.config import ConfigError
from fedloom.experiment import Experiment, build_algorithm
from fedloom.models.heads import Feature
from fedloom.params import Params
from fedloom.runtime.clients import ClientHost
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

STEPS = 2  # the tiny config's train.local_steps


@pytest.fixture(scope="module")
def tiny_exp(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    require_glue()
    return Experiment.build(tiny_config(output_dir=tmp_path_factory.mktemp("runs")))


def one_sgd_step(exp: Experiment, train: list[Feature]) -> ClientContext:
    """A context whose round is one plain SGD step on ``train`` as one batch."""
    settings = exp.cfg.train.model_copy(
        update={
            "optimizer": "sgd",
            "momentum": 0.0,
            "weight_decay": 0.0,
            "clip_norm": 0.0,
            "schedule": "constant",
            "warmup_ratio": 0.0,
            "local_steps": 1,
            "batch_size": len(train),
            "lr": 0.1,
        }
    )
    return ClientContext(0, exp.model, train, settings, 0, 1, {}, seed=3)


def with_labels(exp: Experiment, labels: list[int]) -> list[Feature]:
    """Training examples of the tiny federation with these labels, in this order."""
    pool = [f for c in exp.clients for f in c.train]
    out, used = [], set()
    for y in labels:
        i = next(i for i, f in enumerate(pool) if f["label"] == y and i not in used)
        used.add(i)
        out.append(pool[i])
    return out


def record_step(
    exp: Experiment, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, list], torch.utils.hooks.RemovableHandle]:
    """Record the raw classifier outputs, the labels and the loss of every forward pass
    (until the returned hook is removed)."""
    seen: dict[str, list] = {"logits": [], "labels": [], "loss": []}
    model = exp.model
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
    return seen, hook


# --- the local objective --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("labels", "tau"),
    [([1, 0, 1, 1], 1.0), ([1, 1, 1, 1], 0.5)],  # the second: class 0 has no example
    ids=["both-classes", "a-class-never-seen"],
)
def test_a_step_minimizes_the_cross_entropy_of_the_calibrated_logits(
    tiny_exp: Experiment, monkeypatch: pytest.MonkeyPatch, labels: list[int], tau: float
) -> None:
    seen, hook = record_step(tiny_exp, monkeypatch)
    ctx = one_sgd_step(tiny_exp, with_labels(tiny_exp, labels))
    payload = tiny_exp.model.initial_params
    try:
        result = FedLC(tau=tau).local_train(ctx, payload)
    finally:
        hook.remove()
    (z,), (y,), (loss,) = seen["logits"], seen["labels"], seen["loss"]
    z, y = z.numpy(), y.numpy()
    # by hand: n_y from the labels, floored at 1e-8 (FL-bench's), z_y − τ n_y^(−1/4)
    counts = np.bincount(np.array(labels), minlength=2).astype(float)
    calibrated = z - tau * np.maximum(counts, 1e-8) ** -0.25
    rows = np.arange(len(y))
    expected = np.mean(logsumexp(calibrated, axis=1) - calibrated[rows, y])
    plain = np.mean(logsumexp(z, axis=1) - z[rows, y])
    assert loss == pytest.approx(expected, abs=1e-5)
    assert abs(expected - plain) > 0.05  # the calibration is in effect
    # and that loss is the one the step descended: the classifier bias moved by
    # −lr · mean(softmax(calibrated) − onehot(y)), its gradient
    grad = (softmax(calibrated, axis=1) - np.eye(2)[y]).mean(0)
    moved = (result.params["classifier.bias"] - payload["classifier.bias"]).double().numpy()
    np.testing.assert_allclose(moved, -0.1 * grad, atol=1e-6)
    # the offset is a training loss only: the model scores raw logits afterwards
    assert tiny_exp.model.head.logit_offset is None


def test_bad_or_default_hyperparameters() -> None:
    assert algorithms.create("fedlc").tau == 0.1  # chosen on validation (docstring)
    for bad in (-0.5, float("inf")):
        # a negative is out of range; inf is refused as every setting's is (not finite)
        with pytest.raises(
            algorithms.AlgorithmError, match=r"^algorithm\.tau: (must be|expected a finite)"
        ):
            algorithms.create("fedlc", tau=bad)


# --- the federation: what crosses, what it costs ----------------------------------------------


@needs_glue
def test_counts_are_read_on_the_client_and_never_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exp = Experiment.build(tiny_config("algorithm.name=fedlc", output_dir=tmp_path))
    counted: list[list[Feature]] = []
    real = fedlc_module.label_counts

    def recording(features: list[Feature], num_labels: int) -> np.ndarray:
        counted.append(list(features))
        return real(features, num_labels)

    monkeypatch.setattr(fedlc_module, "label_counts", recording)
    trained: list[tuple[list[Feature], ClientResult]] = []
    base = type(exp.algorithm)

    class Spy(base):  # type: ignore[misc, valid-type]
        log: ClassVar[list[tuple[list[Feature], ClientResult]]] = trained

        def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
            before = len(counted)
            result = super().local_train(ctx, payload)
            assert len(counted) == before + 1  # counted in the client's own step
            self.log.append((list(ctx.train), result))
            return result

    alg = exp.algorithm
    exp.algorithm = Spy(**{f.name: getattr(alg, f.name) for f in dataclasses.fields(alg)})
    run = RunDir.create(tmp_path / "runs", exp.cfg.name)
    summary = simulate(exp, run)
    assert len(trained) == 6  # 3 clients x 2 rounds
    # the counts came from each client's own training examples, nothing else
    assert [identical(c, train) for c, (train, _) in zip(counted, trained)] == [True] * 6
    for _, result in trained:
        assert set(result.params) == set(exp.model.param_names)  # the adapter, nothing more
        assert all(
            k in ("train_loss", "local_steps", "train_passes") or k.startswith("lr_sum_")
            for k in result.metrics
        )
    # FedAvg's compute: one pass a step; a global model, no personal one
    assert summary["compute"]["train_passes_per_client_round"] == STEPS
    assert "global" in summary and "personal" not in summary


@needs_glue
def test_several_clients_per_pass_train_one_by_one() -> None:
    """train.clients_per_pass > 1 batches plain local training only: FedLC's calibrated
    step falls back to one client at a time (FedAvg's is batched)."""
    groups = {}
    for name in ("fedavg", "fedlc"):
        exp = Experiment.build(tiny_config(f"algorithm.name={name}", "train.clients_per_pass=2"))
        groups[name] = ClientHost(exp, [0, 1, 2]).passes(0, [0, 1, 2])
    assert groups == {"fedavg": [[0, 1], [2]], "fedlc": [[0], [1], [2]]}


# --- refusals ---------------------------------------------------------------------------------


def test_sample_level_dp_refuses_it() -> None:
    """DP-SGD cannot cover a step that reads the label counts outside its per-example
    gradients."""
    cfg = tiny_config(
        "algorithm.name=fedlc", "privacy.level=sample", "privacy.noise_multiplier=1.0"
    )
    with pytest.raises(ConfigError, match="privacy.level: DP-SGD does not cover algorithm 'fedlc'"):
        build_algorithm(cfg)


@needs_glue
def test_a_regression_task_is_refused_in_one_line(tmp_path: Path) -> None:
    result = run_tiny_cli(tmp_path, "algorithm.name=fedlc", "data.task=STS-B")
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: algorithm.name: fedlc needs"), lines
    assert "STS-B has a regression output" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()

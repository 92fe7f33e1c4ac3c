"""MOCHA-style multi-task learning: the Ω-step against a matrix square root, the W-step's
fixed point against the closed form of the joint objective on quadratic clients, and Ω
showing the task blocks."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import scipy.linalg
import torch
from conftest import needs_glue
from quadratic import Quadratic, context

from fedloom import algorithms
from fedloom.algorithms.anchored import own_part
from fedloom.algorithms.mocha import ADAPTERS, IDS, MOCHA, OMEGA, relationship
from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

GROUPED = np.array([[2.0, 0.5], [2.0, -0.5], [-2.0, 0.3], [-2.0, -0.3]])


def test_omega_is_the_normalised_square_root_of_the_gram_matrix() -> None:
    deltas = np.random.default_rng(0).normal(size=(50, 4))
    root = scipy.linalg.sqrtm(deltas.T @ deltas).real
    np.testing.assert_allclose(relationship(deltas, floor=1e-9), root / np.trace(root), atol=1e-10)
    floored = relationship(np.outer(np.ones(50), [1.0, 1.0, 1.0]), floor=0.01)  # rank one
    assert np.trace(floored) == pytest.approx(1.0)
    assert np.linalg.eigvalsh(floored).min() > 0  # invertible


@dataclass(frozen=True)
class FixedOmega(MOCHA):
    """The W-step alone: Ω is given, never learned."""

    def aggregate(self, state, results):
        adapters = {**state.extra[ADAPTERS], **{r.client_id: r.params for r in results}}
        return self.next_state(state, extra={**state.extra, ADAPTERS: adapters})


def run(alg: MOCHA, optima: np.ndarray, rounds: int, omega: np.ndarray | None = None):
    models = [Quadratic(np.eye(2), w) for w in optima]
    state = alg.init({"w": torch.zeros(2, dtype=torch.float64)})
    if omega is not None:
        state = type(state)(0, state.global_params,
                            {ADAPTERS: {}, OMEGA: omega, IDS: list(range(len(optima)))})
    for r in range(rounds):
        results = [alg.local_train(context(m, k, 1, 0.1, 3, r, rounds, {}), alg.payload(state, k))
                   for k, m in enumerate(models)]
        state = alg.aggregate(state, results)
    return np.stack([own_part(alg.payload(state, k))["w"].numpy() for k in range(len(optima))]), state


def test_the_w_step_reaches_the_joint_optimum_for_a_given_omega() -> None:
    """F_k = ½‖x_k − a_k‖², x⁰ = 0: Σ_k F_k + (λ/2) tr(X Ω⁻¹ Xᵀ) is minimised by
    X (I + λ Ω⁻¹) = A (K-vectors per coordinate), whatever the coupling in Ω."""
    omega = np.array([[0.3, 0.1, -0.05], [0.1, 0.4, 0.0], [-0.05, 0.0, 0.3]])
    optima = GROUPED[:3]
    lam = 0.1
    got, _ = run(FixedOmega(lam=lam), optima, 300, omega)
    expected = np.linalg.solve(np.eye(3) + lam * np.linalg.inv(omega), optima)  # symmetric
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert np.abs(expected - optima).max() > 0.1  # the coupling matters at this λ


def test_lambda_zero_is_local_training() -> None:
    got, _ = run(algorithms.create("mocha", lam=0.0), GROUPED, 200)
    np.testing.assert_allclose(got, GROUPED, atol=1e-6)


def test_learned_omega_shows_the_task_blocks() -> None:
    """Two groups of two clients: Ω relates the clients within a group (positive entries)
    and sets the groups against each other (negative entries)."""
    alg = algorithms.create("mocha", lam=0.05)
    _, state = run(alg, GROUPED, 30)
    omega = state.extra[OMEGA]
    rows = alg.round_rows(state)
    assert rows[0]["scope"] == "omega" and rows[0]["clients"] == [0, 1, 2, 3]
    assert omega[0, 1] > 0.1 and omega[2, 3] > 0.1
    assert max(omega[0, 2], omega[0, 3], omega[1, 2], omega[1, 3]) < 0
    np.testing.assert_allclose(rows[0]["omega"], omega, atol=1e-6)


@pytest.mark.parametrize(("key", "value"), [("lam", -1.0), ("omega_warmup", -1),
                                            ("omega_floor", 0.0), ("omega_floor", 2.0)])
def test_mocha_refuses_bad_hyperparameters(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"algorithm.{key}"):
        algorithms.create("mocha", **{key: value})


@needs_glue
def test_mocha_logs_omega_every_round(make_config, tmp_path) -> None:
    cfg = make_config("algorithm.name=mocha", "federation.rounds=2")
    exp = Experiment.build(cfg)
    run_dir = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(exp, run_dir)
    rows = [json.loads(line) for line in run_dir.metrics_path.read_text().splitlines()]
    omegas = [r for r in rows if r["scope"] == "omega"]
    assert [r["round"] for r in omegas] == [1, 2]
    for r in omegas:
        omega = np.array(r["omega"])
        assert r["clients"] == [0, 1, 2] and omega.shape == (3, 3)
        assert np.trace(omega) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(omega, omega.T)
    train = [r for r in rows if r["scope"] == "train"]
    assert all(np.isfinite(r["train_loss"]) for r in train)

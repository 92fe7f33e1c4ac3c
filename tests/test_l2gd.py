"""L2GD (Hanzely & Richtárik 2020) against the closed form of its mixture objective, on
the quadratic clients of ``quadratic.py`` (real algorithm, real train_locally, plain SGD),
plus one tiny-bert simulation.

For F_k(x) = ½ (x − w_k*)ᵀ H_k (x − w_k*) the stationarity conditions of
(1/n) Σ_k F_k(x_k) + (λ/2n) Σ_k ||x_k − x̄||² are H_k (x_k − w_k*) + λ (x_k − x̄) = 0 for
every k (the paper's 1/n cancels), one linear system in (x_1, ..., x_n) solved exactly
below. With constant steps the iterates hover around the solution; the round-end average
is off by O(η) (the rounds end right after a run of local steps), which the tests measure.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_glue
from quadratic import CURVED, OPTIMA, Quadratic, context, optimum

from fedloom import algorithms
from fedloom.algorithms.l2gd import X
from fedloom.experiment import Experiment
from fedloom.runtime.client_state import load_client_state
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate


def mixture_optimum(curvatures: list[np.ndarray], lam: float) -> np.ndarray:
    """The (n, 2) solution of H_k (x_k − w_k*) + λ (x_k − (1/n) Σ_j x_j) = 0."""
    n = len(curvatures)
    system = np.zeros((2 * n, 2 * n))
    rhs = np.zeros(2 * n)
    for k, h in enumerate(curvatures):
        block = slice(2 * k, 2 * k + 2)
        system[block, block] += h + lam * np.eye(2)
        for j in range(n):
            system[block, 2 * j : 2 * j + 2] -= lam / n * np.eye(2)
        rhs[block] = h @ OPTIMA[k]
    return np.linalg.solve(system, rhs).reshape(n, 2)


def run_l2gd(lr: float, lam: float, p: float, rounds: int) -> np.ndarray:
    """The clients' adapters (x_k after the pending aggregation steps), averaged over the
    last half of ``rounds`` rounds, every client in every round."""
    alg = algorithms.create("l2gd", lam=lam, p=p)
    models = [Quadratic(h, w) for h, w in zip(CURVED, OPTIMA)]
    states: list[dict] = [{} for _ in models]
    state = alg.init({"w": torch.zeros(2, dtype=torch.float64)})
    total = np.zeros((len(models), 2))
    for r in range(rounds):
        results = [
            alg.local_train(context(m, k, 1, lr, 2, r, rounds, states[k]), alg.payload(state, k))
            for k, m in enumerate(models)
        ]
        state = alg.aggregate(state, results)
        if r >= rounds // 2:
            total += [
                alg.client_adapter(context(m, k, 1, lr, 2, r + 1, rounds, states[k]),
                                   state.global_params)["w"].numpy()
                for k, m in enumerate(models)
            ]
    return total / (rounds - rounds // 2)


def test_one_round_is_m_aggregation_steps_then_k_sgd_steps() -> None:
    lr, lam, p = 0.1, 2.0, 0.25
    alg = algorithms.create("l2gd", lam=lam, p=p, seed=3)
    theta = lr * lam * (1 - p) / p  # = 0.6
    x_k, x_bar = np.array([0.3, -0.7]), np.array([-0.2, 0.5])
    for r in range(6):
        model = Quadratic(CURVED[0], OPTIMA[0])
        ctx = context(model, 0, 1, lr, 2, r, 6, {X: {"w": torch.tensor(x_k)}})
        result = alg.local_train(ctx, {"w": torch.tensor(x_bar)})
        m, k = alg.coins(r, ctx.settings)
        start = x_bar + (1 - theta) ** m * (x_k - x_bar)
        step = np.linalg.matrix_power(np.eye(2) - lr * CURVED[0], k)
        expected = OPTIMA[0] + step @ (start - OPTIMA[0])
        assert result.metrics["local_steps"] == k and result.metrics["aggregation_steps"] == m
        assert result.metrics["theta"] == pytest.approx(theta)
        np.testing.assert_allclose(result.params["w"].numpy(), expected, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(ctx.state[X]["w"].numpy(), result.params["w"].numpy())


def test_coins_are_shared_and_geometric() -> None:
    alg = algorithms.create("l2gd", p=0.2)
    settings = context(Quadratic(CURVED[0], OPTIMA[0]), 0, 1, 0.1, 5, 0, 1, {}).settings
    draws = np.array([alg.coins(r, settings) for r in range(4000)])
    assert draws.min() >= 1  # every round has an aggregation and a local step
    # run lengths of a Bernoulli(p) sequence: E[m] = 1/(1 - p) = 1.25, E[K] = 1/p = 5
    assert draws[:, 0].mean() == pytest.approx(1.25, abs=0.03)
    assert draws[:, 1].mean() == pytest.approx(5.0, abs=0.25)
    # p unset: 1 / train.local_steps, so the expected local steps are the budget
    unset = algorithms.create("l2gd")
    assert unset.coin_p(settings) == pytest.approx(0.2)
    local_steps = [unset.coins(r, settings)[1] for r in range(4000)]
    assert np.mean(local_steps) == pytest.approx(5.0, abs=0.25)


def test_converges_to_the_mixture_optimum_as_the_step_shrinks() -> None:
    solution = mixture_optimum(CURVED, lam=1.0)
    coarse = np.abs(run_l2gd(0.08, 1.0, 0.5, 200) - solution).max()
    fine = np.abs(run_l2gd(0.02, 1.0, 0.5, 200) - solution).max()
    print(f"max |x_k - x_k*|: lr 0.08 {coarse:.4f}, lr 0.02 {fine:.4f}")
    assert fine < 0.02 and fine < coarse / 3  # O(lr): about 0.65 lr here


def test_small_lambda_gives_local_optima_and_large_lambda_one_common_point() -> None:
    # the closed form itself: λ → 0 the local optima, λ → ∞ the federated optimum
    assert np.abs(mixture_optimum(CURVED, 1e-4) - OPTIMA).max() < 1e-3
    common = mixture_optimum(CURVED, 1e4)
    assert np.abs(common - optimum(CURVED)).max() < 1e-3
    # the algorithm: λ = 0.01 stays at the local optima, each client its own
    local = run_l2gd(0.1, 0.01, 0.5, 200)
    assert np.abs(local - mixture_optimum(CURVED, 0.01)).max() < 0.005
    assert np.abs(local - OPTIMA).max() < 0.03
    # λ = 40 (θ = 0.8): every x_k near one point, the federated optimum (the clients' own
    # optima are 1 to 2 apart)
    pulled = run_l2gd(0.02, 40.0, 0.5, 200)
    assert np.abs(pulled - pulled.mean(axis=0)).max() < 0.03
    assert np.abs(pulled.mean(axis=0) - optimum(CURVED)).max() < 0.05


def test_bad_settings_name_the_key() -> None:
    settings = context(Quadratic(CURVED[0], OPTIMA[0]), 0, 1, 0.5, 4, 0, 1, {}).settings
    with pytest.raises(ValueError, match=r"algorithm.lam: the aggregation step θ .* = 1.5 > 1"):
        algorithms.create("l2gd", lam=1.0).theta("w", settings)  # 0.5 * 1 * 0.75 / 0.25
    epochs = settings.model_copy(update={"local_steps": None, "local_epochs": 1.0})
    with pytest.raises(ValueError, match="algorithm.p: unset"):
        algorithms.create("l2gd").coin_p(epochs)
    assert algorithms.create("l2gd", p=0.3).coin_p(epochs) == 0.3
    for hp, key in (({"p": 1.0}, "algorithm.p"), ({"lam": 0.0}, "algorithm.lam")):
        with pytest.raises(algorithms.AlgorithmError, match=key):
            algorithms.create("l2gd", **hp)


@needs_glue
def test_tiny_bert_run_keeps_x_k_on_the_clients_and_averages_them(
    make_config, tmp_path: Path
) -> None:
    cfg = make_config("algorithm.name=l2gd", "algorithm.lam=20.0", "train.schedule=constant")
    exp = Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    assert {"global", "personal"} <= set(summary)
    x_bar = load_params(run.checkpoints / "global.safetensors")
    xs = [load_client_state(run.checkpoints / "clients" / f"client_{c:03d}.safetensors")[X]
          for c in range(3)]
    alg = exp.algorithm
    m, _ = alg.coins(2, cfg.train)  # the aggregation steps pending before round 3
    theta = 5e-3 * 20.0 * (1 - 0.5) / 0.5  # train.lr = 5e-3, p = 1 / local_steps = 0.5
    for name, value in x_bar.items():
        # the server's x̄: the uniform mean of what the clients sent (their x_k)
        torch.testing.assert_close(value, sum(x[name] for x in xs) / 3)
    for c, x in enumerate(xs):
        mine = load_params(run.checkpoints / "personal" / f"client_{c:03d}.safetensors")
        for name in x_bar:
            expected = x_bar[name] + (1 - theta) ** m * (x[name] - x_bar[name])
            torch.testing.assert_close(mine[name], expected)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert [r["round"] for r in rows if r["scope"] == "personal/clients"] == [1, 2]

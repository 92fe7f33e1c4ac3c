"""mixture_admm reaches the closed-form solution of the mixture objective on quadratic
clients, from inexact local steps, for several λ and ρ."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quadratic import Quadratic, context

from fedloom import algorithms
from fedloom.algorithms.anchored import own_part

OPTIMA = np.array([[2.0, 0.5], [2.0, -0.5], [-2.0, 0.3], [0.5, -1.0]])


def run(rounds: int, steps: int = 3, **hp) -> np.ndarray:
    alg = algorithms.create("mixture_admm", **hp)
    models = [Quadratic(np.eye(2), w) for w in OPTIMA]
    states: list[dict] = [{} for _ in models]
    state = alg.init({"w": torch.zeros(2, dtype=torch.float64)})
    for r in range(rounds):
        results = [alg.local_train(context(m, k, 1, 0.1, steps, r, rounds, states[k]),
                                   alg.payload(state, k)) for k, m in enumerate(models)]
        state = alg.aggregate(state, results)
    return np.stack([own_part(alg.payload(state, k))["w"].numpy() for k in range(len(OPTIMA))])


@pytest.mark.parametrize(("lam", "rho"), [(0.5, 1.0), (1.0, 1.0), (4.0, 0.5), (1.0, 2.0)])
def test_reaches_the_closed_form_of_the_mixture_objective(lam: float, rho: float) -> None:
    """F_k = ½‖x − a_k‖²: Σ_k F_k(x_k) + (λ/2) Σ_k ‖x_k − x̄‖² is minimised at
    x_k = (a_k + λ ā) / (1 + λ) (x̄ = ā there)."""
    got = run(100, lam=lam, rho=rho)  # measured error at 100 rounds: 2e-12 to 8e-9
    expected = (OPTIMA + lam * OPTIMA.mean(axis=0)) / (1 + lam)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_lambda_zero_is_local_training() -> None:
    np.testing.assert_allclose(run(100, lam=0.0), OPTIMA, atol=1e-6)


def test_the_adapters_contract_towards_consensus_as_lambda_grows() -> None:
    """The spread of the solution is the optima's spread / (1 + λ)."""
    lams = (1.0, 3.0, 9.0)  # μ = λ + ρ keeps SGD at lr 0.1 stable (lr (1 + μ) < 2)
    # measured off by 1.3e-15 at most from 60 rounds on (1.1e-16 after 200; atol 1e-5)
    spread = [np.ptp(run(100, lam=lam, rho=1.0), axis=0) for lam in lams]
    for lam, s in zip(lams, spread):
        np.testing.assert_allclose(s, np.ptp(OPTIMA, axis=0) / (1 + lam), atol=1e-5)


@pytest.mark.parametrize(("key", "value"), [("lam", -1.0), ("rho", 0.0)])
def test_mixture_admm_refuses_bad_hyperparameters(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"algorithm.{key}"):
        algorithms.create("mixture_admm", **{key: value})

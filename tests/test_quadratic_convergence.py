"""Closed-form behaviour on quadratic clients, through the real algorithms and the real
local-training loop (``train_locally`` with plain SGD); the harness and the closed forms
(w*, FedAvg's fixed point x̄) are in ``quadratic.py``. Here every client has one example,
so p_k = 1/4.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from quadratic import (
    CURVED,
    FLAT,
    OPTIMA,
    Quadratic,
    context,
    fedavg_fixed_point,
    optimum,
    simulate,
)

from fedloom import algorithms


def fedprox_fixed_point(
    curvatures: list[np.ndarray], steps: int, lr: float, mu: float
) -> np.ndarray:
    """Local steps y ← B y + η (H w_k* + μ x), B = I − η (H + μ I); solve x = mean_k y_E(x)."""
    lhs, rhs = np.eye(2), np.zeros(2)
    for h, w in zip(curvatures, OPTIMA):
        m = h + mu * np.eye(2)
        b_e = np.linalg.matrix_power(np.eye(2) - lr * m, steps)
        reach = (np.eye(2) - b_e) @ np.linalg.inv(m)  # y_E = B^E x + reach (H w + μ x)
        lhs -= (b_e + mu * reach) / 4
        rhs += reach @ h @ w / 4
    return np.linalg.solve(lhs, rhs)


def test_fedavg_converges_to_its_biased_fixed_point_scaffold_to_the_optimum() -> None:
    lr, steps = 0.2, [5] * 4
    w_star = optimum(CURVED)
    biased = fedavg_fixed_point(CURVED, steps, lr)
    fedavg = simulate("fedavg", CURVED, steps, lr, rounds=30)  # off by 2e-12
    assert np.linalg.norm(fedavg - biased) < 1e-5
    assert np.linalg.norm(biased - w_star) > 0.4  # the bias is real (0.46; |w*| = 0.74)
    scaffold = simulate("scaffold", CURVED, steps, lr, rounds=40)  # 3e-8: float32 rounding
    assert np.linalg.norm(scaffold - w_star) < 1e-5, (scaffold, w_star)
    # option I (control variates = gradients at x) reaches the same optimum
    option_i = simulate("scaffold", CURVED, steps, lr, rounds=40, option="I")
    assert np.linalg.norm(option_i - w_star) < 1e-5, (option_i, w_star)
    # "auto" is option II for SGD, which is what the harness trains with
    assert np.array_equal(simulate("scaffold", CURVED, steps, lr, rounds=3, option="auto"),
                          simulate("scaffold", CURVED, steps, lr, rounds=3, option="II"))
    # with one local step FedAvg is gradient descent: no bias
    assert np.linalg.norm(simulate("fedavg", CURVED, [1] * 4, lr, rounds=60) - w_star) < 1e-5


def test_fedprox_bias_shrinks_as_mu_grows() -> None:
    lr, steps = 0.2, 5
    w_star = optimum(CURVED)
    biases = []
    for mu in (0.0, 0.3, 1.0, 3.0):
        x = simulate("fedprox", CURVED, [steps] * 4, lr, rounds=60, proximal_mu=mu)  # ≤ 5e-9 off
        assert np.linalg.norm(x - fedprox_fixed_point(CURVED, steps, lr, mu)) < 1e-5
        biases.append(float(np.linalg.norm(x - w_star)))
    assert biases[0] > biases[1] > biases[2] > biases[3], biases
    assert biases[3] < 0.6 * biases[0]  # 0.25 vs 0.46


def fednova_fixed_point(steps: list[int], lr: float) -> np.ndarray:
    """H_k = I: d_k = (1 − (1 − η)^τ_k)(x − w_k*)/τ_k, so x = Σ c_k w_k* / Σ c_k."""
    c = np.array([(1 - (1 - lr) ** t) / t for t in steps])
    return c @ OPTIMA / c.sum()


def test_unequal_local_steps_bias_fedavg_and_fednova_residual_is_order_lr() -> None:
    steps = [1, 5, 5, 5]
    lr = 0.1
    fedavg = simulate("fedavg", FLAT, steps, lr, rounds=50)  # off by 4e-10
    assert np.linalg.norm(fedavg - fedavg_fixed_point(FLAT, steps, lr)) < 1e-5
    # pulled towards the three clients that run five steps: about 0.23 from the optimum 0
    assert 0.2 < np.linalg.norm(fedavg) < 0.26
    assert fedavg[0] < 0  # towards (−1, 0), i.e. away from the one-step client at (1, 0)
    residuals = []
    for eta, rounds in ((lr, 40), (lr / 2, 70), (lr / 4, 140)):  # contraction 0.65, 0.81, 0.90
        nova = simulate("fednova", FLAT, steps, eta, rounds=rounds)
        assert np.linalg.norm(nova - fednova_fixed_point(steps, eta)) < 1e-5
        residuals.append(float(np.linalg.norm(nova)))
    assert residuals[0] < 0.06  # vs 0.23 for FedAvg
    # O(η): halving the local learning rate halves the residual
    assert residuals[0] / residuals[1] == pytest.approx(2.0, rel=0.05)
    assert residuals[1] / residuals[2] == pytest.approx(2.0, rel=0.05)


def test_fedsgd_is_one_gradient_step_on_the_federated_objective() -> None:
    lr = 0.05
    x1 = simulate("fedsgd", CURVED, [7] * 4, lr, rounds=1)  # local_steps is overridden to 1
    x0 = np.zeros(2)
    grad = sum(h @ (x0 - w) for h, w in zip(CURVED, OPTIMA)) / 4
    assert np.allclose(x1, x0 - lr * grad, atol=1e-7)
    # and it converges to the optimum, unbiased
    assert (
        np.linalg.norm(simulate("fedsgd", CURVED, [1] * 4, 0.3, rounds=40) - optimum(CURVED)) < 1e-5
    )


def test_scaffold_with_adamw_uses_gradients_as_control_variates() -> None:
    """Option II's (x − y)/(K η) is no gradient under AdamW; "auto" takes option I there:
    after one round client k's control variate is ∇F_k(x) = H_k (x − w_k*) exactly."""
    alg = algorithms.create("scaffold")
    x = np.array([0.3, -0.2])
    state = alg.init({"w": torch.tensor(x, dtype=torch.float64)})
    for k, (h, w_k) in enumerate(zip(CURVED, OPTIMA)):
        ctx = context(Quadratic(h, w_k), k, 4, 0.1, 3, 0, 1, {})
        ctx = replace(ctx, settings=ctx.settings.model_copy(update={"optimizer": "adamw"}))
        alg.local_train(ctx, alg.payload(state, k))
        assert np.allclose(ctx.state["scaffold_c"]["w"].double().numpy(), h @ (x - w_k), atol=1e-6)

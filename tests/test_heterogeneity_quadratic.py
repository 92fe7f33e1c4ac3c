"""Heterogeneity in closed form on the quadratic clients of ``quadratic.py``.

Client k: F_k(w) = ½ (w − w_k*)ᵀ H_k (w − w_k*), so ∇F_k(w) = H_k (w − w_k*), and with
p_k = n_k / Σ_j n_j

    ∇F(w) = Σ_k p_k H_k (w − w_k*),   G²(w) = Σ_k p_k ‖∇F_k(w) − ∇F(w)‖²,
    B²(w) = Σ_k p_k ‖∇F_k(w)‖² / ‖∇F(w)‖².

FedAvg's bias. E plain SGD steps of size η on F_k from x: y_{e+1} − w_k* = (I − η H_k)
(y_e − w_k*), so the client returns y = w_k* + A_k (x − w_k*), A_k = (I − η H_k)^E, and
one FedAvg round maps x to Σ_k p_k y_k = (Σ p_k A_k) x + Σ p_k (I − A_k) w_k*. This affine
map contracts (‖A_k‖ < 1 for 0 < η < 2/λ_max), so FedAvg converges to its fixed point

    x̄(E) = (Σ_k p_k (I − A_k))⁻¹ Σ_k p_k (I − A_k) w_k*.

For E = 1, I − A_k = η H_k and x̄(1) = (Σ p_k H_k)⁻¹ Σ p_k H_k w_k* = w*, the optimum of
F. For E > 1 the weights (I − A_k) are no longer proportional to the H_k: a client with
large curvature saturates (A_k → 0, weight I) while a flat one keeps gaining weight with
E, so x̄(E) ≠ w* — unless every H_k is the same matrix H, when the A_k are equal and
x̄(E) = Σ p_k w_k* = w* for every E. More local steps amplify the non-IID bias.

Every batch of a quadratic client has the same gradient, so the gradient estimates carry
no minibatch noise: v̂_k = 0 and the debiased G² and B² equal the raw ones.
"""

from __future__ import annotations

from itertools import pairwise

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
    shares,
    simulate,
)

from fedloom import algorithms
from fedloom.diagnostics import (
    client_drift,
    client_gradient,
    client_gradient_estimate,
    gradient_dissimilarity,
)

SIZES = (1, 2, 3, 4)  # unequal data shares p = (0.1, 0.2, 0.3, 0.4)
LR = 0.2


def by_hand(curvatures: list[np.ndarray], w: np.ndarray, sizes: tuple[int, ...]) -> dict:
    """G², B², ∇F and the per-client ‖∇F_k − ∇F‖² straight from the formulas."""
    p = shares(sizes)
    grads = [h @ (w - opt) for h, opt in zip(curvatures, OPTIMA)]
    mean = sum(pk * g for pk, g in zip(p, grads))
    per_client = [float((g - mean) @ (g - mean)) for g in grads]
    g2 = sum(pk * d for pk, d in zip(p, per_client))
    b2 = sum(pk * g @ g for pk, g in zip(p, grads)) / (mean @ mean)
    return {"grads": grads, "mean": mean, "per_client": per_client, "g2": g2, "b2": b2}


def measured(curvatures: list[np.ndarray], w: np.ndarray, sizes: tuple[int, ...]):
    """The client gradients (3 batches of 2: every example) and their dissimilarity, with
    the noise estimates (all 0) passed on."""
    estimates = {
        k: client_gradient_estimate(
            Quadratic(h, opt),
            {"w": torch.tensor(w)},
            [{"input_ids": [0]}] * n,
            batches=3,
            batch_size=2,
            seed=k,
        )
        for k, (h, opt, n) in enumerate(zip(curvatures, OPTIMA, sizes))
    }
    assert all(e.noise == 0.0 for e in estimates.values())
    gradients = {k: e.mean for k, e in estimates.items()}
    noise = {k: e.noise for k, e in estimates.items()}
    weights = {k: float(n) for k, n in enumerate(sizes)}
    return gradients, gradient_dissimilarity(gradients, weights, noise)


@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), SIZES])
@pytest.mark.parametrize("w", [(0.3, -0.2), (1.5, 2.0), (-0.7, 0.1)])
def test_g2_and_b2_match_the_closed_form(w: tuple[float, float], sizes: tuple[int, ...]) -> None:
    point = np.array(w)
    expected = by_hand(CURVED, point, sizes)
    gradients, dis = measured(CURVED, point, sizes)
    for k, g in enumerate(expected["grads"]):
        assert gradients[k].dtype == torch.float64 and gradients[k].shape == (2,)
        assert np.allclose(gradients[k].numpy(), g, rtol=1e-12, atol=0)
    assert dis.g2 == pytest.approx(expected["g2"], rel=1e-10)
    assert dis.b2 == pytest.approx(expected["b2"], rel=1e-10)
    assert dis.mean_gradient_norm == pytest.approx(np.linalg.norm(expected["mean"]), rel=1e-10)
    assert [dis.per_client[k] for k in range(4)] == pytest.approx(expected["per_client"], rel=1e-10)
    # G² = (B² − 1) ‖∇F‖²  (Σ p_k ‖∇F_k‖² = ‖∇F‖² + G²)
    assert dis.g2 == pytest.approx((dis.b2 - 1) * dis.mean_gradient_norm**2, rel=1e-10)
    g = np.stack(expected["grads"])
    norms = np.linalg.norm(g, axis=1)
    assert np.allclose(dis.cosine, g @ g.T / np.outer(norms, norms), rtol=1e-12)
    assert dis.clients == (0, 1, 2, 3)
    # exact gradients: nothing to remove
    assert dis.g2_debiased == dis.g2 and dis.b2_debiased == pytest.approx(dis.b2, rel=1e-12)
    assert dis.noise_share == 0.0


def test_deterministic_subsampled_gradients_have_zero_noise() -> None:
    """4 of 10 examples in 2 batches: the batch gradients agree exactly, so v̂ = 0 (not nan
    and not rounding noise) and debiased == raw; one batch of a subsample leaves v̂ nan."""
    w = {"w": torch.tensor([0.3, -0.2], dtype=torch.float64)}
    features = [{"input_ids": [0]}] * 10
    estimates = {
        k: client_gradient_estimate(Quadratic(h, opt), w, features, 2, 2, seed=k)
        for k, (h, opt) in enumerate(zip(CURVED, OPTIMA))
    }
    assert all((e.noise, e.batches, e.examples) == (0.0, 2, 4) for e in estimates.values())
    dis = gradient_dissimilarity(
        {k: e.mean for k, e in estimates.items()},
        dict.fromkeys(estimates, 10.0),
        {k: e.noise for k, e in estimates.items()},
    )
    assert dis.g2_debiased == dis.g2 and dis.noise_share == 0.0
    assert dis.b2_debiased == pytest.approx(dis.b2, rel=1e-12)
    single = client_gradient_estimate(Quadratic(CURVED[0], OPTIMA[0]), w, features, 1, 4, 0)
    assert np.isnan(single.noise)
    assert torch.equal(single.mean, estimates[0].mean)


def test_identity_curvature_at_zero_g2_is_one_and_b2_undefined() -> None:
    """H_k = I, w = 0: ∇F_k = −w_k*, ∇F = −mean_k w_k* = 0, G² = Σ p_k ‖w_k*‖² = 1."""
    _, dis = measured(FLAT, np.zeros(2), (1, 1, 1, 1))
    assert dis.g2 == pytest.approx(1.0, rel=1e-12)
    assert dis.mean_gradient_norm == 0.0
    assert dis.b2 == float("inf") and dis.b2_debiased == float("inf")
    assert dis.g2_debiased == dis.g2
    assert all(v == pytest.approx(1.0) for v in dis.per_client.values())
    # opposite optima point opposite ways, neighbours are orthogonal
    assert np.allclose(dis.cosine, [[1, 0, -1, 0], [0, 1, 0, -1], [-1, 0, 1, 0], [0, -1, 0, 1]])


def test_client_gradient_has_no_side_effects_but_setting_the_params() -> None:
    model = Quadratic(CURVED[0], OPTIMA[0])
    model.head.train(True)
    client_gradient(
        model,
        {"w": torch.tensor([2.0, 3.0], dtype=torch.float64)},
        [{"input_ids": [0]}] * 5,
        batches=2,
        batch_size=2,
        seed=0,
    )
    assert model.w.grad is None
    assert model.head.training
    assert torch.equal(model.w.detach(), torch.tensor([2.0, 3.0], dtype=torch.float64))


def test_g2_at_the_optimum_is_what_keeps_clients_apart() -> None:
    """At w*, ∇F = 0 but the clients still pull apart: G² > 0 and B² is undefined."""
    _, dis = measured(CURVED, optimum(CURVED, SIZES), SIZES)
    assert dis.mean_gradient_norm < 1e-12
    assert dis.g2 > 0.5


# --- FedAvg's fixed points through the real algorithm and train_locally ----------------------


@pytest.mark.parametrize("epochs", [1, 2, 5, 10])
def test_fedavg_with_equal_curvatures_reaches_the_optimum(epochs: int) -> None:
    """With H_k = I every step contracts the distance to w* by 1 − η = 0.8, so after
    100 / E rounds (100 steps, whatever E) it is 0.8¹⁰⁰ |start| ≈ 1.6e-10."""
    start = np.array([0.7, -0.4])
    x = simulate("fedavg", FLAT, [epochs] * 4, LR, rounds=100 // epochs, start=start)
    assert np.linalg.norm(x - optimum(FLAT)) < 1e-6
    assert np.allclose(optimum(FLAT), 0.0)


def test_fedavg_with_one_local_step_reaches_the_optimum() -> None:
    w_star = optimum(CURVED, SIZES)
    assert np.allclose(fedavg_fixed_point(CURVED, [1] * 4, LR, SIZES), w_star, atol=1e-12)
    x = simulate("fedavg", CURVED, [1] * 4, LR, rounds=100, sizes=SIZES)
    assert np.linalg.norm(x - w_star) < 1e-6


def test_the_bias_grows_with_local_epochs() -> None:
    w_star = optimum(CURVED, SIZES)
    bias = [
        np.linalg.norm(fedavg_fixed_point(CURVED, [e] * 4, LR, SIZES) - w_star)
        for e in range(1, 11)
    ]
    assert bias[0] < 1e-12
    assert all(a < b for a, b in pairwise(bias)), bias
    assert bias[4] > 0.05
    assert bias[4] == pytest.approx(0.4426, abs=1e-4)  # |w*| = 0.46
    assert bias[9] == pytest.approx(0.5931, abs=1e-4)


@pytest.mark.parametrize("epochs", [2, 5, 10])
def test_fedavg_converges_to_its_biased_fixed_point(epochs: int) -> None:
    """150 / E rounds (150 local steps): measured 2e-16, 2e-13 and 2e-11 from x̄(E)."""
    x = simulate("fedavg", CURVED, [epochs] * 4, LR, rounds=150 // epochs, sizes=SIZES)
    fixed = fedavg_fixed_point(CURVED, [epochs] * 4, LR, SIZES)
    assert np.linalg.norm(x - fixed) < 1e-6
    assert np.linalg.norm(x - optimum(CURVED, SIZES)) > 0.15  # 0.18, 0.44, 0.59


# --- client drift ----------------------------------------------------------------------------


@pytest.mark.parametrize("epochs", [1, 5])
def test_drift_after_local_training(epochs: int) -> None:
    """From x, the client returns y = w_k* + A_k (x − w_k*): drift ‖(I − A_k)(x − w_k*)‖."""
    x = np.array([0.5, -1.5])
    alg = algorithms.create("fedavg")
    for k, (h, opt) in enumerate(zip(CURVED, OPTIMA)):
        payload = {"w": torch.tensor(x)}
        ctx = context(Quadratic(h, opt), k, 1, LR, epochs, 0, 1, {})
        result = alg.local_train(ctx, payload)
        drift = client_drift(payload, result.params)
        assert drift == pytest.approx(float(torch.linalg.norm(result.params["w"] - payload["w"])))
        a_k = np.linalg.matrix_power(np.eye(2) - LR * h, epochs)
        assert drift == pytest.approx(np.linalg.norm((np.eye(2) - a_k) @ (x - opt)), rel=1e-12)

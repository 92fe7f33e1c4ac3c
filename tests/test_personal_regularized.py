"""Ditto, pFedMe, Per-FedAvg and APFL (and train/functional.py, which the last three run
on): each against its paper's defining equation, on quadratic clients with closed forms
and on tiny-bert over a small real MRPC subset, plus one run of each through ``simulate``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import identical, needs_glue, tiny_config
from quadratic import CURVED, OPTIMA, Quadratic, context

from fedloom import algorithms
from fedloom.algorithms import ClientResult, ServerState
from fedloom.algorithms.apfl import mixing_gradient
from fedloom.algorithms.fedavg import FedAvg
from fedloom.evaluation.score import evaluate
from fedloom.experiment import Experiment
from fedloom.params import Params, flatten
from fedloom.runtime.clients import client_context
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate
from fedloom.train.functional import ConfiguredOptimizer, loss_and_grad, step_batches
from fedloom.train.local import train_locally

LAMBDAS = (0.0, 0.1, 1.0, 10.0, 100.0)


# --- helpers ------------------------------------------------------------------------------


def federate(exp: Experiment, name: str, rounds: int, init: Params, **hp: Any) -> tuple[
    ServerState, dict[int, dict[str, Any]], Params
]:
    """``rounds`` full-participation rounds of ``name`` on tiny-bert as the runtime runs
    them; returns the server state, the clients' local states and the last payload."""
    alg = algorithms.create(name, **hp)
    states: dict[int, dict[str, Any]] = {c.client_id: {} for c in exp.clients}
    state = alg.init(init)
    payload = init
    for r in range(rounds):
        results = []
        payload = alg.payload(state, 0)
        for c in exp.clients:
            ctx = client_context(exp, c, r, dict(states[c.client_id]))
            results.append(alg.local_train(ctx, alg.payload(state, c.client_id)))
            states[c.client_id] = ctx.state
        state = alg.aggregate(state, results)
    return state, states, payload


def quadratic_rounds(
    name: str, models: list[Quadratic], lr: float, steps: int, rounds: int,
    start: np.ndarray, sizes: list[int] | None = None, **hp: Any,
) -> tuple[ServerState, list[ClientResult], list[dict[str, Any]]]:
    """Like quadratic.simulate, also returning the last round's results and local states."""
    alg = algorithms.create(name, **hp)
    sizes = sizes or [1] * len(models)
    states: list[dict[str, Any]] = [{} for _ in models]
    state = alg.init({"w": torch.tensor(start, dtype=torch.float64)})
    results: list[ClientResult] = []
    for r in range(rounds):
        results = [
            alg.local_train(context(m, k, sizes[k], lr, steps, r, rounds, states[k]),
                            alg.payload(state, k))
            for k, m in enumerate(models)
        ]
        state = alg.aggregate(state, results)
    return state, results, states


def distance(a: Params, b: Params) -> float:
    names = sorted(a)
    return float((flatten(a, names) - flatten(b, names)).norm())


@pytest.fixture(scope="module")
def skewed() -> tuple[Experiment, Params]:
    """tiny-bert, 3 clients with Dirichlet(0.1) label skew, and its initial adapter."""
    exp = Experiment.build(tiny_config("partition.scheme=dirichlet", "partition.alpha=0.1"))
    return exp, exp.model.get_params()


# --- train/functional.py ------------------------------------------------------------------


@needs_glue
def test_functional_loop_reproduces_train_locally_exactly() -> None:
    """step_batches + loss_and_grad + ConfiguredOptimizer = train_locally, bit for bit:
    AdamW with persisted moments over two rounds, warm-up + linear decay on the run's
    clock, gradient accumulation with an uneven last micro-batch, clipping, head_lr."""
    exp = Experiment.build(tiny_config(
        "train.grad_accum=2", "train.batch_size=5", "train.local_steps=3",
        "train.clip_norm=0.05", "train.head_lr=0.02", "train.warmup_ratio=0.2",
        "federation.rounds=2",
    ))
    start, client = exp.model.get_params(), exp.clients[0]
    reference: dict[str, Any] = {}
    by_hand: dict[str, Any] = {}
    for r in range(2):
        ctx = client_context(exp, client, r, reference)
        exp.model.set_params(start)
        metrics = train_locally(ctx)
        expected = exp.model.get_params()

        ctx = client_context(exp, client, r, by_hand)
        opt, batches, losses = ConfiguredOptimizer(ctx, start), step_batches(ctx), []
        for _ in range(opt.steps):
            loss, grads = loss_and_grad(exp.model, opt.params, next(batches))
            opt.step(grads)
            losses.append(loss)
        sums = opt.finish()
        got = opt.params
        assert all(torch.equal(got[n], expected[n]) for n in expected)
        assert float(np.mean(losses)) == metrics["train_loss"]
        assert sums == {k: v for k, v in metrics.items() if k.startswith("lr_sum")}
        assert max((got[n] - start[n]).abs().max() for n in got) > 1e-3  # it did train
        assert by_hand.keys() == reference.keys() == {"optimizer"}


@needs_glue
def test_loss_and_grad_with_a_seed_repeats_dropout_and_leaves_the_rng_alone(skewed) -> None:
    exp, init = skewed
    ctx = client_context(exp, exp.clients[0], 0, {})
    step = next(step_batches(ctx))
    before = torch.random.get_rng_state()
    a = loss_and_grad(exp.model, init, step, seed=7)
    b = loss_and_grad(exp.model, init, step, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert a[0] == b[0] and all(torch.equal(a[1][n], b[1][n]) for n in a[1])
    c = loss_and_grad(exp.model, init, step, seed=8)  # another dropout mask
    assert c[0] != a[0]


# --- Ditto --------------------------------------------------------------------------------


@needs_glue
def test_ditto_at_lambda_zero_is_local_training_exactly(tmp_path: Path) -> None:
    """λ = 0: the personal adapters Ditto's clients score and checkpoint after two
    rounds of ``simulate`` are bit for bit those of the ``local`` method (same start,
    steps, seeds and optimizer), although the global adapter trained in between."""
    personal = {}
    for name, extra in (("local", ()), ("ditto", ("algorithm.lam=0.0",))):
        cfg = tiny_config(f"algorithm.name={name}", *extra, "eval.every=2",
                          "partition.scheme=dirichlet", "partition.alpha=0.1",
                          output_dir=tmp_path / name)
        exp = Experiment.build(cfg)
        run = RunDir.create(tmp_path / name, cfg.name)
        summary = simulate(exp, run)
        folder = run.checkpoints / "personal"
        personal[name] = {p.name: load_params(p) for p in sorted(folder.iterdir())}
        if name == "ditto":
            assert {"global", "personal"} <= summary.keys()
            assert (run.checkpoints / "global.safetensors").is_file()
    assert personal["ditto"].keys() == personal["local"].keys() and len(personal["ditto"]) == 3
    for client, adapter in personal["ditto"].items():
        local = personal["local"][client]
        assert all(torch.equal(adapter[n], local[n]) for n in local), client


@needs_glue
def test_ditto_personal_adapter_approaches_the_global_as_lambda_grows() -> None:
    """||v_k − w^t|| after 3 rounds (w^t: the global adapter of the last round) falls
    strictly with λ for every client (plain SGD at 0.01, so λη ≤ 1 keeps the pull stable);
    measured: client 0 0.0410, 0.0409, 0.0403, 0.0352, 0.0118 for λ = 0, 0.1, 1, 10, 100."""
    exp = Experiment.build(tiny_config(
        "partition.scheme=dirichlet", "partition.alpha=0.1", "train.optimizer=sgd",
        "train.momentum=0.0", "train.lr=0.01", "train.clip_norm=0.0", "train.weight_decay=0.0",
        "federation.rounds=3",
    ))
    init = exp.model.get_params()
    gaps = []
    for lam in LAMBDAS:
        _, states, payload = federate(exp, "ditto", 3, init, lam=lam)
        gaps.append([distance(states[c]["personal"], payload) for c in sorted(states)])
    gaps_by_client = np.array(gaps).T
    for client_gaps in gaps_by_client:
        assert np.all(np.diff(client_gaps) < 0), client_gaps
        assert client_gaps[-1] < 0.5 * client_gaps[0]


def test_ditto_sends_the_fedavg_adapter_and_keeps_v_on_the_client() -> None:
    """Quadratic client, SGD: w_k is FedAvg's local training, v_k follows
    v ← v − η (H (v − w*) + λ (v − w^t)) from the payload, and only w_k is sent."""
    h, opt = CURVED[0], OPTIMA[0]
    model, state = Quadratic(h, opt), {}
    alg = algorithms.create("ditto", lam=2.0)
    payload = {"w": torch.tensor([0.3, -0.7], dtype=torch.float64)}
    result = alg.local_train(context(model, 0, 1, 0.1, 4, 0, 1, state), payload)
    w, v = payload["w"].numpy(), payload["w"].numpy()
    for _ in range(4):
        w = w - 0.1 * h @ (w - opt)
        v = v - 0.1 * (h @ (v - opt) + 2.0 * (v - payload["w"].numpy()))
    assert set(result.params) == {"w"}
    np.testing.assert_allclose(result.params["w"].numpy(), w, atol=1e-12)
    np.testing.assert_allclose(state["personal"]["w"].numpy(), v, atol=1e-12)
    np.testing.assert_allclose(alg.client_adapter(context(model, 0, 1, 0.1, 4, 0, 1, state),
                                                   payload)["w"].numpy(), v)


# --- pFedMe -------------------------------------------------------------------------------


def test_pfedme_theta_solves_the_inner_problem() -> None:
    """With many inner steps θ_k = (H + λI)⁻¹ (H w* + λ w_k), the inner problem's solution
    (one local step, so w_k is the payload); K = 1 is far from it."""
    h, opt, lam = CURVED[0], OPTIMA[0], 15.0
    w = np.array([0.3, -0.7])
    closed = np.linalg.solve(h + lam * np.eye(2), h @ opt + lam * w)
    errors = {}
    for k in (1, 60):
        state: dict[str, Any] = {}
        alg = algorithms.create("pfedme", lam=lam, K=k, personal_learning_rate=0.05)
        result = alg.local_train(context(Quadratic(h, opt), 0, 1, 0.01, 1, 0, 1, state),
                                 {"w": torch.tensor(w)})
        errors[k] = np.abs(state["personal"]["w"].numpy() - closed).max()
        if k == 60:  # the outer step: w_k − η λ (w_k − θ_k)
            np.testing.assert_allclose(result.params["w"].numpy(),
                                       w - 0.01 * lam * (w - closed), atol=1e-12)
    assert errors[60] < 1e-12 and errors[1] > 1e-3


def test_pfedme_beta_one_global_is_the_mean_of_the_local_copies() -> None:
    models = [Quadratic(h, o) for h, o in zip(CURVED, OPTIMA)]
    sizes = [1, 2, 3, 4]
    state, results, _ = quadratic_rounds("pfedme", models, 0.05, 3, 1, np.array([0.5, 0.5]),
                                         sizes, beta=1.0)
    sent = np.stack([r.params["w"].numpy() for r in results])
    mean = np.average(sent, axis=0, weights=sizes)
    assert torch.equal(state.global_params["w"], FedAvg().combine(state, results)[0]["w"])
    np.testing.assert_allclose(state.global_params["w"].numpy(), mean, atol=1e-7)  # fp32 mean


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_pfedme_converges_to_the_minimizer_of_the_mean_moreau_envelope(beta: float) -> None:
    """One local step, exact inner solves: each round is gradient descent on Σ_k p_k M_k
    with M_k(w) = ½ (w − w_k*)ᵀ G_k (w − w_k*), G_k = λ H_k (H_k + λI)⁻¹ (pFedMe's
    objective), whatever β; its minimizer is (Σ p_k G_k)⁻¹ Σ p_k G_k w_k*."""
    lam, sizes = 15.0, [1, 2, 3, 4]
    p = np.array(sizes) / sum(sizes)
    g = [lam * h @ np.linalg.inv(h + lam * np.eye(2)) for h in CURVED]
    target = np.linalg.solve(sum(pk * gk for pk, gk in zip(p, g)),
                             sum(pk * gk @ o for pk, gk, o in zip(p, g, OPTIMA)))
    models = [Quadratic(h, o) for h, o in zip(CURVED, OPTIMA)]
    state, _, _ = quadratic_rounds("pfedme", models, 0.3, 1, 40, np.array([2.0, -1.0]),
                                   sizes, lam=lam, K=25, beta=beta)
    np.testing.assert_allclose(state.global_params["w"].numpy(), target, atol=1e-6)
    assert np.abs(target - np.average(OPTIMA, axis=0, weights=sizes)).max() > 0.05


def test_pfedme_fixed_point_with_beta_is_the_mean_of_the_local_copies() -> None:
    """β = 2, three local steps, K = 5: at convergence w = (1 − β) w + β mean_k(w_k)
    forces w = mean_k(w_k) (checked to the fp32 precision of the aggregation)."""
    models = [Quadratic(h, o) for h, o in zip(CURVED, OPTIMA)]
    state, results, _ = quadratic_rounds("pfedme", models, 0.05, 3, 60, np.array([2.0, -1.0]),
                                         beta=2.0)
    sent = np.stack([r.params["w"].numpy() for r in results]).mean(axis=0)
    w = state.global_params["w"].numpy()
    np.testing.assert_allclose(w, sent, atol=2e-7)
    assert np.abs(sent - results[0].params["w"].numpy()).max() > 1e-2  # the copies differ


# --- Per-FedAvg ---------------------------------------------------------------------------


def _maml_step(h: np.ndarray, opt: np.ndarray, w: np.ndarray, alpha: float, beta: float,
               second_order: bool) -> np.ndarray:
    temp = w - alpha * h @ (w - opt)
    u = h @ (temp - opt)
    return w - beta * ((np.eye(2) - alpha * h) @ u if second_order else u)


@pytest.mark.parametrize("variant", ["hf", "fo"])
def test_perfedavg_step_against_exact_maml_on_a_quadratic(variant: str) -> None:
    """HF = the exact second-order MAML step w − β (I − α H) ∇f(w − α∇f(w)) (the finite
    difference of a linear gradient is exact); FO = it without the Hessian term, i.e.
    FO − exact = −α β H ∇f(temp)."""
    h, opt, alpha, beta = CURVED[0], OPTIMA[0], 0.1, 0.05
    w = np.array([0.3, -0.7])
    alg = algorithms.create("perfedavg", alpha=alpha, variant=variant)
    result = alg.local_train(context(Quadratic(h, opt), 0, 1, beta, 1, 0, 1, {}),
                             {"w": torch.tensor(w)})
    got = result.params["w"].numpy()
    exact = _maml_step(h, opt, w, alpha, beta, second_order=True)
    if variant == "hf":
        np.testing.assert_allclose(got, exact, atol=1e-10)
    else:
        u = h @ (w - alpha * h @ (w - opt) - opt)
        np.testing.assert_allclose(got - exact, -alpha * beta * h @ u, atol=1e-12)
        np.testing.assert_allclose(got, _maml_step(h, opt, w, alpha, beta, False), atol=1e-12)
        assert np.abs(got - exact).max() > 1e-3


@needs_glue
@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_adapted_model_beats_the_meta_model_on_every_client(skewed, variant) -> None:
    """After 3 rounds, one adaptation step (α = 0.01, default) from the meta-model lowers
    every client's loss on its whole training split (measured FO: 0.679 -> 0.645,
    0.689 -> 0.653, 0.701 -> 0.678) and on its test split, and leaves ctx.state alone."""
    exp, init = skewed
    state, states, _ = federate(exp, "perfedavg", 3, init, variant=variant)
    alg = algorithms.create("perfedavg", variant=variant)
    for c in exp.clients:
        own = states[c.client_id]
        before = copy.deepcopy(own)
        adapted = alg.client_adapter(client_context(exp, c, 3, own, salt=1), state.global_params)
        assert identical(own, before)
        for split in (c.train, c.test):
            meta = evaluate(exp.model, state.global_params, split, 64)["loss"]
            assert evaluate(exp.model, adapted, split, 64)["loss"] < meta - 0.01


# --- APFL ---------------------------------------------------------------------------------


@needs_glue
def test_apfl_alpha_gradient_matches_a_finite_difference(skewed) -> None:
    """∂f(α v + (1 − α) w)/∂α = ⟨∇f(v̄), v − w⟩ on tiny-bert (one dropout mask)."""
    exp, init = skewed
    alg = algorithms.create("apfl")
    gen = torch.Generator().manual_seed(0)
    v = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in init.items()}
    step = next(step_batches(client_context(exp, exp.clients[0], 0, {})))
    for alpha in (0.3, 0.8):
        _, g = loss_and_grad(exp.model, alg.mixture(alpha, v, init), step, seed=3)
        analytic = mixing_gradient(g, v, init)
        eps = 1e-2
        up, _ = loss_and_grad(exp.model, alg.mixture(alpha + eps, v, init), step, seed=3)
        down, _ = loss_and_grad(exp.model, alg.mixture(alpha - eps, v, init), step, seed=3)
        numeric = (up - down) / (2 * eps)
        assert abs(numeric) > 1e-3
        assert analytic == pytest.approx(numeric, rel=2e-2)


class NoisyQuadratic(Quadratic):
    """F(w) + ⟨ξ, w⟩ with a fresh ξ ~ N(0, I) at every evaluation, from the client's own
    generator: stochastic gradients whose noise differs between clients."""

    def __init__(self, optimum: np.ndarray, seed: int) -> None:
        super().__init__(np.eye(2), optimum)
        self.noise = torch.Generator().manual_seed(seed)

    def loss(self, batch: Any) -> torch.Tensor:
        xi = torch.randn(2, dtype=torch.float64, generator=self.noise)
        return super().loss(batch) + (xi * self.w).sum()


@pytest.mark.parametrize("seed", [0, 1])
def test_apfl_alpha_goes_to_one_for_the_client_unlike_the_rest(seed: int) -> None:
    """Four clients with optimum 0 and ten examples each, one with optimum (4, 4) and one
    example; noisy gradients, two SGD steps a round at 0.1, α from 0.5 at η_α = 0.03.
    The global model (≈ 0.1 from 0) averages four clients' noise at little bias for the
    four, whose α falls; for the outlier it is far off, and its α rises. Measured after
    100 rounds, noise seeds 0-3: outlier 0.80, 0.73, 0.93, 0.72; the others at most
    0.45, 0.39, 0.44, 0.46."""
    optima = np.vstack([np.zeros((4, 2)), [[4.0, 4.0]]])
    models = [NoisyQuadratic(o, 100 * seed + k) for k, o in enumerate(optima)]
    _, results, states = quadratic_rounds("apfl", models, 0.1, 2, 100, np.zeros(2),
                                          [10, 10, 10, 10, 1], alpha=0.5, alpha_lr=0.03)
    alphas = [s["alpha"] for s in states]
    assert alphas[4] > 0.65
    assert max(alphas[:4]) < 0.5
    assert all(r.metrics["alpha"] == a for r, a in zip(results, alphas))
    # the personal model is the mixture with the received global
    alg = algorithms.create("apfl")
    payload = {"w": torch.tensor([0.5, 0.5], dtype=torch.float64)}
    mixed = alg.client_adapter(context(models[0], 0, 1, 0.1, 5, 0, 1, states[0]), payload)
    v = states[0]["personal"]["w"]
    torch.testing.assert_close(mixed["w"], alphas[0] * v + (1 - alphas[0]) * payload["w"])


def test_apfl_step_matches_the_paper_and_fixed_alpha_stays() -> None:
    """One step from w = v = payload after a warm-up: w ← w − η∇f(w), v ← v − η α ∇f(v̄),
    α ← α − η_α ⟨∇f(v̄), v − w⟩ (quadratic, SGD); adaptive = false keeps α."""
    h, opt, eta = CURVED[1], OPTIMA[1], 0.1
    w0 = np.array([0.4, -0.2])
    v0 = np.array([-0.5, 0.9])
    for adaptive in (True, False):
        state = {"personal": {"w": torch.tensor(v0)}, "alpha": 0.3}
        alg = algorithms.create("apfl", alpha_lr=0.05, adaptive=adaptive)
        result = alg.local_train(context(Quadratic(h, opt), 0, 1, eta, 1, 0, 1, state),
                                 {"w": torch.tensor(w0)})
        mixed = 0.3 * v0 + 0.7 * w0
        g = h @ (mixed - opt)
        np.testing.assert_allclose(result.params["w"].numpy(), w0 - eta * h @ (w0 - opt))
        np.testing.assert_allclose(state["personal"]["w"].numpy(), v0 - eta * 0.3 * g)
        expected = float(np.clip(0.3 - 0.05 * g @ (v0 - w0), 0, 1)) if adaptive else 0.3
        assert state["alpha"] == pytest.approx(expected, abs=1e-12)
        assert expected != 0.3 or not adaptive


# --- every method through simulate ---------------------------------------------------------


@needs_glue
@pytest.mark.parametrize(("name", "extra"), [
    ("ditto", ()), ("pfedme", ()), ("apfl", ()), ("pfedmac", ()),
    ("perfedavg", ("algorithm.alpha=0.3",)),  # one adaptation step of 0.01 barely moves
])
def test_runs_end_to_end_with_global_and_personal_scores(
    name: str, extra: tuple[str, ...], tmp_path: Path
) -> None:
    """Dirichlet(0.1) skew gives the 3 clients 7 and 25 examples of label 1 and 15 of
    label 0 with 1 of label 1: one global adapter cannot serve both majorities (its worst
    client scores below 0.5), an adapter of the client's own can. Measured after 3 rounds
    at lr 0.03: personal 0.94 or 1.0 on every client for every method, global worst 0.0
    to 0.06."""
    cfg = tiny_config(f"algorithm.name={name}", *extra, "partition.scheme=dirichlet",
                      "partition.alpha=0.1", "federation.fraction=0.6", "federation.rounds=3",
                      "train.lr=0.03", output_dir=tmp_path / "runs")
    exp = Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    assert summary["algorithm"] == name
    assert {"dev", "clients"} <= summary["global"].keys()
    assert summary["global"]["clients"]["accuracy"]["min"] < 0.5
    assert summary["personal"]["clients"]["accuracy"]["min"] >= 0.9
    assert np.isfinite(summary["global"]["dev"]["loss"])
    personal = sorted(p.name for p in (run.checkpoints / "personal").iterdir())
    assert personal == [f"client_{i:03d}.safetensors" for i in range(3)]
    global_params = load_params(run.checkpoints / "global.safetensors")
    assert set(global_params) == set(exp.model.param_names)


@pytest.mark.parametrize(("name", "hp", "key"), [
    ("ditto", {"lam": -1.0}, "algorithm.lam"),
    ("pfedme", {"lam": 0.0}, "algorithm.lam"),
    ("pfedme", {"K": 0}, "algorithm.K"),
    ("pfedme", {"personal_learning_rate": 0.0}, "algorithm.personal_learning_rate"),
    ("pfedme", {"beta": -0.5}, "algorithm.beta"),
    ("perfedavg", {"alpha": 0.0}, "algorithm.alpha"),
    ("perfedavg", {"variant": "so"}, "algorithm.variant"),
    ("perfedavg", {"delta": 0.0}, "algorithm.delta"),
    ("apfl", {"alpha": 1.5}, "algorithm.alpha"),
    ("apfl", {"alpha_lr": -0.1}, "algorithm.alpha_lr"),
])
def test_bad_hyperparameters_name_their_key(name: str, hp: dict[str, Any], key: str) -> None:
    with pytest.raises(algorithms.AlgorithmError, match=key):
        algorithms.create(name, **hp)

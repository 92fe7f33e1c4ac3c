"""DIANA, ADIANA, MARINA and EF21 on closed-form quadratic clients, through the real
algorithms and the real local-training loop: with one local SGD step each is its paper's
recursion (written out here in numpy, on the gradient oracle G_i(x) = η_l ∇f_i(x) that
one step of learning rate η_l makes of the pseudo-gradient x − y_i; 1e-10), converges to
the federated optimum with its operator, and sends only the operator's bytes.

The clients: f_i(x) = ½ (x − w_i)ᵀ H_i (x − w_i) in d dimensions with different optima, so
∇f_i(x*) ≠ 0 at the optimum x* = (Σ H_i)⁻¹ Σ H_i w_i of f = mean f_i: plain compressed
gradient descent keeps a variance floor there, which the learned shifts remove.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import needs_glue, tiny_raw
from quadratic import Quadratic, context

from fedloom import algorithms
from fedloom.algorithms import Algorithm, AlgorithmError
from fedloom.algorithms.compressed import message_generator, server_coin
from fedloom.algorithms.diana import SHIFT, Diana
from fedloom.comm.compressors import Compressor
from fedloom.comm.message import is_wire
from fedloom.config import ConfigError, validate
from fedloom.experiment import build_algorithm
from fedloom.runtime.client_state import load_client_state, save_client_state

# --- the harness -----------------------------------------------------------------------------


class QuadraticND(Quadratic):
    """tests/quadratic.py's client in ``len(optimum)`` dimensions."""

    def __init__(self, h: np.ndarray, optimum: np.ndarray) -> None:
        super().__init__(h, optimum)
        self.w = torch.nn.Parameter(torch.zeros(len(optimum), dtype=torch.float64))
        self.initial_params = self.get_params()


@dataclass
class Problem:
    curvatures: list[np.ndarray]
    optima: list[np.ndarray]

    @property
    def d(self) -> int:
        return len(self.optima[0])

    @property
    def optimum(self) -> np.ndarray:
        return np.linalg.solve(
            sum(self.curvatures), sum(h @ w for h, w in zip(self.curvatures, self.optima))
        )

    def oracle(self, i: int, x: np.ndarray, lr: float) -> np.ndarray:
        """G_i(x) = η_l ∇f_i(x): the pseudo-gradient of one SGD step."""
        return lr * self.curvatures[i] @ (x - self.optima[i])


def problem(d: int, n: int = 4, kappa: float = 10.0, seed: int = 0) -> Problem:
    """n clients in d dimensions: one eigenbasis, eigenvalues spread over [1/κ, 1] and
    jittered per client, optima of norm ≈ 1 in different directions."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    curvatures, optima = [], []
    for _ in range(n):
        ev = np.geomspace(1.0 / kappa, 1.0, d) * np.exp(rng.uniform(-0.2, 0.2, d))
        curvatures.append(q @ np.diag(ev / ev.max()) @ q.T)
        optima.append(rng.standard_normal(d) / math.sqrt(d))
    return Problem(curvatures, optima)


def run(
    alg: Algorithm | str,
    prob: Problem,
    rounds: int,
    lr: float = 1.0,
    states: list[dict] | None = None,
    round_trip: Path | None = None,
    **hp: Any,
) -> list[np.ndarray]:
    """The global parameters after each of ``rounds`` rounds, every client taking part
    with one SGD step of ``lr``; ``round_trip``: every client's state goes through the
    client checkpoint format between rounds."""
    alg = algorithms.create(alg, **hp) if isinstance(alg, str) else alg
    models = [QuadraticND(h, w) for h, w in zip(prob.curvatures, prob.optima)]
    states = [{} for _ in models] if states is None else states
    state = alg.init({"w": torch.zeros(prob.d, dtype=torch.float64)})
    alg.check_model(state.global_params)
    out = []
    for r in range(rounds):
        results = []
        for k, model in enumerate(models):
            ctx = context(model, k, 1, lr, 1, r, rounds, states[k])
            results.append(alg.local_train(ctx, alg.payload(state, k)))
            if round_trip is not None:
                save_client_state(round_trip / f"c{k}.safetensors", states[k], r, k)
                states[k].clear()
                states[k].update(load_client_state(round_trip / f"c{k}.safetensors"))
        state = alg.aggregate(state, results)
        out.append(state.global_params["w"].double().numpy().copy())
    return out


def errors(trajectory: list[np.ndarray], prob: Problem) -> np.ndarray:
    return np.array([np.linalg.norm(x - prob.optimum) for x in trajectory])


def compress(op: Compressor, v: np.ndarray, client: int, round_: int, stream: int = 0):
    """C(v) as the receiver decodes it: the harness's round-r client seed is r."""
    gen = message_generator(round_, client, round_, stream)
    return op.decode(op.encode(torch.from_numpy(v).float(), gen)).double().numpy()


def fl32(v: np.ndarray) -> np.ndarray:
    """The identity on the wire: float32."""
    return v.astype(np.float32).astype(np.float64)


# --- one local step: the papers' recursions ---------------------------------------------------

LR = 0.3  # η_l; the oracle is G_i = η_l ∇f_i


def diana_by_hand(prob: Problem, rounds: int, op: Compressor, alpha: float, gamma: float):
    n, x = len(prob.optima), np.zeros(prob.d)
    h_i, h, out = [np.zeros(prob.d) for _ in range(n)], np.zeros(prob.d), []
    for r in range(rounds):
        m = [compress(op, prob.oracle(i, x, LR) - h_i[i], i, r) for i in range(n)]
        h_i = [h_i[i] + alpha * m[i] for i in range(n)]
        g_hat = h + sum(m) / n
        h = h + alpha * sum(m) / n
        x = x - gamma * g_hat
        out.append(x)
    return out


def marina_by_hand(prob: Problem, rounds: int, alg: Any, gamma: float):
    n, x, op = len(prob.optima), np.zeros(prob.d), alg.operator
    g, last, out = np.zeros(prob.d), [np.zeros(prob.d)] * n, []
    for r in range(rounds):
        grads = [prob.oracle(i, x, LR) for i in range(n)]
        if alg.coin(r, prob.d):  # g^{k+1} = ∇f(x^{k+1}) (through the float32 wire)
            g = sum(fl32(v) for v in grads) / n
        else:  # g^{k+1} = g^k + mean C(∇f_i(x^{k+1}) − ∇f_i(x^k))
            g = g + sum(compress(op, grads[i] - last[i], i, r) for i in range(n)) / n
        last = grads
        x = x - gamma * g  # x^{k+2} = x^{k+1} − γ g^{k+1}
        out.append(x)
    return out


def ef21_by_hand(prob: Problem, rounds: int, op: Compressor, scale: float, gamma: float):
    n, x = len(prob.optima), np.zeros(prob.d)
    g_i, g, out = [np.zeros(prob.d) for _ in range(n)], np.zeros(prob.d), []
    for r in range(rounds):
        c = [scale * compress(op, prob.oracle(i, x, LR) - g_i[i], i, r) for i in range(n)]
        g_i = [g_i[i] + c[i] for i in range(n)]
        g = g + sum(c) / n
        x = x - gamma * g
        out.append(x)
    return out


def adiana_by_hand(prob: Problem, rounds: int, alg: Any):
    """Li et al. 2020, Algorithm 2 (ψ = 0), from x⁰ = y⁰ = z⁰ = w⁰ = 0, h_i⁰ = 0."""
    n, op = len(prob.optima), alg.operator
    eta, th1, th2, alpha, beta, gamma, p = alg.parameters(prob.d, n)
    y = z = w = np.zeros(prob.d)
    h_i, h, out = [np.zeros(prob.d) for _ in range(n)], np.zeros(prob.d), []
    for k in range(rounds):
        x = th1 * z + th2 * w + (1 - th1 - th2) * y
        m = [compress(op, prob.oracle(i, x, LR) - h_i[i], i, k, 0) for i in range(n)]
        h_t = [compress(op, prob.oracle(i, w, LR) - h_i[i], i, k, 1) for i in range(n)]
        h_i = [h_i[i] + alpha * h_t[i] for i in range(n)]
        g = sum(m) / n + h
        h = h + alpha * sum(h_t) / n
        y_new = x - eta * g
        z = beta * z + (1 - beta) * x + (gamma / eta) * (y_new - x)
        w = y if alg.moves_w(k, p) else w
        y = y_new
        out.append(y)
    return out


ONE_STEP = [
    ("diana", {"compressor": "randk", "ratio": 0.3, "gamma": 0.8}),
    ("diana", {"compressor": "identity", "alpha": 0.5}),
    ("marina", {"compressor": "randk", "k": 3, "gamma": 0.7}),
    ("ef21", {"compressor": "topk", "k": 2, "gamma": 0.9}),
    ("ef21", {"compressor": "randk", "k": 4}),
    ("adiana", {"compressor": "randk", "ratio": 0.5, "mu": 0.02}),
    ("adiana", {"compressor": "identity", "eta": 0.3, "theta_1": 0.2, "p": 0.4, "beta": 0.9}),
]


@pytest.mark.parametrize(("name", "hp"), ONE_STEP, ids=[f"{n}-{h['compressor']}" for n, h in ONE_STEP])
def test_one_local_step_is_the_papers_recursion(name: str, hp: dict) -> None:
    prob, rounds = problem(8, seed=1), 12
    alg: Any = algorithms.create(name, **hp)
    ours = run(alg, prob, rounds, lr=LR)
    if name == "diana":
        theirs = diana_by_hand(prob, rounds, alg.operator, alg.shift_step(prob.d), alg.gamma)
    elif name == "marina":
        theirs = marina_by_hand(prob, rounds, alg, alg.gamma)
        coins = [alg.coin(r, prob.d) for r in range(rounds)]
        assert coins[0] and not all(coins)  # both kinds of round happened
    elif name == "ef21":
        theirs = ef21_by_hand(prob, rounds, alg.operator, alg.scale(prob.d), alg.gamma)
    else:
        theirs = adiana_by_hand(prob, rounds, alg)
    for r, (a, b) in enumerate(zip(ours, theirs)):
        assert np.max(np.abs(a - b)) < 1e-10, (r, a, b)
    assert np.linalg.norm(ours[-1]) > 0.1  # it moved


def test_defaults_come_from_the_operators_omega() -> None:
    d = 20
    diana: Any = algorithms.create("diana", compressor="randk", k=5)
    assert diana.omega(d) == 3.0 and diana.shift_step(d) == 0.25  # 1/(ω + 1) = k/d
    marina: Any = algorithms.create("marina", compressor="randk", ratio=0.1)
    assert marina.full_probability(d) == pytest.approx(0.1)  # ζ/d
    ef21: Any = algorithms.create("ef21", compressor="randk", k=5)
    assert ef21.scale(d) == 0.25
    assert algorithms.create("ef21", compressor="topk", k=5).scale(d) == 1.0  # type: ignore[attr-defined]
    adiana: Any = algorithms.create("adiana", compressor="randk", k=5)
    a = adiana.parameters(d, 4)
    assert (a.alpha, a.theta_2, a.p, a.theta_1, a.beta) == (0.25, 0.5, 0.125, 0.25, 1.0)
    assert a.gamma == a.eta / (2 * a.theta_1)
    identity: Any = algorithms.create("diana")
    assert identity.shift_step(d) == 1.0  # ω = 0


def test_with_the_identity_they_are_fedavg() -> None:
    """γ = 1, the identity (α = 1, p = 1): the uniform mean of the clients' models."""
    prob = problem(6, seed=2)
    fedavg = run("fedavg", prob, 5, lr=LR, weighting="uniform")
    for name in ("diana", "marina", "ef21"):
        ours = run(name, prob, 5, lr=LR)
        assert np.max(np.abs(ours[-1] - fedavg[-1])) < 1e-6, name  # float32 on the wire


# --- convergence -------------------------------------------------------------------------------


def test_diana_converges_where_compressed_gd_stalls() -> None:
    """Random-k (k = d/4, ω = 3): DIANA reaches the optimum; the same method with α = 0
    (h_i = 0: compressed gradient descent) keeps a floor set by ‖∇f_i(x*)‖ ≠ 0."""

    @dataclass(frozen=True)
    class CompressedGD(Diana):
        def shift_step(self, d: int) -> float:
            return 0.0  # α = 0 is refused as a hyperparameter; this is what it would do

    prob, rounds = problem(16, kappa=4.0, seed=3), 150
    hp = {"compressor": "randk", "k": 4, "gamma": 0.4}  # γ = 1/(1 + 2ω/n)
    diana = errors(run("diana", prob, rounds, **hp), prob)
    plain = errors(run(CompressedGD(**hp), prob, rounds), prob)
    print(f"diana {diana[-1]:.2e} after {rounds} rounds; compressed GD, the last 50: "
          f"mean {plain[-50:].mean():.3f}, min {plain[-50:].min():.3f}")
    assert diana[-1] < 1e-6
    assert plain[-50:].mean() > 0.05 and plain[-50:].min() > 0.01


def test_ef21_with_top_k_converges() -> None:
    prob, rounds = problem(16, kappa=4.0, seed=4), 100
    e = errors(run("ef21", prob, rounds, compressor="topk", k=4, gamma=0.8), prob)
    print(f"ef21 top-4 of 16: {e[49]:.2e} after 50 rounds, {e[-1]:.2e} after {rounds}")
    assert e[-1] < 1e-6


def test_marina_with_random_k_converges() -> None:
    prob, rounds = problem(16, kappa=4.0, seed=5), 100
    e = errors(run("marina", prob, rounds, compressor="randk", k=4, gamma=0.8), prob)
    print(f"marina rand-4 of 16 (p = 1/4): {e[49]:.2e} after 50 rounds, {e[-1]:.2e} after {rounds}")
    assert e[-1] < 1e-6


def mu_and_lr(prob: Problem) -> tuple[float, float]:
    """μ/L of f and train.lr = 1/L."""
    lam = np.linalg.eigvalsh(np.mean(prob.curvatures, axis=0))
    return lam.min() / lam.max(), 1.0 / lam.max()


def test_adiana_converges() -> None:
    prob, rounds = problem(12, kappa=4.0, seed=6), 150
    mu, lr = mu_and_lr(prob)
    e = errors(run("adiana", prob, rounds, lr=lr, mu=mu, compressor="randk", k=6), prob)
    print(f"adiana rand-6 of 12: {e[49]:.2e} after 50 rounds, {e[-1]:.2e} after {rounds}")
    assert e[-1] < 1e-6


def test_adiana_beats_diana_when_ill_conditioned() -> None:
    """κ = 100, natural compression (ω = 1/8): ADIANA with μ/L known against DIANA at its
    theoretical step 1/(1 + 2ω/n), both with train.lr = 1/L, after the same rounds."""
    prob, rounds = problem(10, kappa=100.0, seed=6), 200
    mu, lr = mu_and_lr(prob)
    adiana = errors(run("adiana", prob, rounds, lr=lr, mu=mu, compressor="natural"), prob)
    gamma = 1 / (1 + 2 * 0.125 / 4)
    diana = errors(run("diana", prob, rounds, lr=lr, gamma=gamma, compressor="natural"), prob)
    print(f"κ = 100, after {rounds} rounds: adiana {adiana[-1]:.2e}, diana {diana[-1]:.2e}")
    assert adiana[-1] < diana[-1] / 10


# --- what travels, and the client's state --------------------------------------------------------


@pytest.mark.parametrize("name", ["diana", "adiana", "marina", "ef21"])
def test_results_carry_only_the_operators_bytes(name: str) -> None:
    d = 1000
    prob = Problem([np.eye(d)], [np.ones(d)])
    alg = algorithms.create(name, compressor="randk", ratio=0.1)
    model = QuadraticND(prob.curvatures[0], prob.optima[0])
    state = alg.init({"w": torch.zeros(d, dtype=torch.float64)})
    sizes = []
    for r in range(2):  # MARINA's first round is a full one
        result = alg.local_train(context(model, 0, 1, 0.5, 1, r, 2, {}), alg.payload(state, 0))
        assert result.params and all(is_wire(n, t) for n, t in result.params.items())
        sizes.append(sum(t.numel() for t in result.params.values()))
        state = alg.aggregate(state, [result])
    float32_update = 4 * d
    messages = 2 if name == "adiana" else 1
    assert sizes[-1] < messages * 0.11 * float32_update  # 100 values of 4 bytes, a seed, a header
    if name == "marina":
        assert sizes[0] > float32_update  # the full round: the float32 vector and its header


@pytest.mark.parametrize("name", ["diana", "adiana", "marina", "ef21"])
def test_client_state_survives_the_checkpoint_format(name: str, tmp_path: Path) -> None:
    prob = problem(8, seed=7)
    hp = {"compressor": "randk", "k": 2} if name != "ef21" else {"compressor": "topk", "k": 2}
    states: list[dict] = [{} for _ in prob.optima]
    straight = run(name, prob, 4, lr=LR, states=states, **hp)
    stored = run(name, prob, 4, lr=LR, round_trip=tmp_path, **hp)
    assert np.array_equal(straight[-1], stored[-1])
    key = {"diana": SHIFT, "adiana": "adiana_h", "marina": "marina_g", "ef21": "ef21_g"}[name]
    assert all(isinstance(s[key]["w"], torch.Tensor) for s in states)


def test_partial_participation_keeps_the_mean_shift() -> None:
    """DIANA with N = 4 and 2 clients a round: h stays the mean of all four shifts."""
    prob = problem(6, seed=8)
    alg: Any = algorithms.create("diana", compressor="randk", k=3, num_clients=4)
    alg.check_federation(2, 4)
    models = [QuadraticND(h, w) for h, w in zip(prob.curvatures, prob.optima)]
    states: list[dict] = [{} for _ in models]
    state = alg.init({"w": torch.zeros(prob.d, dtype=torch.float64)})
    for r, sampled in enumerate([(0, 1), (2, 3), (1, 2), (0, 3)]):
        results = [
            alg.local_train(context(models[k], k, 1, LR, 1, r, 4, states[k]), alg.payload(state, k))
            for k in sampled
        ]
        state = alg.aggregate(state, results)
        shifts = [s[SHIFT]["w"] if s else torch.zeros(prob.d) for s in states]
        assert torch.allclose(state.extra["h"]["w"], sum(shifts) / 4, atol=1e-12)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "hp", "key"),
    [
        ("marina", {"p": 0.0}, "p"),
        ("marina", {"p": 1.5}, "p"),
        ("marina", {"gamma": 0.0}, "gamma"),
        ("diana", {"alpha": 0.0}, "alpha"),
        ("diana", {"alpha": 1.2}, "alpha"),
        ("diana", {"compressor": "zip"}, "compressor"),
        ("ef21", {"compressor": "zip"}, "compressor"),
        ("diana", {"compressor": "topk", "k": 2}, "compressor"),  # biased: EF21's
        ("adiana", {"compressor": "sign"}, "compressor"),
        ("adiana", {"p": 0.0}, "p"),
        ("adiana", {"theta_1": 0.5, "theta_2": 0.6}, "theta_1"),
        ("adiana", {"mu": -1.0}, "mu"),
        ("diana", {"compressor": "randk", "k": 3, "ratio": 0.5}, "k"),
        ("marina", {"compressor": "identity", "k": 3}, "k"),  # not the identity's setting
    ],
)
def test_bad_hyperparameters_name_the_key(name: str, hp: dict, key: str) -> None:
    with pytest.raises(AlgorithmError) as info:
        algorithms.create(name, **hp)
    assert str(info.value).startswith(f"algorithm.{key}: "), str(info.value)


@pytest.mark.parametrize("name", ["diana", "adiana", "marina", "ef21"])
def test_k_larger_than_the_adapter_is_refused_with_the_model(name: str) -> None:
    alg = algorithms.create(name, compressor="randk", k=11)
    with pytest.raises(ValueError, match=r"^algorithm\.k: 11 > d = 10"):
        alg.check_model({"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    alg.check_model({"a": torch.zeros(3, 4)})


def test_an_x_dependent_omega_needs_the_step_set() -> None:
    params = {"w": torch.zeros(50)}
    with pytest.raises(ValueError, match=r"^algorithm\.alpha: "):
        algorithms.create("diana", compressor="terngrad").check_model(params)
    algorithms.create("diana", compressor="terngrad", alpha=0.5).check_model(params)
    with pytest.raises(ValueError, match=r"^algorithm\.p: "):
        algorithms.create("marina", compressor="terngrad").check_model(params)
    with pytest.raises(ValueError, match=r"^algorithm\.compressor: "):
        algorithms.create("ef21", compressor="terngrad").check_model(params)


@pytest.mark.parametrize("name", ["marina", "adiana"])
def test_partial_participation_is_refused(name: str) -> None:
    alg = algorithms.create(name)
    with pytest.raises(ValueError, match=r"^federation\.clients_per_round: "):
        alg.check_federation(2, 5)
    alg.check_federation(5, 5)
    with pytest.raises(ConfigError, match=r"^federation\.clients_per_round: "):
        build_algorithm(validate(tiny_raw(f"algorithm.name={name}", "federation.fraction=0.5")))


@pytest.mark.parametrize("name", ["diana", "ef21"])
def test_partial_participation_needs_n(name: str) -> None:
    with pytest.raises(ValueError, match=r"^algorithm\.num_clients: .*num_clients = 5"):
        algorithms.create(name).check_federation(2, 5)
    algorithms.create(name, num_clients=5).check_federation(2, 5)
    with pytest.raises(ValueError, match=r"^algorithm\.num_clients: 4, but"):
        algorithms.create(name, num_clients=4).check_federation(2, 5)


def test_the_coins_are_the_servers_and_reproducible() -> None:
    draws = [server_coin(0, r, 0.3, 1) for r in range(2000)]
    assert draws == [server_coin(0, r, 0.3, 1) for r in range(2000)]
    assert 0.25 < np.mean(draws) < 0.35
    marina: Any = algorithms.create("marina", compressor="randk", ratio=0.3)
    state = marina.init({"w": torch.zeros(10)})
    assert marina.payload(state, 0)["marina.full"].item() == 1.0  # g⁰ = ∇f(x⁰)


# --- end to end ------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_glue
def test_diana_runs_end_to_end_and_sends_fewer_bytes(make_config, tmp_path: Path) -> None:
    from fedloom.experiment import Experiment
    from fedloom.runtime.rundir import RunDir
    from fedloom.server import simulate

    def bytes_up(*overrides: str) -> int:
        cfg = make_config(*overrides)
        run_dir = RunDir.create(tmp_path / "runs", cfg.name)
        summary = simulate(Experiment.build(cfg), run_dir)
        assert math.isfinite(summary["global"]["dev"]["loss"])
        rows = [json.loads(line) for line in run_dir.metrics_path.read_text().splitlines()]
        train = [r for r in rows if r["scope"] == "train"]
        assert len(train) == cfg.federation.rounds
        assert all(math.isfinite(r["train_loss"]) for r in train)
        return sum(r["bytes_up"] for r in train)

    compressed = bytes_up(
        "algorithm.name=diana", "algorithm.compressor=randk", "algorithm.ratio=0.1",
        "algorithm.gamma=0.5",
    )
    full = bytes_up("algorithm.name=fedavg")
    print(f"bytes up over 2 rounds: diana rand-10% {compressed}, fedavg {full}")
    assert compressed < 0.15 * full

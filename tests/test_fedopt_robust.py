"""FedAvgM, FedAdagrad/FedAdam/FedYogi, q-FedAvg, FedProx and the robust aggregators:
defaults, hyperparameter validation, hand-computed server steps, composability, and
FedProx's proximal term in real local training. (Agreement with Flower over several
rounds is in test_flower_agreement.py.)"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import fedloom.algorithms.base as base_mod
from fedloom import algorithms
from fedloom.algorithms import AlgorithmError, ClientContext, ClientResult, ServerState
from fedloom.algorithms import aggregators as agg
from fedloom.algorithms.aggregation_rule import MEAN, AggregationRule, with_rule
from fedloom.config import LoraConfig, ModelConfig, TrainConfig
from fedloom.data import Example, get_task
from fedloom.models.fedmodel import FedModel


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def results(
    *values: float, counts: tuple[int, ...] | None = None, loss: float = 1.0
) -> list[ClientResult]:
    counts = counts or (1,) * len(values)
    return [
        ClientResult(i, {"w": t(v)}, n, {"train_loss": loss})
        for i, (v, n) in enumerate(zip(values, counts))
    ]


# --- registry, defaults, validation --------------------------------------------------------

DEFAULTS: dict[str, dict[str, Any]] = {
    "fedavgm": {"server_learning_rate": 1.0, "server_momentum": 0.0, "rule": MEAN},
    "fedadagrad": {"eta": 0.1, "eta_l": None, "beta_1": 0.0, "tau": 1e-3, "variant": "flower"},
    "fedadam": {
        "eta": 0.1,
        "eta_l": None,
        "beta_1": 0.9,
        "beta_2": 0.99,
        "tau": 1e-3,
        "bias_correction": "flower",
        "variant": "flower",
    },
    "fedyogi": {
        "eta": 1e-2,
        "eta_l": None,
        "beta_1": 0.9,
        "beta_2": 0.99,
        "tau": 1e-3,
        "bias_correction": "none",
        "variant": "flower",
    },
    "fedprox": {"proximal_mu": 0.0, "rule": MEAN, "weighting": "examples"},
    # beta, f and m unset: Flower's 0.2, 0 and 1 (aggregators.DEFAULT_*)
    "median": {"rule": AggregationRule("median")},
    "trimmed_mean": {"rule": AggregationRule("trimmed_mean")},
    "krum": {"rule": AggregationRule("krum")},
    "multikrum": {"rule": AggregationRule("multikrum")},
}


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_defaults_are_flowers(name: str) -> None:
    alg = algorithms.create(name)
    assert alg.name == name
    for key, value in DEFAULTS[name].items():
        assert getattr(alg, key) == value, key
    assert alg.has_global and not alg.personalized


def test_qfedavg_defaults_and_required_client_learning_rate() -> None:
    alg = algorithms.create("qfedavg", client_learning_rate=0.05)
    assert alg.q == 0.1 and alg.client_learning_rate == 0.05
    with pytest.raises(AlgorithmError, match=r"^algorithm\.client_learning_rate: required"):
        algorithms.create("qfedavg")


@pytest.mark.parametrize(
    ("name", "hp", "key"),
    [
        ("fedavgm", {"server_momentum": 1.0}, "server_momentum"),
        ("fedavgm", {"server_momentum": -0.1}, "server_momentum"),
        ("fedavgm", {"server_learning_rate": 0.0}, "server_learning_rate"),
        ("fedadagrad", {"eta": 0.0}, "eta"),
        ("fedadagrad", {"tau": 0.0}, "tau"),
        ("fedadagrad", {"eta_l": -1.0}, "eta_l"),
        ("fedadagrad", {"variant": "tff"}, "variant"),
        ("fedadam", {"beta_1": 1.0}, "beta_1"),
        ("fedadam", {"beta_2": 1.0}, "beta_2"),
        ("fedadam", {"bias_correction": "yes"}, "bias_correction"),
        ("fedadam", {"variant": "paper", "bias_correction": "adam"}, "bias_correction"),
        ("fedyogi", {"beta_2": -0.5}, "beta_2"),
        ("fedyogi", {"bias_correction": "flower"}, "bias_correction"),
        ("qfedavg", {"client_learning_rate": 0.0}, "client_learning_rate"),
        ("qfedavg", {"client_learning_rate": 0.1, "q": -1.0}, "q"),
        ("fedprox", {"proximal_mu": -0.01}, "proximal_mu"),
        ("fedavg", {"aggregator": "median"}, "aggregator"),  # a rule is [aggregation]'s
        ("median", {"weighting": "uniform"}, "weighting"),  # median is unweighted
    ],
)
def test_bad_hyperparameter_names_the_key(name: str, hp: dict, key: str) -> None:
    with pytest.raises(AlgorithmError) as info:
        algorithms.create(name, **hp)
    assert str(info.value).startswith(f"algorithm.{key}: ")


@pytest.mark.parametrize(
    ("rule", "key"),
    [
        ({"name": "mode"}, "rule"),
        ({"name": "mean", "beta": 0.1}, "beta"),  # beta without trimmed_mean
        ({"name": "median", "num_malicious_nodes": 1}, "num_malicious_nodes"),
        ({"name": "krum", "num_nodes_to_select": 2}, "num_nodes_to_select"),  # krum selects one
        ({"name": "trimmed_mean", "beta": 0.5}, "beta"),
        ({"name": "trimmed_mean", "beta": -0.1}, "beta"),
        ({"name": "krum", "num_malicious_nodes": -1}, "num_malicious_nodes"),
        ({"name": "multikrum", "num_nodes_to_select": 0}, "num_nodes_to_select"),
    ],
)
def test_a_bad_aggregation_rule_names_the_key(rule: dict, key: str) -> None:
    with pytest.raises(ValueError, match=rf"^aggregation\.{key}: "):
        AggregationRule(**rule)


def test_a_rule_composes_only_with_an_algorithm_that_averages() -> None:
    median = AggregationRule("median")
    assert with_rule(algorithms.create("fedadam"), median).rule == median
    assert with_rule(algorithms.create("fedmosaic"), MEAN).name == "fedmosaic"
    with pytest.raises(ValueError, match=r"^aggregation\.rule: fedmosaic does not average"):
        with_rule(algorithms.create("fedmosaic"), median)
    with pytest.raises(ValueError, match=r"^aggregation\.rule: fednova normalizes"):
        with_rule(algorithms.create("fednova"), median)
    with pytest.raises(ValueError, match=r"^algorithm\.weighting: aggregation rule median"):
        with_rule(algorithms.create("fedavg", weighting="uniform"), median)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("fedadagrad", "beta_2"),
        ("fedavgm", "eta"),
        ("fedprox", "mu"),
        ("qfedavg", "aggregator"),
        ("fedavg", "rule"),  # set by [aggregation], not [algorithm]
        ("fedyogi", "server_momentum"),
        ("median", "proximal_mu"),
    ],
)
def test_hyperparameters_of_other_algorithms_are_unknown(name: str, key: str) -> None:
    with pytest.raises(
        AlgorithmError, match=rf"^algorithm\.{key}: unknown hyperparameter for {name}"
    ):
        algorithms.create(name, **{key: 0.5})


# --- aggregation rules, hand-computed ------------------------------------------------------


def matrix(*rows: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_median_odd_and_even() -> None:
    x = matrix((1, 10), (5, -2), (3, 4))
    assert agg.median(x).tolist() == [3, 4]
    x = matrix((1, 10), (5, -2), (3, 4), (100, 0))
    assert agg.median(x).tolist() == [(3 + 5) / 2, (0 + 4) / 2]  # mean of the middle two


def test_trimmed_mean_cuts_floor_beta_k_at_each_end() -> None:
    x = matrix((1,), (2,), (3,), (4,), (100,))
    assert agg.trimmed_mean(x, 0.2).tolist() == [3.0]  # cut 1 each end: (2 + 3 + 4) / 3
    assert agg.trimmed_mean(x, 0.19).tolist() == [22.0]  # floor(0.95) = 0: plain mean
    assert agg.trimmed_mean(x, 0.4).tolist() == [3.0]  # cut 2 each end: the median
    with pytest.raises(ValueError):
        agg.trimmed_mean(x, 0.5)


def test_krum_picks_the_client_closest_to_its_neighbours() -> None:
    # four honest clients near (0, 0), one attacker far away
    x = matrix((0.0, 0.1), (0.1, 0.0), (0.0, -0.1), (-0.2, 0.0), (50.0, 50.0))
    w = torch.ones(5, dtype=torch.float64)
    scores = agg.krum_scores(x, num_malicious_nodes=1)  # n_c = 5 - 1 - 2 = 2 neighbours
    # client 0: squared distances to 1, 2, 3 are 0.02, 0.04, 0.05 -> 0.02 + 0.04
    # client 1: squared distances to 0, 2, 3 are 0.02, 0.02, 0.09 -> 0.04, the lowest
    assert math.isclose(float(scores[0]), 0.06)
    assert math.isclose(float(scores[1]), 0.04)
    assert float(scores[4]) > 1000
    assert agg.combine("krum", x, w, num_malicious_nodes=1).tolist() == x[1].tolist()


def test_multikrum_averages_the_selected_by_weight() -> None:
    x = matrix((0.0, 0.1), (0.1, 0.0), (0.0, -0.1), (-0.2, 0.0), (50.0, 50.0))
    w = torch.tensor([1.0, 3.0, 1.0, 1.0, 100.0], dtype=torch.float64)
    out = agg.combine("multikrum", x, w, num_malicious_nodes=1, num_nodes_to_select=3)
    # the three lowest scores are clients 0, 1, 2 (client 3 is farther out), weights 1, 3, 1
    expected = (1 * x[0] + 3 * x[1] + 1 * x[2]) / 5
    assert torch.allclose(out, expected)
    assert out.abs().max() < 1  # the attacker never enters


def test_robust_algorithms_ignore_an_outlier_that_moves_fedavg() -> None:
    rs = results(1.0, 2.0, 3.0, 1000.0, counts=(1, 1, 1, 1))
    state = ServerState(0, {"w": t(0.0)})
    assert algorithms.create("fedavg").aggregate(state, rs).global_params["w"].item() > 200
    assert algorithms.create("median").aggregate(state, rs).global_params["w"].item() == 2.5
    assert (
        with_rule(algorithms.create("trimmed_mean"), AggregationRule("trimmed_mean", beta=0.25))
        .aggregate(state, rs).global_params["w"].item()
        == 2.5
    )
    # Krum with f = 0: two neighbours each; scores 1 + 4, 1 + 1, 1 + 4, huge
    assert algorithms.create("krum").aggregate(state, rs).global_params["w"].item() == 2.0


# --- server optimizers, hand-computed ------------------------------------------------------


def test_fedavgm_two_rounds_by_hand() -> None:
    alg = algorithms.create("fedavgm", server_learning_rate=0.5, server_momentum=0.9)
    s0 = alg.init({"w": t(1.0)})
    s1 = alg.aggregate(s0, results(2.0, 4.0, counts=(1, 3)))  # mean 3.5
    # g = 1 - 3.5 = -2.5, u = -2.5, x = 1 + 0.5 * 2.5
    assert math.isclose(s1.global_params["w"].item(), 2.25)
    assert math.isclose(s1.extra["momentum"]["w"].item(), -2.5)
    s2 = alg.aggregate(s1, results(2.25, counts=(5,)))  # g = 0: momentum alone moves
    # u = 0.9 * -2.5 + 0 = -2.25, x = 2.25 + 0.5 * 2.25
    assert math.isclose(s2.global_params["w"].item(), 3.375)
    assert s2.round == 2


def test_fedavgm_defaults_are_fedavg() -> None:
    rs = results(2.0, 4.0, 7.0, counts=(1, 3, 2))
    state = ServerState(0, {"w": t(1.0)})
    a = algorithms.create("fedavgm").aggregate(state, rs).global_params["w"]
    b = algorithms.create("fedavg").aggregate(state, rs).global_params["w"]
    assert torch.allclose(a, b)


def test_fedadagrad_one_step_by_hand() -> None:
    alg = algorithms.create("fedadagrad")
    s1 = alg.aggregate(alg.init({"w": t(1.0)}), results(2.0, 4.0, counts=(1, 1)))  # Δ = 2
    assert math.isclose(s1.global_params["w"].item(), 1 + 0.1 * 2 / (2 + 1e-3), rel_tol=1e-6)
    assert math.isclose(s1.extra["v"]["w"].item(), 4.0)
    s2 = alg.aggregate(s1, results(s1.global_params["w"].item() - 1.0))  # Δ = -1
    x1 = s1.global_params["w"].item()
    assert math.isclose(
        s2.global_params["w"].item(), x1 - 0.1 / (math.sqrt(5) + 1e-3), rel_tol=1e-6
    )


@pytest.mark.parametrize(
    ("hp", "t_exp"),
    [({}, 2), ({"bias_correction": "adam"}, 1), ({"bias_correction": "none"}, None)],
)
def test_fedadam_with_median_one_step_by_hand(hp: dict, t_exp: int | None) -> None:
    """FedAdam composes with a robust rule: Δ = median - x."""
    alg = with_rule(algorithms.create("fedadam", **hp), AggregationRule("median"))
    s1 = alg.aggregate(alg.init({"w": t(0.0)}), results(1.0, 2.0, 100.0))
    m, v = 0.1 * 2.0, 0.01 * 4.0
    eta = 0.1 if t_exp is None else 0.1 * math.sqrt(1 - 0.99**t_exp) / (1 - 0.9**t_exp)
    assert math.isclose(s1.global_params["w"].item(), eta * m / (math.sqrt(v) + 1e-3), rel_tol=1e-6)
    assert math.isclose(s1.extra["m"]["w"].item(), m, rel_tol=1e-6)


def test_fedyogi_first_step_and_paper_variant() -> None:
    rs = results(3.0)  # Δ = 3 from x = 0
    flower = algorithms.create("fedyogi").aggregate(ServerState(0, {"w": t(0.0)}), rs)
    # v = 0 - 0.01 * 9 * sign(0 - 9) = 0.09; m = 0.3
    assert math.isclose(flower.global_params["w"].item(), 0.01 * 0.3 / (0.3 + 1e-3), rel_tol=1e-6)
    paper = algorithms.create("fedyogi", variant="paper", tau=0.5).aggregate(
        ServerState(0, {"w": t(0.0)}), rs
    )
    # v_{-1} = 0.25: v = 0.25 - 0.01 * 9 * sign(0.25 - 9) = 0.34
    assert math.isclose(paper.extra["v"]["w"].item(), 0.34, rel_tol=1e-6)
    assert math.isclose(
        paper.global_params["w"].item(), 0.01 * 0.3 / (math.sqrt(0.34) + 0.5), rel_tol=1e-6
    )


def test_server_optimizers_are_pure_and_keep_other_state() -> None:
    for name in ("fedavgm", "fedadagrad", "fedadam", "fedyogi"):
        alg = algorithms.create(name, **({"server_momentum": 0.5} if name == "fedavgm" else {}))
        state = ServerState(3, {"w": t(1.0, 2.0)}, extra={"other": 1})
        rs = [ClientResult(0, {"w": t(2.0, 0.0)}, 4), ClientResult(1, {"w": t(0.0, 5.0)}, 2)]
        a, b = alg.aggregate(state, rs), alg.aggregate(state, rs)
        assert torch.equal(a.global_params["w"], b.global_params["w"])
        assert a.extra["other"] == 1 and a.round == 4
        assert state.extra == {"other": 1} and state.global_params["w"].tolist() == [1.0, 2.0]
        assert all(
            v.dtype == torch.float32
            for p in a.extra.values()
            if isinstance(p, dict)
            for v in p.values()
        )


def test_qfedavg_with_q_zero_is_the_uniform_mean() -> None:
    alg = algorithms.create("qfedavg", client_learning_rate=0.1, q=0.0)
    rs = [
        ClientResult(i, {"w": t(v, -v)}, n, {"train_loss": loss})
        for i, (v, n, loss) in enumerate([(1.0, 10, 0.5), (4.0, 1, 2.0), (7.0, 5, 0.1)])
    ]
    new = alg.aggregate(ServerState(0, {"w": t(0.0, 0.0)}), rs)
    assert torch.allclose(new.global_params["w"], t(4.0, -4.0))


def test_qfedavg_by_hand_and_fairness() -> None:
    lr, q = 0.5, 1.0
    L = 1 / lr
    alg = algorithms.create("qfedavg", client_learning_rate=lr, q=q)
    rs = [
        ClientResult(0, {"w": t(1.0)}, 1, {"train_loss": 0.1}),
        ClientResult(1, {"w": t(-1.0)}, 1, {"train_loss": 3.0}),
    ]
    new = alg.aggregate(ServerState(0, {"w": t(0.0)}), rs)
    d = [L * (0 - 1.0), L * (0 + 1.0)]
    losses = [0.1 + 1e-10, 3.0 + 1e-10]
    num = sum(f**q * dk for f, dk in zip(losses, d))
    den = sum(q * f ** (q - 1) * dk**2 + L * f**q for f, dk in zip(losses, d))
    assert math.isclose(new.global_params["w"].item(), -num / den, rel_tol=1e-6)
    assert new.global_params["w"].item() < 0  # pulled towards the client with the high loss


def test_qfedavg_needs_the_train_loss() -> None:
    alg = algorithms.create("qfedavg", client_learning_rate=0.1)
    with pytest.raises(ValueError, match="train_loss"):
        alg.aggregate(ServerState(0, {"w": t(0.0)}), [ClientResult(0, {"w": t(1.0)}, 1)])


# --- client side: eta_l and FedProx's proximal term ---------------------------------------


def test_eta_l_overrides_the_local_learning_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []

    def fake_train(ctx: ClientContext, extra_loss: Any = None) -> dict[str, float]:
        seen.append(ctx.settings.lr)
        ctx.state["touched"] = True
        return {"train_loss": 0.0, "local_steps": 1.0}

    class Model:
        def set_params(self, p: Any) -> None: ...
        def get_params(self) -> dict:
            return {"w": t(0.0)}

    monkeypatch.setattr(base_mod, "train_locally", fake_train)
    state: dict = {}
    ctx = ClientContext(0, Model(), [1, 2], TrainConfig(lr=1e-3, local_steps=1), 0, 1, state, 0)  # type: ignore[arg-type]
    algorithms.create("fedadam", eta_l=0.02).local_train(ctx, {"w": t(0.0)})
    algorithms.create("fedadam").local_train(ctx, {"w": t(0.0)})
    assert seen == [0.02, 1e-3]
    assert state == {"touched": True}  # the client's local state still persists
    assert ctx.settings.lr == 1e-3


def _tiny_bert_without_dropout() -> FedModel:
    cfg = ModelConfig(backbone="tiny-bert", head_dropout=0.0, lora=LoraConfig(r=4, dropout=0.0),
                      precision="fp32")
    model = FedModel.build(cfg, get_task("SST-2"), max_length=32, seed=0)
    for module in model.head.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # BERT's own hidden/attention dropout too: exact comparisons
    return model


TEXTS = [
    ("good great wonderful", 1),
    ("bad awful terrible", 0),
    ("a truly great film", 1),
    ("a truly awful film", 0),
    ("wonderful and good", 1),
    ("terrible and bad", 0),
]


def _prox_run(mu: float, steps: int) -> tuple[dict, dict, float]:
    model = _tiny_bert_without_dropout()
    start = model.get_params()
    features = model.encode([Example(text, None, label) for text, label in TEXTS * 2])
    settings = TrainConfig(
        local_steps=steps,
        batch_size=12,
        lr=0.5,
        optimizer="sgd",
        momentum=0.0,
        weight_decay=0.0,
        clip_norm=0.0,
        schedule="constant",
        warmup_ratio=0.0,
    )
    ctx = ClientContext(0, model, features, settings, 0, 1, {}, 123)
    res = algorithms.create("fedprox", proximal_mu=mu).local_train(ctx, start)
    return start, res.params, res.metrics["train_loss"]


def _distance(a: dict, b: dict) -> float:
    return math.sqrt(sum(float((a[n] - b[n]).square().sum()) for n in a))


def test_fedprox_first_step_equals_fedavg_the_pull_comes_after() -> None:
    # the proximal gradient mu (w - w_t) is zero at w_t: one SGD step is FedAvg's step
    start, one_plain, _ = _prox_run(0.0, 1)
    _, one_prox, _ = _prox_run(10.0, 1)
    assert all(torch.allclose(one_plain[n], one_prox[n], atol=1e-6) for n in start)
    assert _distance(one_plain, start) > 0


def test_fedprox_pulls_the_adapter_towards_the_global_one() -> None:
    distances = []
    for mu in (0.0, 0.5, 1.5):
        start, trained, loss = _prox_run(mu, 6)
        assert math.isfinite(loss)
        distances.append(_distance(trained, start))
    assert distances[0] > distances[1] > distances[2] > 0, distances

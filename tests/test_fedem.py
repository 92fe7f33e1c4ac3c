"""FedEM: the E-step against a closed-form mixture, the weighted M-step, the mixture
predictor against a single adapter, and a run's output (mixture rows, checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_glue

from fedloom import algorithms
from fedloom.algorithms import ServerState
from fedloom.algorithms.fedem import MIXTURES, SEEDED, responsibilities
from fedloom.config import ConfigError
from fedloom.evaluation.score import evaluate
from fedloom.experiment import Experiment
from fedloom.runtime.clients import client_context
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate
from fedloom.train.local import train_locally
from fedloom.train.mixture import evaluate_mixture, pack_mixture


def test_e_step_recovers_the_mixture_weights() -> None:
    """70 examples only component 0 explains (log-likelihood 0 against −8) and 30 only
    component 1: EM from uniform weights converges to π = (0.7, 0.3), and each example's
    responsibility to the component that explains it."""
    ll = np.zeros((2, 100))
    ll[1, :70] = -8.0
    ll[0, 70:] = -8.0
    weights = np.array([0.5, 0.5])
    for _ in range(20):
        q, weights = responsibilities(ll, weights)
    np.testing.assert_allclose(weights, [0.7, 0.3], atol=1e-3)
    assert (q[0, :70] > 0.99).all() and (q[1, 70:] > 0.99).all()
    np.testing.assert_allclose(q.sum(axis=0), 1.0)


def test_e_step_with_a_zero_weight_keeps_it_at_zero() -> None:
    q, weights = responsibilities(np.zeros((2, 5)), np.array([1.0, 0.0]))
    np.testing.assert_array_equal(weights, [1.0, 0.0])
    assert np.isfinite(q).all()


@needs_glue
def test_weighted_training_ones_is_plain_training_and_zeros_do_not_move(make_config) -> None:
    exp = Experiment.build(make_config("train.weight_decay=0.0"))
    client = exp.clients[0]
    start = exp.model.get_params()
    results = []
    for weights in (None, np.ones(len(client.train)), np.zeros(len(client.train))):
        exp.model.set_params(start)
        train_locally(client_context(exp, client, 0, {}), example_weights=weights)
        results.append(exp.model.get_params())
    plain, ones, zeros = results
    assert all(torch.allclose(plain[n], ones[n], atol=1e-6) for n in start)
    assert any(not torch.equal(plain[n], start[n]) for n in start)
    assert all(torch.equal(zeros[n], start[n]) for n in start)
    with pytest.raises(ValueError, match="2 example weights"):
        train_locally(client_context(exp, client, 0, {}), example_weights=[1.0, 1.0])


@needs_glue
def test_a_one_hot_mixture_scores_as_its_component(make_config) -> None:
    exp = Experiment.build(make_config())
    first = exp.model.get_params()
    second = {n: t + 0.05 * torch.randn_like(t) for n, t in first.items()}
    features = exp.clients[0].test + exp.clients[1].test
    for weights, single in (([1.0, 0.0], first), ([0.0, 1.0], second)):
        mixed = evaluate_mixture(exp.model, pack_mixture([first, second], weights), features, 8)
        alone = evaluate(exp.model, single, features, 8)
        assert mixed["accuracy"] == alone["accuracy"] and mixed["n"] == alone["n"]
        assert mixed["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    half = evaluate_mixture(exp.model, pack_mixture([first, second], [0.5, 0.5]), features, 8)
    assert np.isfinite(half["loss"])


@needs_glue
def test_fedem_run_logs_mixtures_and_saves_components(make_config, tmp_path: Path) -> None:
    cfg = make_config("algorithm.name=fedem", "algorithm.num_components=2",
                      "federation.rounds=2")
    exp = Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    mixtures = [r for r in rows if r["scope"] == "mixture"]
    assert [r["round"] for r in mixtures] == [1, 2]
    for r in mixtures:
        assert set(r["weights"]) == {"0", "1", "2"}
        assert all(sum(pi) == pytest.approx(1.0, abs=1e-5) and len(pi) == 2
                   for pi in r["weights"].values())
    clusters = [r for r in rows if r["scope"] == "clusters"]
    assert summary["clusters"] == clusters[-1]["assignment"]
    assert set(summary["clusters"]) == {"0", "1", "2"}
    assert set(summary["clusters"].values()) <= {0, 1}
    # round 1 trains one copy from the common start (π still uniform); the server then
    # seeds the components from the updates, and round 2's E-step moves every π
    assert all(pi == [0.5, 0.5] for pi in mixtures[0]["weights"].values())
    assert all(pi != [0.5, 0.5] for pi in mixtures[1]["weights"].values())
    components = sorted((run.checkpoints / "clusters").glob("cluster_*.safetensors"))
    assert len(components) == 2
    first, second = (load_params(path) for path in components)
    assert set(first) == set(exp.model.param_names)
    assert any(not torch.equal(first[n], second[n]) for n in first)


def test_the_assignment_is_each_clients_dominant_component() -> None:
    alg = algorithms.create("fedem", num_components=3)
    mixtures = {0: [0.2, 0.5, 0.3], 3: [0.6, 0.1, 0.3], 7: [0.1, 0.2, 0.7],
                9: [0.4, 0.4, 0.2]}  # a tie goes to the lower component
    state = ServerState(2, {}, {MIXTURES: mixtures, SEEDED: True})
    assert alg.assignment(state) == {0: 1, 3: 0, 7: 2, 9: 0}


@needs_glue
def test_one_component_scores_as_fedavg(make_config, tmp_path: Path) -> None:
    """With M = 1 the mixture is one adapter trained on every example at weight 1: FedEM
    is FedAvg, and each client's personal scores are FedAvg's global scores on it."""
    scores = {}
    for name, hp in (("fedem", ["algorithm.num_components=1"]), ("fedavg", [])):
        cfg = make_config(f"algorithm.name={name}", *hp)
        summary = simulate(Experiment.build(cfg), RunDir.create(tmp_path / name, cfg.name))
        scores[name] = summary["personal" if name == "fedem" else "global"]["clients"]
    for metric in ("accuracy", "f1"):  # the same predictions: equal, not close
        assert scores["fedem"][metric] == scores["fedavg"][metric]


@needs_glue
def test_fedem_refuses_a_regression_task(make_config) -> None:
    with pytest.raises(ConfigError, match="algorithm.name: fedem needs class labels"):
        Experiment.build(make_config("algorithm.name=fedem", "data.task=STS-B"))


@pytest.mark.parametrize(("key", "value"), [("num_components", 0), ("estep_iterations", 0),
                                            ("weighting", "capped"), ("initialization", "kmeans")])
def test_fedem_refuses_bad_hyperparameters(key: str, value) -> None:
    with pytest.raises(ValueError, match=f"algorithm.{key}"):
        algorithms.create("fedem", **{key: value})

"""FedU against the closed-form fixed point of two quadratic clients, its graphs, and its
checks of λ and of the adjacency matrix."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import tiny_config
from quadratic import Quadratic, context

from fedloom import algorithms
from fedloom.config import ConfigError
from fedloom.experiment import build_algorithm

A, B = np.array([1.0, 0.0]), np.array([-1.0, 2.0])
#: rounds of every run below: each one's adapters stop moving (a fixed point of the fp32
#: server step, bit for bit the adapters after 200 or 300 rounds) by round 60
ROUNDS = 80


def run(optima: list[np.ndarray], rounds: int, lr: float = 0.1, steps: int = 3, **hp):
    alg = algorithms.create("fedu", **hp)
    models = [Quadratic(np.eye(2), w) for w in optima]
    state = alg.init({"w": torch.zeros(2, dtype=torch.float64)})
    for r in range(rounds):
        results = [alg.local_train(context(m, k, 1, lr, steps, r, rounds, {}),
                                   alg.payload(state, k)) for k, m in enumerate(models)]
        state = alg.aggregate(state, results)
    return [alg.payload(state, k)["w"].numpy() for k in range(len(models))], state


@pytest.mark.parametrize("lam", [0.0, 0.1, 0.25, 0.5])
def test_two_clients_reach_the_closed_form_fixed_point(lam: float) -> None:
    """E SGD steps map x to w* + a(x − w*), a = (1 − η)^E; the Laplacian step keeps the sum
    and shrinks the difference: d = (1 − 2λ)(1 − a)(a* − b*) / (1 − (1 − 2λ) a), the two
    adapters at (a* + b*)/2 ± d/2. λ = 0 is local training, λ = ½ full consensus."""
    (x1, x2), _ = run([A, B], ROUNDS, lam=lam, graph="full")
    a = (1 - 0.1) ** 3
    d = (1 - 2 * lam) * (1 - a) * (A - B) / (1 - (1 - 2 * lam) * a)
    # 1e-6: the server step runs on fp32-flattened adapters (params.stack)
    np.testing.assert_allclose(x1, (A + B) / 2 + d / 2, atol=1e-6)
    np.testing.assert_allclose(x2, (A + B) / 2 - d / 2, atol=1e-6)


def test_adapters_contract_towards_their_neighbours_as_lambda_grows() -> None:
    """The distance between the two clients' adapters at the fixed point falls strictly
    with λ, from the optima's distance (λ = 0) to 0 (λ = ½)."""
    gaps = [np.linalg.norm(np.subtract(*run([A, B], ROUNDS, lam=lam, graph="full")[0]))
            for lam in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)]
    assert all(a > b for a, b in itertools.pairwise(gaps))
    assert gaps[0] == pytest.approx(np.linalg.norm(A - B), abs=1e-5) and gaps[-1] < 1e-6


def test_default_lambda_moves_the_best_connected_client_half_way() -> None:
    (x1, x2), state = run([A, B], ROUNDS, graph="full")
    assert state.extra["lam"] == 0.5  # one neighbour each: λ = 1 / (2 · 1)
    np.testing.assert_allclose(x1, x2, atol=1e-6)


def test_default_graph_is_the_update_similarity() -> None:
    """Unset, the graph is the similarity graph: clients whose updates point apart (A and
    B = (−1, 2) from 0: cosine −1/√5) share no edge and train locally, where the full
    graph would have averaged them."""
    (x1, x2), state = run([A, B], ROUNDS)
    assert state.extra["lam"] == 0.0
    np.testing.assert_allclose(x1, A, atol=1e-6)
    np.testing.assert_allclose(x2, B, atol=1e-6)


def test_adjacency_without_an_edge_is_local_training_and_similarity_graph_cuts_opposites() -> None:
    """No edge: each client converges to its own optimum. Opposite clients (cosine −1)
    have no edge in the similarity graph: local training too."""
    (x1, x2), _ = run([A, B], ROUNDS, adjacency=[[0.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(x1, A, atol=1e-6)
    np.testing.assert_allclose(x2, B, atol=1e-6)
    (y1, y2), _ = run([A, -A], ROUNDS, graph="similarity")
    np.testing.assert_allclose(y1, A, atol=1e-6)
    np.testing.assert_allclose(y2, -A, atol=1e-6)


def test_three_clients_on_a_path_graph() -> None:
    """Path 0 - 1 - 2: the ends never pull on each other directly; the middle client ends
    between them and every adapter stays within the optima's hull."""
    optima = [np.array([2.0, 0.0]), np.array([0.0, 0.0]), np.array([-2.0, 0.0])]
    path = [[0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    (x0, x1, x2), _ = run(optima, ROUNDS, adjacency=path, lam=0.25)
    np.testing.assert_allclose(x1, [0.0, 0.0], atol=1e-6)  # symmetric
    assert 0 < x0[0] < 2 and -2 < x2[0] < 0
    np.testing.assert_allclose(x0, -x2, atol=1e-6)


@pytest.mark.parametrize(
    ("hp", "message"),
    [({"lam": -1.0}, "algorithm.lam"), ({"graph": "knn"}, "algorithm.graph"),
     ({"adjacency": [[0.0, 1.0]]}, "algorithm.adjacency: must be a square"),
     ({"adjacency": [[0.0, 1.0], [0.0, 0.0]]}, "algorithm.adjacency: must be symmetric"),
     ({"adjacency": [[0.0, 1.0], [1.0, 0.0]], "graph": "similarity"}, "algorithm.adjacency"),
     ({"adjacency": [[0.0, 1.0], [1.0, 0.0]], "graph": "full"}, "algorithm.adjacency")],
)
def test_fedu_refuses_bad_hyperparameters(hp: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        algorithms.create("fedu", **hp)


def test_fedu_checks_lambda_and_the_graph_against_the_federation() -> None:
    with pytest.raises(ConfigError, match="algorithm.lam: 0.6 x the largest degree 2"):
        build_algorithm(tiny_config("algorithm.name=fedu", "algorithm.lam=0.6"))
    with pytest.raises(ConfigError, match="algorithm.adjacency: is 2 x 2, the federation has 3"):
        build_algorithm(tiny_config("algorithm.name=fedu",
                                    "algorithm.adjacency=[[0.0, 1.0], [1.0, 0.0]]"))
    build_algorithm(tiny_config("algorithm.name=fedu", "algorithm.lam=0.5"))

"""Params arithmetic, FedAvg's weightings, the algorithm registry, Local and Centralized."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedloom import algorithms
from fedloom import params as params_module
from fedloom.algorithms import AlgorithmError, ClientContext, ClientResult, ServerState
from fedloom.algorithms.centralized import Centralized
from fedloom.algorithms.fedavg import FedAvg, aggregation_weights
from fedloom.algorithms.local import Local
from fedloom.params import (
    flatten,
    num_bytes,
    num_values,
    stack,
    unflatten,
    weighted_average,
    weighted_mean_flat,
)


def t(*values: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# --- params helpers -----------------------------------------------------------------------


def test_flatten_unflatten_round_trip() -> None:
    params = {"b": torch.arange(6.0).view(2, 3), "a": t(7.0, 8.0).to(torch.float16)}
    names = ["b", "a"]
    vector = flatten(params, names)
    assert vector.dtype == torch.float32
    assert vector.tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    back = unflatten(vector, params, names)
    assert back.keys() == params.keys()
    for n in names:
        assert back[n].shape == params[n].shape and back[n].dtype == params[n].dtype
        assert torch.equal(back[n], params[n])


def test_unflatten_rejects_a_vector_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="vector has 3 values, params need 2"):
        unflatten(torch.zeros(3), {"a": torch.zeros(2)}, ["a"])


def test_stack_is_clients_by_values() -> None:
    clients = [{"x": t(1, 2), "y": t(3)}, {"x": t(4, 5), "y": t(6)}]
    assert stack(clients, ["x", "y"]).tolist() == [[1, 2, 3], [4, 5, 6]]


def test_num_values_and_bytes() -> None:
    params = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.float16)}
    assert num_values(params) == 10
    assert num_bytes(params) == 6 * 4 + 4 * 2


# --- weighted_average ---------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 17])
def test_streamed_mean_equals_the_matrix_product(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block-by-block mean equals (w / Σw) @ stack(...).double() within the rounding
    bound of float32 recursive summation, |error| <= K u Σ_k |p_k θ_k| (u = 2^-24, one more
    u for each product), for tensors smaller than, equal to and spanning several blocks,
    fp32 and bf16, and a float64 tensor among float32 ones (a block of its own dtype)."""
    block = 64
    monkeypatch.setattr(params_module, "MEAN_BLOCK", block)
    generator = torch.Generator().manual_seed(k)
    shapes = {"a": (3,), "b": (block,), "c": (2, block + 5), "d": (0,), "e": (7,), "f": (9,)}
    clients = [{n: torch.randn(s, generator=generator) for n, s in shapes.items()}
               for _ in range(k)]
    clients[0]["a"] = clients[0]["a"].bfloat16()
    clients[-1]["e"] = clients[-1]["e"].double()
    weights = torch.rand(k, generator=generator, dtype=torch.float64) + 0.1
    names = sorted(shapes)
    matrix, p = stack(clients, names).double(), weights / weights.sum()
    expected = p @ matrix
    streamed = weighted_mean_flat(clients, names, weights)
    assert streamed.dtype == torch.float64 and streamed.shape == expected.shape
    bound = (k + 1) * 2.0**-24 * (p @ matrix.abs())
    assert ((streamed - expected).abs() <= bound).all()
    assert k == 1 or not torch.equal(streamed, expected)  # float32 sums, not float64 ones


def test_float64_clients_are_averaged_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(params_module, "MEAN_BLOCK", 16)
    generator = torch.Generator().manual_seed(2)
    clients = [{"w": torch.randn(40, generator=generator, dtype=torch.float64)}
               for _ in range(5)]
    weights = torch.rand(5, generator=generator, dtype=torch.float64) + 0.1
    expected = (weights / weights.sum()) @ torch.stack([c["w"] for c in clients])
    streamed = weighted_mean_flat(clients, ["w"], weights)
    assert torch.allclose(streamed, expected, rtol=1e-14, atol=1e-15)


def test_weighted_average_hand_computed() -> None:
    out = weighted_average([{"w": t(1, 2)}, {"w": t(3, 6)}], [1, 3])
    # (1 * [1, 2] + 3 * [3, 6]) / 4
    assert torch.allclose(out["w"], t(2.5, 5.0))


def test_weighted_average_several_tensors_and_clients() -> None:
    clients = [
        {"a": torch.full((2, 2), 1.0), "b": t(0.0)},
        {"a": torch.full((2, 2), 2.0), "b": t(10.0)},
        {"a": torch.full((2, 2), 4.0), "b": t(20.0)},
    ]
    out = weighted_average(clients, [2.0, 1.0, 1.0])
    assert torch.allclose(out["a"], torch.full((2, 2), (2 * 1 + 2 + 4) / 4))
    assert torch.allclose(out["b"], t((0 + 10 + 20) / 4))


def test_weighted_average_preserves_shape_and_dtype() -> None:
    clients = [
        {"m": torch.ones(2, 3, dtype=torch.bfloat16), "v": t(1, 3, dtype=torch.float16)},
        {"m": torch.full((2, 3), 3.0, dtype=torch.bfloat16), "v": t(3, 5, dtype=torch.float16)},
    ]
    out = weighted_average(clients, [1, 1])
    assert out["m"].shape == (2, 3) and out["m"].dtype == torch.bfloat16
    assert out["v"].shape == (2,) and out["v"].dtype == torch.float16
    assert torch.equal(out["m"], torch.full((2, 3), 2.0, dtype=torch.bfloat16))
    assert torch.equal(out["v"], t(2, 4, dtype=torch.float16))


def test_weighted_average_does_not_alias_inputs() -> None:
    a = {"w": t(1, 2)}
    out = weighted_average([a], [1])
    out["w"] += 100
    assert a["w"].tolist() == [1, 2]


def test_weighted_average_only_depends_on_weight_ratios() -> None:
    clients = [{"w": t(1, 2)}, {"w": t(3, 6)}]
    assert torch.allclose(
        weighted_average(clients, [1, 3])["w"], weighted_average(clients, [10, 30])["w"]
    )


def test_a_zero_weight_excludes_that_client() -> None:
    out = weighted_average([{"w": t(1, 2)}, {"w": t(3, 6)}], [0, 5])
    assert torch.allclose(out["w"], t(3, 6))


@pytest.mark.parametrize("weights", [[0, 0], [1, -1], [-1, -2], [2, -1]])
def test_weighted_average_rejects_bad_weights(weights: list[float]) -> None:
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        weighted_average([{"w": t(1.0)}, {"w": t(2.0)}], weights)


def test_weighted_average_of_nothing() -> None:
    with pytest.raises(ValueError, match="no clients"):
        weighted_average([], [])


# --- aggregation_weights ------------------------------------------------------------------


def test_weights_examples_and_uniform() -> None:
    assert aggregation_weights([10, 20, 100], "examples") == [10.0, 20.0, 100.0]
    assert aggregation_weights([10, 20, 100], "uniform") == [1.0, 1.0, 1.0]


def test_weights_capped_at_the_median() -> None:
    # median of (10, 20, 100) is 20
    assert aggregation_weights([10, 20, 100], "capped") == [10.0, 20.0, 20.0]
    # median of (10, 20, 30, 100) is 25
    assert aggregation_weights([100, 10, 30, 20], "capped") == [25.0, 10.0, 25.0, 20.0]


def test_weights_capped_at_an_explicit_cap() -> None:
    assert aggregation_weights([10, 20, 100], "capped", cap=15) == [10.0, 15.0, 15.0]
    assert aggregation_weights([10, 20, 100], "capped", cap=1000) == [10.0, 20.0, 100.0]


# --- FedAvg.aggregate ---------------------------------------------------------------------


def results() -> list[ClientResult]:
    return [
        ClientResult(0, {"w": t(1, 2), "b": t(0)}, num_examples=10),
        ClientResult(3, {"w": t(3, 6), "b": t(4)}, num_examples=30),
        ClientResult(5, {"w": t(5, 10), "b": t(8)}, num_examples=100),
    ]


@pytest.mark.parametrize(
    ("hp", "weights"),
    [
        ({}, [10, 30, 100]),
        ({"weighting": "examples"}, [10, 30, 100]),
        ({"weighting": "uniform"}, [1, 1, 1]),
        ({"weighting": "capped"}, [10, 30, 30]),  # median 30
        ({"weighting": "capped", "cap": 20.0}, [10, 20, 20]),
    ],
)
def test_fedavg_aggregate_hand_computed(hp: dict, weights: list[int]) -> None:
    alg = algorithms.create("fedavg", **hp)
    start = {"w": t(0, 0), "b": t(0)}
    state = alg.init(start)
    assert state.round == 0 and state.global_params is start
    new = alg.aggregate(state, results())
    total = sum(weights)
    # w_k = (1, 2) * (1, 3, 5) and b_k = (0, 4, 8)
    w_mean = sum(wk * m for wk, m in zip(weights, (1, 3, 5))) / total
    b_mean = sum(wk * b for wk, b in zip(weights, (0, 4, 8))) / total
    assert torch.allclose(new.global_params["w"], t(w_mean, 2 * w_mean))
    assert torch.allclose(new.global_params["b"], t(b_mean))
    assert new.round == 1
    assert alg.payload(new, 3) is new.global_params


def test_fedavg_hand_computed_numbers() -> None:
    new = FedAvg().aggregate(ServerState(4, {}), results()[:2])
    # examples: (10 * [1, 2] + 30 * [3, 6]) / 40
    assert torch.allclose(new.global_params["w"], t(2.5, 5.0))
    assert torch.allclose(new.global_params["b"], t(3.0))
    assert new.round == 5


def test_fedavg_is_a_pure_function_of_state_and_results() -> None:
    state = ServerState(0, {"w": t(0, 0), "b": t(0)})
    rs = results()
    a = FedAvg().aggregate(state, rs)
    b = FedAvg().aggregate(state, rs)
    assert torch.equal(a.global_params["w"], b.global_params["w"])
    assert state.round == 0 and torch.equal(state.global_params["w"], t(0, 0))
    assert rs[0].params["w"].tolist() == [1, 2]


# --- registry -----------------------------------------------------------------------------


def test_registry_lists_the_core_algorithms() -> None:
    assert {"fedavg", "local", "centralized"} <= set(algorithms.available())
    assert isinstance(algorithms.create("fedavg"), FedAvg)
    assert isinstance(algorithms.create("local"), Local)
    assert isinstance(algorithms.create("centralized"), Centralized)
    assert algorithms.create("fedavg").name == "fedavg"


def test_create_unknown_algorithm_names_algorithm_name() -> None:
    with pytest.raises(AlgorithmError, match=r"^algorithm\.name: unknown algorithm 'fedsgdx'") as info:
        algorithms.create("fedsgdx")
    assert "fedavg" in str(info.value)  # lists the known ones


def test_create_unknown_hyperparameter_names_the_key() -> None:
    with pytest.raises(AlgorithmError, match=r"^algorithm\.mu: unknown hyperparameter for fedavg"):
        algorithms.create("fedavg", mu=0.1)
    with pytest.raises(AlgorithmError, match=r"^algorithm\.weighting: unknown hyperparameter"):
        algorithms.create("local", weighting="uniform")


@pytest.mark.parametrize(
    ("hp", "key"),
    [
        ({"weighting": "median"}, "algorithm.weighting"),
        ({"cap": 10.0}, "algorithm.cap"),  # cap without weighting = "capped"
        ({"weighting": "capped", "cap": 0.0}, "algorithm.cap"),
    ],
)
def test_create_bad_hyperparameter_value_names_the_key(hp: dict, key: str) -> None:
    with pytest.raises(AlgorithmError) as info:
        algorithms.create("fedavg", **hp)
    assert str(info.value).startswith(f"{key}: ")


def test_algorithms_are_frozen() -> None:
    alg = algorithms.create("fedavg", weighting="uniform")
    with pytest.raises(dataclasses.FrozenInstanceError):
        alg.weighting = "examples"  # type: ignore[misc]


# --- Local and Centralized ----------------------------------------------------------------


def test_local_keeps_each_adapter_on_its_client() -> None:
    """Local training: the adapter lives in the client's state; the server gets nothing
    and its state never changes."""
    alg = algorithms.create("local")
    assert alg.has_global is False
    assert alg.personalized is True
    assert alg.pools_data is False
    start = {"w": t(0, 0)}
    state = alg.init(start)
    assert alg.payload(state, 1) is start
    # before a client has trained, it uses the initial adapter
    assert alg.client_adapter(ctx_with({}), start) is start
    s1 = alg.aggregate(state, [ClientResult(0, {}, 5), ClientResult(1, {}, 50)])
    assert s1.round == 1 and s1.global_params is start
    mine = {"w": t(1, 1)}
    assert alg.client_adapter(ctx_with({"adapter": mine}), start) is mine


def ctx_with(state: dict) -> ClientContext:
    return ClientContext(0, None, [], None, 0, 1, state, 0)  # type: ignore[arg-type]


def test_centralized_pools_data_and_adopts_the_single_party() -> None:
    alg = algorithms.create("centralized")
    assert alg.pools_data is True
    assert alg.has_global is True and alg.personalized is False
    state = alg.init({"w": t(0.0)})
    new = alg.aggregate(state, [ClientResult(0, {"w": t(7.0)}, 100)])
    assert new.global_params["w"].tolist() == [7.0]
    assert new.round == 1
    with pytest.raises(ValueError):
        alg.aggregate(state, [ClientResult(0, {"w": t(1.0)}, 1), ClientResult(1, {"w": t(2.0)}, 1)])


def test_fedavg_flags() -> None:
    alg = algorithms.create("fedavg")
    assert alg.has_global is True and alg.personalized is False and alg.pools_data is False

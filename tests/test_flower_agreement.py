"""fedloom's server steps agree with Flower's strategies on identical inputs.

Every round, the same client arrays (several named tensors, random values, unequal example
counts, a training loss) go to ``alg.aggregate`` and to ``flwr.serverapp.strategy.<S>
.aggregate_train`` as reply Messages; the two global models must agree to a relative
difference of 1e-6 (per tensor, ||a - b|| / ||b||) after every one of several rounds, with
each side carrying its own server state (Flower: the strategy object; fedloom:
``ServerState``). Clients train towards a per-client target, so their updates are
heterogeneous and correlated with the rounds, as in real training.

Flower gets the clients' float32 values as float64 arrays, so its arithmetic is exact to
float64; fedloom keeps float32 parameters and optimizer state.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import flwr.serverapp.strategy as flwr_strategy  # a test dependency (pyproject: test)
import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import Metadata

from fedloom import algorithms
from fedloom.algorithms import ClientResult, ServerState
from fedloom.algorithms.aggregation_rule import AggregationRule, with_rule
from fedloom.params import Params

SHAPES = {"layer.lora_A": (4, 6), "layer.lora_B": (6, 4), "head.bias": (3,), "head.weight": (3, 5)}
COUNTS = [13, 40, 7, 25, 60]
ROUNDS = 4
RTOL = 1e-6


@pytest.fixture(autouse=True)
def _no_full_gc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's ``ArrayRecord.to_numpy_ndarrays(keep_input=False)`` (QFedAvg, FedAvgM) runs
    ``gc.collect()`` on every call to release memory: 0.3 s each with torch loaded. It has
    no effect on the numbers, so it is a no-op here."""
    monkeypatch.setattr(gc, "collect", lambda *args: 0)


def to_record(params: Params) -> ArrayRecord:
    return ArrayRecord({k: Array(params[k].double().numpy()) for k in sorted(params)})


def from_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


def reply(result: ClientResult) -> Message:
    """A client's training reply, as Flower's SuperLink would hand it to the strategy."""
    metrics = MetricRecord({"num-examples": result.num_examples, **result.metrics})
    content = RecordDict({"arrays": to_record(result.params), "metrics": metrics})
    metadata = Metadata(
        run_id=1,
        message_id=f"m{result.client_id}",
        src_node_id=result.client_id + 1,
        dst_node_id=0,
        reply_to_message_id="",
        group_id="1",
        created_at=0.0,
        ttl=60.0,
        message_type=MessageType.TRAIN,
    )
    return Message(content=content, metadata=metadata)


def client_results(global_params: Params, round_: int, seed: int) -> list[ClientResult]:
    """Each client moves from the global params part-way towards its own target, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    targets = [
        {
            k: torch.randn(SHAPES[k], generator=torch.Generator().manual_seed(100 * seed + c))
            * (c + 1)
            for k in sorted(SHAPES)
        }
        for c in range(len(COUNTS))
    ]
    out = []
    for c, n in enumerate(COUNTS):
        params = {
            k: (
                0.6 * global_params[k]
                + 0.4 * targets[c][k]
                + 0.05 * torch.randn(SHAPES[k], generator=gen)
            ).float()
            for k in sorted(SHAPES)
        }
        loss = float(0.3 + 0.5 * c + 0.1 * round_ + torch.rand((), generator=gen))
        out.append(ClientResult(c, params, n, {"train_loss": loss, "local_steps": 5.0}))
    return out


def initial_params(seed: int) -> Params:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(SHAPES[k], generator=gen) for k in sorted(SHAPES)}


def relative_difference(ours: Params, theirs: dict[str, np.ndarray]) -> float:
    assert sorted(ours) == sorted(theirs)
    worst = 0.0
    for k, ref in theirs.items():
        assert ours[k].shape == ref.shape
        a = ours[k].double().numpy()
        worst = max(worst, float(np.linalg.norm(a - ref) / np.linalg.norm(ref)))
    return worst


#: the [aggregation] keys among a case's hyperparameters
RULE_KEYS = ("beta", "num_malicious_nodes", "num_nodes_to_select")


def _algorithm(name: str, hp: dict[str, Any]) -> Any:
    """Algorithm ``name`` with ``hp``, the rule's keys going to its aggregation rule."""
    rule = {k: hp[k] for k in RULE_KEYS if k in hp}
    alg = algorithms.create(name, **{k: v for k, v in hp.items() if k not in RULE_KEYS})
    return with_rule(alg, AggregationRule(alg.rule.name, **rule)) if rule else alg


def run_both(
    name: str, hp: dict[str, Any], strategy: Any, feeds_current: bool, seed: int = 0
) -> list[float]:
    """ROUNDS rounds on both sides from the same start; returns the relative difference
    after each round. The clients start from fedloom's global params, and both sides
    aggregate the very same client arrays; each side carries its own state (Flower's
    current arrays, momentum and moments are never reset from fedloom's).

    ``feeds_current``: the strategy needs ``configure_train``'s current arrays; we set
    ``current_arrays`` the way ``configure_train`` does (FedOpt and QFedAvg every round,
    FedAvgM only once, it carries its own afterwards)."""
    alg = _algorithm(name, hp)
    state: ServerState = alg.init(initial_params(seed))
    flower_arrays = to_record(state.global_params)
    diffs = []
    for r in range(ROUNDS):
        results = client_results(state.global_params, r, seed + r)
        if feeds_current:
            set_current(strategy, flower_arrays, first=r == 0)
        arrays, metrics = strategy.aggregate_train(r + 1, [reply(res) for res in results])
        state = alg.aggregate(state, results)
        assert state.round == r + 1
        theirs = from_record(arrays)
        diffs.append(relative_difference(state.global_params, theirs))
        flower_arrays = arrays
        # the training loss is averaged by examples by Flower's metric aggregation too
        assert metrics is not None and "train_loss" in metrics
    return diffs


def set_current(strategy: Any, arrays: ArrayRecord, first: bool) -> None:
    if isinstance(strategy, flwr_strategy.FedAvgM):
        if first:
            strategy.current_arrays = arrays
    elif isinstance(strategy, flwr_strategy.QFedAvg):
        strategy.current_arrays = arrays.copy()
    else:  # FedOpt
        strategy.current_arrays = {k: a.numpy() for k, a in arrays.items()}


S = flwr_strategy
CASES: list[tuple[str, dict[str, Any], Callable[[], Any], bool]] = [
    ("fedavg", {}, lambda: S.FedAvg(), False),
    ("fedprox", {"proximal_mu": 0.1}, lambda: S.FedProx(proximal_mu=0.1), False),
    ("fedavgm", {}, lambda: S.FedAvgM(), True),
    ("fedavgm", {"server_momentum": 0.9}, lambda: S.FedAvgM(server_momentum=0.9), True),
    (
        "fedavgm",
        {"server_learning_rate": 0.7, "server_momentum": 0.5},
        lambda: S.FedAvgM(server_learning_rate=0.7, server_momentum=0.5),
        True,
    ),
    ("fedadagrad", {}, lambda: S.FedAdagrad(), True),
    ("fedadagrad", {"eta": 0.3, "tau": 1e-2}, lambda: S.FedAdagrad(eta=0.3, tau=1e-2), True),
    ("fedadam", {}, lambda: S.FedAdam(), True),
    (
        "fedadam",
        {"eta": 0.05, "beta_1": 0.5, "beta_2": 0.9, "tau": 1e-2},
        lambda: S.FedAdam(eta=0.05, beta_1=0.5, beta_2=0.9, tau=1e-2),
        True,
    ),
    ("fedyogi", {}, lambda: S.FedYogi(), True),
    (
        "fedyogi",
        {"eta": 0.2, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-4},
        lambda: S.FedYogi(eta=0.2, beta_1=0.8, beta_2=0.95, tau=1e-4),
        True,
    ),
    (
        "qfedavg",
        {"client_learning_rate": 0.1},
        lambda: S.QFedAvg(client_learning_rate=0.1),
        True,
    ),
    (
        "qfedavg",
        {"client_learning_rate": 0.02, "q": 2.0},
        lambda: S.QFedAvg(client_learning_rate=0.02, q=2.0),
        True,
    ),
    ("median", {}, lambda: S.FedMedian(), False),
    ("trimmed_mean", {}, lambda: S.FedTrimmedAvg(), False),
    ("trimmed_mean", {"beta": 0.45}, lambda: S.FedTrimmedAvg(beta=0.45), False),
    ("trimmed_mean", {"beta": 0.0}, lambda: S.FedTrimmedAvg(beta=0.0), False),
    ("krum", {}, lambda: S.Krum(), False),
    ("krum", {"num_malicious_nodes": 2}, lambda: S.Krum(num_malicious_nodes=2), False),
    ("multikrum", {}, lambda: S.MultiKrum(), False),
    (
        "multikrum",
        {"num_malicious_nodes": 1, "num_nodes_to_select": 3},
        lambda: S.MultiKrum(num_malicious_nodes=1, num_nodes_to_select=3),
        False,
    ),
    # five clients allow f = 0 only (n >= 4f + 3): the unweighted mean of all, through
    # Flower's serverapp Bulyan (test_defences compares f > 0 with aggregate_bulyan)
    ("bulyan", {}, lambda: S.Bulyan(), False),
]


@pytest.mark.parametrize(
    ("name", "hp", "make", "feeds_current"),
    CASES,
    ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items()) or 'defaults'}" for c in CASES],
)
@pytest.mark.parametrize("seed", [0, 7])
def test_server_step_matches_flower(
    name: str, hp: dict[str, Any], make: Callable[[], Any], feeds_current: bool, seed: int
) -> None:
    diffs = run_both(name, hp, make(), feeds_current, seed)
    assert len(diffs) == ROUNDS
    assert max(diffs) <= RTOL, f"{name} {hp}: relative differences per round {diffs}"


# --- the comparison can fail: departures from Flower are seen -----------------------------

CONTROLS: list[tuple[str, dict[str, Any], Callable[[], Any], bool]] = [
    # Adam's own bias correction (round t, not t + 1) vs Flower's
    ("fedadam", {"bias_correction": "adam"}, lambda: S.FedAdam(), True),
    # the paper's Algorithm 2 (no bias correction, v_{-1} = tau^2)
    ("fedadam", {"variant": "paper"}, lambda: S.FedAdam(), True),
    ("fedyogi", {"variant": "paper", "tau": 0.1}, lambda: S.FedYogi(tau=0.1), True),
    ("fedyogi", {"bias_correction": "adam"}, lambda: S.FedYogi(), True),
    ("fedadagrad", {"beta_1": 0.5}, lambda: S.FedAdagrad(), True),
    # Blanchard et al.'s uniform Multi-Krum mean vs Flower's example-weighted one
    (
        "multikrum",
        {"num_nodes_to_select": 3, "weighting": "uniform"},
        lambda: S.MultiKrum(num_nodes_to_select=3),
        False,
    ),
    ("fedavgm", {"server_momentum": 0.8}, lambda: S.FedAvgM(server_momentum=0.9), True),
    (
        "qfedavg",
        {"client_learning_rate": 0.1, "q": 0.2},
        lambda: S.QFedAvg(client_learning_rate=0.1),
        True,
    ),
    ("median", {}, lambda: S.FedAvg(), False),
    ("krum", {"num_malicious_nodes": 2}, lambda: S.MultiKrum(num_nodes_to_select=2), False),
]


@pytest.mark.parametrize(
    ("name", "hp", "make", "feeds_current"),
    CONTROLS,
    ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items()) or 'defaults'}" for c in CONTROLS],
)
def test_a_different_rule_is_detected(
    name: str, hp: dict[str, Any], make: Callable[[], Any], feeds_current: bool
) -> None:
    diffs = run_both(name, hp, make(), feeds_current)
    assert max(diffs) > 1e3 * RTOL, f"{name} {hp}: indistinguishable from Flower: {diffs}"

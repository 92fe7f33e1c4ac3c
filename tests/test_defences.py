"""Byzantine-robust defences of ``[aggregation]``: Bulyan, norm bounding and centered
clipping, each against an independent transcription of its paper's algorithm (loops over
rows and coordinates, numpy) and against Flower's ``aggregate_bulyan``; a toy with
attackers that moves the mean and not the defences; the refusals; the rule's state in
``ServerState.extra`` through every server step that carries extra state; and tiny-bert
runs with each rule, alone and composed with other algorithms."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_glue, tiny_config, tiny_raw
from flwr.server.strategy.aggregate import aggregate_bulyan, aggregate_krum
from test_algorithm_checks import assert_refused, run_with

from fedloom import algorithms
from fedloom.algorithms import ClientResult, ServerState
from fedloom.algorithms import aggregators as agg
from fedloom.algorithms.aggregation_rule import STATE_KEY, AggregationRule, with_rule
from fedloom.config import validate
from fedloom.experiment import Experiment, build_algorithm
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

F64 = torch.float64


# --- independent transcriptions of the papers ----------------------------------------------


def krum_index(rows: list[np.ndarray], f: int) -> int:
    """Blanchard et al.'s Krum: the row with the least sum of squared distances to its
    n - f - 2 nearest neighbours (at least one)."""
    n = len(rows)
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((rows[i] - rows[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[: max(1, n - f - 2)]))
    return int(np.argmin(scores))


def bulyan_paper(x: np.ndarray, f: int) -> np.ndarray:
    """El Mhamdi et al. 2018, Algorithm 1 with A = Krum: pick theta = n - 2f rows by Krum,
    removing each pick from the set; per coordinate, average the beta = theta - 2f picked
    values closest to their median."""
    remaining = list(x)
    picked = []
    for _ in range(len(x) - 2 * f):
        picked.append(remaining.pop(krum_index(remaining, f)))
    s = np.array(picked)
    beta = len(s) - 2 * f
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        column = s[:, j]
        order = np.argsort(np.abs(column - np.median(column)), kind="stable")
        out[j] = column[order[:beta]].mean()
    return out


def clip(d: np.ndarray, radius: float) -> np.ndarray:
    norm = float(np.linalg.norm(d))
    return d if norm <= radius else d * (radius / norm)


def norm_bounding_paper(
    x: np.ndarray, w: np.ndarray, ref: np.ndarray, bound: float | None
) -> np.ndarray:
    """Sun et al. 2019: each update Δ_k / max(1, ||Δ_k|| / M), their weighted mean, added
    to x_t (M: the median update norm when None)."""
    updates = [row - ref for row in x]
    if bound is None:
        bound = float(np.median([np.linalg.norm(d) for d in updates]))
    total = sum(wk * clip(d, bound) for wk, d in zip(w, updates))
    return ref + total / w.sum()


def centered_clipping_paper(
    x: np.ndarray, ref: np.ndarray, v0: np.ndarray, tau: float | None, iterations: int
) -> np.ndarray:
    """Karimireddy, He, Jaggi 2021, Algorithm 2 (CC): v <- v + (1/n) sum_i clip(m_i - v, τ),
    l times, with m_i the client updates (τ: the median of ||m_i - v|| when None)."""
    v = v0.copy()
    updates = [row - ref for row in x]
    for _ in range(iterations):
        radius = tau
        if radius is None:
            radius = float(np.median([np.linalg.norm(m - v) for m in updates]))
        v = v + sum(clip(m - v, radius) for m in updates) / len(updates)
    return ref + v


def rng_matrix(seed: int, k: int, p: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # clients spread at different scales, so clipping cuts some and not others
    return rng.normal(size=(k, p)) * rng.uniform(0.2, 3.0, size=(k, 1))


# --- each rule against its paper -------------------------------------------------------------


@pytest.mark.parametrize(("k", "f"), [(3, 0), (7, 1), (8, 1), (11, 2), (16, 3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bulyan_is_the_papers_algorithm(k: int, f: int, seed: int) -> None:
    x = rng_matrix(seed, k, 13)
    got = agg.bulyan(torch.tensor(x, dtype=F64), f).numpy()
    np.testing.assert_allclose(got, bulyan_paper(x, f), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("k", "f"), [(7, 1), (8, 1), (11, 2), (16, 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_bulyan_matches_flowers_aggregate_bulyan(k: int, f: int, seed: int) -> None:
    """Flower's ``aggregate_bulyan`` with ``aggregate_krum`` (several layers per client)."""
    x = rng_matrix(seed, k, 11)
    results = [([row[:4].reshape(2, 2), row[4:]], 10 + i) for i, row in enumerate(x)]
    theirs = aggregate_bulyan(results, f, aggregate_krum, to_keep=0)
    rule = AggregationRule("bulyan", num_malicious_nodes=f)
    ours = rule.combine(torch.tensor(x, dtype=F64), torch.ones(k, dtype=F64)).numpy()
    np.testing.assert_allclose(ours, np.concatenate([a.ravel() for a in theirs]), rtol=1e-12)


def test_bulyan_with_no_malicious_client_is_the_unweighted_mean() -> None:
    x = torch.tensor(rng_matrix(3, 6, 5), dtype=F64)
    assert torch.allclose(agg.combine("bulyan", x, torch.arange(1.0, 7.0, dtype=F64)), x.mean(0))


@pytest.mark.parametrize("bound", [None, 0.5, 2.0, 1e9])
@pytest.mark.parametrize("seed", [0, 1])
def test_norm_bounding_is_sun_et_al(bound: float | None, seed: int) -> None:
    x = rng_matrix(seed, 9, 17)
    ref = np.random.default_rng(seed + 10).normal(size=17)
    w = np.arange(1.0, 10.0)
    rule = AggregationRule("norm_bounding", max_norm=bound)
    got = rule.combine(*map(torch.tensor, (x, w, ref))).numpy()
    np.testing.assert_allclose(got, norm_bounding_paper(x, w, ref, bound), rtol=1e-12)


def test_norm_bounding_closed_forms() -> None:
    ref = torch.tensor([1.0, 1.0], dtype=F64)
    x = ref + torch.tensor([[3.0, 4.0], [0.0, 1.0], [-6.0, 8.0]], dtype=F64)  # norms 5, 1, 10
    w = torch.tensor([1.0, 2.0, 1.0], dtype=F64)
    out = AggregationRule("norm_bounding", max_norm=2.0).combine(x, w, ref)
    clipped = torch.tensor([[1.2, 1.6], [0.0, 1.0], [-1.2, 1.6]], dtype=F64)
    assert torch.allclose(out, ref + (w / 4) @ clipped)
    # a bound above every norm: the weighted mean; unset: the median norm, 5
    loose = AggregationRule("norm_bounding", max_norm=10.0).combine(x, w, ref)
    assert torch.allclose(loose, (w / 4) @ x)
    median = AggregationRule("norm_bounding").combine(x, w, ref)
    assert torch.allclose(
        median, ref + (w / 4) @ torch.tensor([[3, 4], [0, 1], [-3, 4]], dtype=F64)
    )


@pytest.mark.parametrize(("tau", "iterations"), [(None, 1), (0.7, 1), (0.7, 3), (None, 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_centered_clipping_is_karimireddy_et_al(
    tau: float | None, iterations: int, seed: int
) -> None:
    x = rng_matrix(seed, 8, 15)
    g = np.random.default_rng(seed + 20)
    ref, v0 = g.normal(size=15), g.normal(size=15) * 0.3
    rule = AggregationRule("centered_clipping", clip_radius=tau, clip_iterations=iterations)
    got = rule.combine(
        torch.tensor(x), torch.ones(8, dtype=F64), torch.tensor(ref), torch.tensor(v0)
    ).numpy()
    np.testing.assert_allclose(
        got, centered_clipping_paper(x, ref, v0, tau, iterations), rtol=1e-12, atol=1e-12
    )


def test_centered_clipping_closed_forms() -> None:
    x = torch.tensor(rng_matrix(5, 6, 4), dtype=F64)
    ones, ref = torch.ones(6, dtype=F64), torch.zeros(4, dtype=F64)
    # a radius no distance reaches, from v = 0: the unweighted mean (the weights are ignored)
    wide = AggregationRule("centered_clipping", clip_radius=1e9)
    assert torch.allclose(wide.combine(x, torch.arange(1.0, 7.0, dtype=F64), ref), x.mean(0))
    # every client exactly at v: v stays
    v = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=F64)
    same = v.expand(6, 4).clone()
    assert torch.equal(AggregationRule("centered_clipping").combine(same, ones, ref, v), v)


# --- robustness on a toy ----------------------------------------------------------------------

HONEST, ATTACKERS, P = 10, 2, 20
MU = torch.linspace(-1.0, 1.0, P, dtype=F64) + 0.5


def attacked(attack: str, seed: int = 0) -> torch.Tensor:
    """10 honest updates ~ N(μ, 0.01²) and 2 attackers (x_t = 0, so parameters are updates)."""
    g = torch.Generator().manual_seed(seed)
    honest = MU + 0.01 * torch.randn(HONEST, P, generator=g, dtype=F64)
    if attack == "sign_flip":
        bad = -10.0 * honest[:ATTACKERS]
    else:  # huge values
        bad = torch.full((ATTACKERS, P), 1e6, dtype=F64)
    return torch.cat([bad, honest])


DEFENCES = {
    "bulyan": AggregationRule("bulyan", num_malicious_nodes=ATTACKERS),
    "median": AggregationRule("median"),
    "norm_bounding": AggregationRule("norm_bounding"),
    "centered_clipping": AggregationRule("centered_clipping"),
}


@pytest.mark.parametrize("attack", ["sign_flip", "huge"])
def test_the_defences_stay_near_the_honest_mean_where_the_mean_does_not(attack: str) -> None:
    x, w, ref = (
        attacked(attack),
        torch.ones(HONEST + ATTACKERS, dtype=F64),
        torch.zeros(P, dtype=F64),
    )
    scale = float(MU.norm())  # ≈ 3.5
    # sign flip: the mean is -(10/12) μ, 1.83 |μ| away; huge values: 10^5 away
    assert float((agg.mean(x, w) - MU).norm()) > 1.5 * scale
    distance = {n: float((r.combine(x, w, ref) - MU).norm()) for n, r in DEFENCES.items()}
    assert distance["bulyan"] < 0.02 and distance["median"] < 0.02, distance
    # the clipping rules bound each attacker's pull by the radius M (the median norm, about
    # |μ|): f/n (|μ| + M) from μ at most after one round, 1.17 for the sign flip
    bound = 1.05 * ATTACKERS / (HONEST + ATTACKERS) * 2 * scale
    assert distance["norm_bounding"] < bound and distance["centered_clipping"] < bound, distance


@pytest.mark.parametrize("attack", ["sign_flip", "huge"])
def test_centered_clipping_converges_over_rounds_from_its_state(attack: str) -> None:
    """Each round the same attack on fresh honest noise; v carried from round to round
    closes in on μ: the attackers' pull shrinks with the radius (the median distance to v),
    which shrinks as v reaches the honest cluster, down to the honest noise (~0.01)."""
    alg = with_rule(algorithms.create("fedavg"), DEFENCES["centered_clipping"])
    state = ServerState(0, {"w": torch.zeros(P)})
    errors = []
    for t in range(12):
        # every client starts from the global point
        start = state.global_params["w"]
        rows = attacked(attack, seed=t).float()
        state = alg.aggregate(
            state, [ClientResult(k, {"w": start + r}, 5) for k, r in enumerate(rows)]
        )
        errors.append(float((state.extra[STATE_KEY]["w"].double() - MU).norm()))
    assert all(b < a / 2 for a, b in itertools.pairwise(errors[:4])), errors
    assert max(errors[6:]) < 0.03 and errors[0] > 10 * max(errors[6:]), errors


# --- the seam: state in ServerState.extra, next to each algorithm's own ---------------------


def results_for(state: ServerState, deltas: Sequence[float]) -> list[ClientResult]:
    return [
        ClientResult(k, {n: p + d for n, p in state.global_params.items()}, 3 + k)
        for k, d in enumerate(deltas)
    ]


@pytest.mark.parametrize(
    ("name", "own_keys"),
    [("fedavg", set()), ("fedavgm", {"momentum"}), ("fedadam", {"m", "v"}), ("fedprox", set())],
)
def test_the_rule_state_is_the_last_aggregate_update_beside_the_algorithms_own(
    name: str, own_keys: set[str]
) -> None:
    alg = with_rule(algorithms.create(name), AggregationRule("centered_clipping", clip_radius=0.5))
    state = alg.init({"a": torch.zeros(2, 2), "b": torch.ones(3)})
    for deltas in ([1.0, 2.0, 0.1], [0.3, -1.0, 0.2]):
        previous = state
        names = sorted(state.global_params)
        point, extra = alg.combine_flat(previous, results_for(previous, deltas), names)
        state = alg.aggregate(previous, results_for(previous, deltas))
        x = torch.cat([previous.global_params[n].reshape(-1).double() for n in names])
        kept = torch.cat([state.extra[STATE_KEY][n].reshape(-1).double() for n in names])
        assert torch.allclose(kept, (point - x).float().double())
        assert set(state.extra) == own_keys | {STATE_KEY}
        assert set(extra) == {STATE_KEY}
    # round 2 started from round 1's update: v_0 != 0 changes the point
    fresh = ServerState(previous.round, previous.global_params, {})
    again, _ = alg.combine_flat(fresh, results_for(previous, [0.3, -1.0, 0.2]), names)
    assert not torch.allclose(again, point)


def test_stateless_rules_add_no_extra_state() -> None:
    for rule in (AggregationRule("bulyan"), AggregationRule("norm_bounding", max_norm=1.0)):
        alg = with_rule(algorithms.create("fedavgm", server_momentum=0.5), rule)
        state = alg.aggregate(
            alg.init({"a": torch.zeros(4)}), results_for(alg.init({"a": torch.zeros(4)}), [1, 2, 3])
        )
        assert set(state.extra) == {"momentum"}


def test_the_reference_is_the_global_point_over_the_shared_names_only() -> None:
    """FFA-LoRA aggregates B and the head only: x_t is the global point over those."""
    alg = with_rule(algorithms.create("ffa_lora"), AggregationRule("norm_bounding", max_norm=1.0))
    state = ServerState(
        0, {"l.lora_A.weight": torch.full((2,), 7.0), "l.lora_B.weight": torch.ones(2)}
    )
    results = [
        ClientResult(k, {"l.lora_B.weight": torch.ones(2) + torch.tensor([3.0, 4.0]) * s}, 1)
        for k, s in enumerate([1.0, 1.0])
    ]
    new = alg.aggregate(state, results).global_params
    assert torch.allclose(new["l.lora_B.weight"], torch.tensor([1.6, 1.8]))  # 1 + (3, 4) / 5
    assert torch.equal(new["l.lora_A.weight"], state.global_params["l.lora_A.weight"])


# --- refusals -------------------------------------------------------------------------------


def refused(key: str, **rule) -> str:
    with pytest.raises(ValueError) as caught:
        AggregationRule(**rule)
    message = str(caught.value)
    assert message.startswith(f"aggregation.{key}:") and "\n" not in message, message
    return message


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_a_radius_must_be_positive_and_finite(value: float) -> None:
    refused("max_norm", name="norm_bounding", max_norm=value)
    refused("clip_radius", name="centered_clipping", clip_radius=value)


def test_bad_iterations_and_hyperparameters_of_another_rule_name_the_key() -> None:
    refused("clip_iterations", name="centered_clipping", clip_iterations=0)
    assert "only with rule = 'norm_bounding'" in refused("max_norm", name="median", max_norm=1.0)
    refused("clip_radius", name="norm_bounding", clip_radius=1.0)
    refused("clip_iterations", name="bulyan", clip_iterations=2)
    refused("num_malicious_nodes", name="norm_bounding", num_malicious_nodes=1)
    refused("num_nodes_to_select", name="bulyan", num_nodes_to_select=2)


@pytest.mark.parametrize(("f", "enough"), [(0, 3), (1, 7), (2, 11)])
def test_bulyan_needs_4f_plus_3_clients_per_round(f: int, enough: int) -> None:
    rule = AggregationRule("bulyan", num_malicious_nodes=f)
    rule.check_federation(enough)
    with pytest.raises(
        ValueError, match=rf"^aggregation.num_malicious_nodes: Bulyan needs .* {enough}"
    ):
        rule.check_federation(enough - 1)


def test_the_unweighted_rules_refuse_another_weighting() -> None:
    for name in ("bulyan", "centered_clipping"):
        with pytest.raises(ValueError, match="^algorithm.weighting: aggregation rule"):
            with_rule(algorithms.create("fedavg", weighting="uniform"), AggregationRule(name))
    with_rule(algorithms.create("fedavg", weighting="uniform"), AggregationRule("norm_bounding"))


def test_a_rule_on_updates_without_a_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the reference point"):
        AggregationRule("norm_bounding").combine(
            torch.ones(3, 2, dtype=F64), torch.ones(3, dtype=F64)
        )


def test_the_cli_refuses_bulyan_with_too_few_clients(tmp_path: Path) -> None:
    result = run_with(tmp_path, "aggregation.rule=bulyan", "aggregation.num_malicious_nodes=1")
    assert_refused(
        result, tmp_path / "runs", "aggregation.num_malicious_nodes: Bulyan", "4f + 3 = 7"
    )


def test_the_cli_refuses_a_negative_clip_radius(tmp_path: Path) -> None:
    result = run_with(
        tmp_path, "aggregation.rule=centered_clipping", "aggregation.clip_radius=-1.0"
    )
    assert_refused(result, tmp_path / "runs", "aggregation.clip_radius: must be > 0")


def test_the_config_sets_each_hyperparameter_on_the_rule() -> None:
    cfg = validate(
        tiny_raw(
            "algorithm.name=fedyogi", "aggregation.rule=norm_bounding", "aggregation.max_norm=0.5"
        )
    )
    assert build_algorithm(cfg).rule == AggregationRule("norm_bounding", max_norm=0.5)
    cfg = validate(
        tiny_raw(
            "algorithm.name=centered_clipping",
            "aggregation.clip_radius=2.0",
            "aggregation.clip_iterations=3",
        )
    )
    assert build_algorithm(cfg).rule == AggregationRule(
        "centered_clipping", clip_radius=2.0, clip_iterations=3
    )


# --- end to end ---------------------------------------------------------------------------

RUNS = {
    # n = 7 = 4f + 3 for f = 1: Krum picks 5, then the 3 values nearest the median
    "bulyan": [
        "partition.num_clients=7",
        "aggregation.rule=bulyan",
        "aggregation.num_malicious_nodes=1",
    ],
    "norm_bounding + fedadam": [
        "algorithm.name=fedadam",
        "algorithm.eta=0.01",
        "aggregation.rule=norm_bounding",
        "aggregation.max_norm=0.05",
    ],
    "centered_clipping + ditto": ["algorithm.name=ditto", "aggregation.rule=centered_clipping"],
    "centered_clipping + fedper": [
        "algorithm.name=fedper",
        "aggregation.rule=centered_clipping",
        "aggregation.clip_iterations=2",
    ],
}


@needs_glue
@pytest.mark.parametrize("case", sorted(RUNS))
def test_a_tiny_run_with_each_defence_completes(case: str, tmp_path: Path) -> None:
    cfg = tiny_config(*RUNS[case], output_dir=tmp_path)
    exp = Experiment.build(cfg)
    assert exp.algorithm.rule.name == cfg.aggregation.rule
    run = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    losses = [r["train_loss"] for r in rows if r["scope"] == "train"]
    assert len(losses) == cfg.federation.rounds and all(map(math.isfinite, losses)), losses

"""Clustered federated learning: IFCA's defining behaviour on quadratic clients with known
group optima, its packing of k adapters, and the output contract (``scope: "clusters"``
rows, the summary's ``clusters``, one checkpoint per cluster) on a real tiny run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_glue
from quadratic import Quadratic, context
from typer.testing import CliRunner

from fedloom import algorithms
from fedloom.algorithms.clustering import bipartition, lowest_loss, redraw
from fedloom.cli import app
from fedloom.diagnostics.clusters import adjusted_rand, true_groups
from fedloom.experiment import Experiment
from fedloom.params import pack, unpack
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate

#: two groups of two clients: optima around (2, 0) and around (−2, 0)
GROUPED = np.array([[2.0, 0.5], [2.0, -0.5], [-2.0, 0.3], [-2.0, -0.3]])


def run_quadratic(optima: np.ndarray, rounds: int, start: np.ndarray, name: str = "ifca", **hp):
    """``name`` on quadratic clients F_k(w) = ½‖w − w_k*‖², every client in every round;
    returns the algorithm, the final state and the assignment after every round."""
    alg = algorithms.create(name, **hp)
    models = [Quadratic(np.eye(2), w) for w in optima]
    states: list[dict] = [{} for _ in models]
    state = alg.init({"w": torch.tensor(start, dtype=torch.float64)})
    history, checks = [], []
    for r in range(rounds):
        results = [alg.local_train(context(m, k, 1, 0.1, 5, r, rounds, states[k]),
                                   alg.payload(state, k)) for k, m in enumerate(models)]
        state = alg.aggregate(state, results)
        history.append(dict(alg.assignment(state)))
        checks.append(dict(state.extra.get("checks", {})))
    run_quadratic.checks = checks  # type: ignore[attr-defined]
    return alg, state, history


def test_pack_unpack_round_trip_and_refuses_foreign_names() -> None:
    a = {"x.lora_A.weight": torch.ones(2, 3), "head.bias": torch.zeros(2)}
    b = {n: t + 1 for n, t in a.items()}
    packed = pack([a, b])
    assert set(packed) == {f"cluster{j}/{n}" for j in (0, 1) for n in a}
    back = unpack(packed)
    assert all(torch.equal(back[0][n], a[n]) and torch.equal(back[1][n], b[n]) for n in a)
    with pytest.raises(ValueError, match="not a packed cluster tensor"):
        unpack({"x.weight": torch.ones(1)})
    with pytest.raises(ValueError, match="not numbered"):
        unpack({"cluster1/x": torch.ones(1)})


def test_client_picks_the_cluster_with_the_lowest_loss() -> None:
    model = Quadratic(np.eye(2), np.array([0.9, 0.0]))
    ctx = context(model, 0, 4, 0.1, 1, 0, 1, {})
    clusters = [{"w": torch.tensor([-1.0, 0.0], dtype=torch.float64)},
                {"w": torch.tensor([1.0, 0.0], dtype=torch.float64)}]
    chosen, losses = lowest_loss(ctx, clusters, None, 8)
    assert chosen == 1
    assert losses == pytest.approx([0.5 * 1.9**2, 0.5 * 0.1**2])
    same = [clusters[0], {"w": clusters[0]["w"].clone()}]
    assert lowest_loss(ctx, same, None, 8)[0] == 0  # identical clusters: not scored, j = 0


def test_ifca_recovers_the_groups_and_each_cluster_reaches_its_groups_optimum() -> None:
    """Identical curvatures: FedAvg within a group has the group's mean optimum as its fixed
    point, so cluster j must converge to the mean of its members' optima."""
    alg, state, history = run_quadratic(GROUPED, 40, np.zeros(2), num_clusters=2)
    assignment = history[-1]
    assert assignment[0] == assignment[1] != assignment[2] == assignment[3]
    assert all(h == assignment for h in history)  # seeded right in round 1, never moves
    clusters = alg.cluster_adapters(state)
    for members in ([0, 1], [2, 3]):
        target = GROUPED[members].mean(axis=0)
        got = clusters[assignment[members[0]]]["w"].numpy()
        np.testing.assert_allclose(got, target, atol=1e-9)


def test_ifca_with_one_cluster_is_fedavg() -> None:
    _, state, history = run_quadratic(GROUPED, 40, np.zeros(2), num_clusters=1)
    (cluster,) = unpack(state.global_params)
    np.testing.assert_allclose(cluster["w"].numpy(), GROUPED.mean(axis=0), atol=1e-9)
    assert set(history[-1].values()) == {0}


def test_random_initialization_redraws_within_the_initial_range() -> None:
    initial = {"a": torch.full((50, 4), 0.25) * torch.sign(torch.randn(50, 4)),
               "b": torch.zeros(3, 4)}
    one, two = redraw(initial, seed=0), redraw(initial, seed=1)
    assert not torch.equal(one["a"], two["a"]) and one["a"].abs().max() <= 0.25
    assert one["a"].std() == pytest.approx(0.25 / 3**0.5, rel=0.15)  # U(-m, m)
    assert torch.equal(one["b"], initial["b"])  # zeros (LoRA B) stay zero
    assert torch.equal(redraw(initial, seed=0)["a"], one["a"])
    alg = algorithms.create("ifca", num_clusters=3, initialization="random")
    clusters = unpack(alg.init(initial).global_params)
    assert len(clusters) == 3 and not torch.equal(clusters[0]["a"], clusters[1]["a"])


def test_ifca_random_initialization_separates_well_separated_groups() -> None:
    """From random starts on either side of the groups' dividing line (seeds 0 and 1 draw
    (2.82, 1.25) and (−2.63, −1.65)), the choice rule alone finds the groups."""
    _, _, history = run_quadratic(GROUPED, 40, np.array([3.0, 3.0]), num_clusters=2,
                                      initialization="random")
    a = history[-1]
    starts = [c["w"][0].item() for c in unpack(algorithms.create(
        "ifca", initialization="random").init({"w": torch.tensor([3.0, 3.0])}).global_params)]
    assert starts[0] > 0 > starts[1]
    assert a[0] == a[1] == 0 and a[2] == a[3] == 1


@pytest.mark.parametrize(("key", "value"), [("num_clusters", 0), ("initialization", "kmeans"),
                                            ("assign_examples", 0), ("weighting", "capped")])
def test_ifca_refuses_bad_hyperparameters(key: str, value) -> None:
    with pytest.raises(ValueError, match=f"algorithm.{key}"):
        algorithms.create("ifca", **{key: value})


# --- CFL ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_bipartition_is_the_exact_minimax_split(seed: int) -> None:
    """Against brute force over all 2^(n−1) − 1 splits of n = 7 clients."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(7, 4))
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    sim = unit @ unit.T
    best = min(
        max(sim[i, j] for i in range(7) if mask >> i & 1 for j in range(7) if not mask >> j & 1)
        for mask in range(1, 2**7 - 1))
    c1, c2, cross = bipartition(sim)
    assert sorted(c1 + c2) == list(range(7)) and c1 and c2
    assert cross == pytest.approx(best)
    assert cross == pytest.approx(sim[np.ix_(c1, c2)].max())


def test_cfl_splits_exactly_when_its_criterion_holds() -> None:
    """Constructed updates: three clients move along +e1 (one a little off), two along −e1
    + e2. The quantities are computed by hand; each threshold flips the decision at its
    boundary."""
    from fedloom.algorithms import ClientResult

    start = {"w": torch.zeros(2)}
    moves = [[1.0, 0.0], [1.0, 0.1], [2.0, 0.0], [-1.0, 0.5], [-1.0, 0.4]]
    results = [ClientResult(k, {"w": torch.tensor(m)}, 10) for k, m in enumerate(moves)]
    u = np.array(moves) / np.linalg.norm(moves, axis=1, keepdims=True)
    cross = (u[:3] @ u[3:].T).max()
    mean_norm = np.linalg.norm(np.mean(moves, axis=0))
    max_norm = np.linalg.norm(moves, axis=1).max()
    check = algorithms.create("cfl").split_check(start, results, 1)
    assert sorted(map(sorted, check["parts"])) == [[0, 1, 2], [3, 4]]
    assert check["cross_similarity"] == pytest.approx(cross, abs=1e-6)
    assert check["mean_norm"] == pytest.approx(mean_norm, abs=1e-6)
    assert check["max_norm"] == pytest.approx(max_norm, abs=1e-6)
    assert check["split"]  # cross ≈ −0.82 < γ = −0.02, no ε set

    def decide(**hp: float) -> bool:
        return algorithms.create("cfl", **hp).split_check(start, results, 1)["split"]

    assert decide(max_cross_similarity=cross + 1e-3) and not decide(max_cross_similarity=cross - 1e-3)
    assert decide(eps1=mean_norm + 1e-3) and not decide(eps1=mean_norm - 1e-3)
    assert decide(eps2=max_norm - 1e-3) and not decide(eps2=max_norm + 1e-3)
    assert not decide(warmup_rounds=2)  # round 1 is before the warm-up ends


def test_cfl_splits_two_conflicting_groups_and_each_reaches_its_optimum() -> None:
    """From w = 0 the groups' updates point apart (cosine < 0): split in round 1, then each
    cluster is FedAvg on its group, whose fixed point is the group's mean optimum."""
    alg, state, history = run_quadratic(GROUPED, 40, np.zeros(2), name="cfl")
    assert history[0] == {0: 0, 1: 0, 2: 1, 3: 1} == history[-1]
    clusters = alg.cluster_adapters(state)
    assert len(clusters) == 2
    for members, c in (([0, 1], 0), ([2, 3], 1)):
        np.testing.assert_allclose(clusters[c]["w"].numpy(), GROUPED[members].mean(axis=0),
                                   atol=1e-9)


def test_cfl_waits_for_a_stationary_federation_when_eps1_is_set() -> None:
    """From (0, 5) every update first points down to the joint optimum (0, 0); with
    ε₁ = 0.05 the split comes in the first round whose mean update is below ε₁."""
    _, _, history = run_quadratic(GROUPED, 30, np.array([0.0, 5.0]), name="cfl", eps1=0.05,
                                  max_cross_similarity=1.0)
    checks = run_quadratic.checks  # type: ignore[attr-defined]
    split = next(r for r, h in enumerate(history) if len(set(h.values())) == 2)
    assert split > 3  # a few rounds of joint training first
    assert checks[split][0]["mean_norm"] < 0.05 <= checks[split - 1][0]["mean_norm"]
    assert history[-1] == {0: 0, 1: 0, 2: 1, 3: 1}


def test_cfl_never_splits_when_no_client_is_far_from_stationary() -> None:
    """ε₂ above every update norm: CFL is FedAvg (the joint optimum, the mean of optima)."""
    alg, state, history = run_quadratic(GROUPED, 40, np.zeros(2), name="cfl", eps2=100.0)
    assert set(history[-1].values()) == {0}
    (cluster,) = alg.cluster_adapters(state)
    np.testing.assert_allclose(cluster["w"].numpy(), GROUPED.mean(axis=0), atol=1e-9)


def test_cfl_splits_recursively_into_three_groups() -> None:
    """Three pairs of clients at 120° from each other: one split cannot separate them
    all; a later round splits the part that still holds two groups."""
    angles = np.deg2rad([0, 10, 120, 130, 240, 250])
    optima = 2 * np.stack([np.cos(angles), np.sin(angles)], axis=1)
    _, _, history = run_quadratic(optima, 30, np.zeros(2), name="cfl")
    final = history[-1]
    assert len(set(final.values())) == 3
    assert final[0] == final[1] and final[2] == final[3] and final[4] == final[5]
    assert len(set(history[0].values())) == 2  # one split per cluster and round
    _, _, capped = run_quadratic(optima, 30, np.zeros(2), name="cfl", max_clusters=2)
    assert len(set(capped[-1].values())) == 2


def run_with_newcomers(optima: np.ndarray, old: int, rounds: int, joined: int, **hp):
    """CFL on quadratic clients where only the first ``old`` clients take part until round
    ``joined``, then all; returns the assignment after every round."""
    alg = algorithms.create("cfl", **hp)
    models = [Quadratic(np.eye(2), w) for w in optima]
    state = alg.init({"w": torch.zeros(2, dtype=torch.float64)})
    history = []
    for r in range(rounds):
        sampled = range(len(models) if r >= joined else old)
        results = [alg.local_train(context(models[k], k, 1, 0.1, 5, r, rounds, {}),
                                   alg.payload(state, k)) for k in sampled]
        state = alg.aggregate(state, results)
        history.append(dict(alg.assignment(state)))
    return alg, state, history


def test_a_client_new_after_the_split_descends_to_its_groups_cluster() -> None:
    """Clients 4 (optimum near group 0's) and 5 (near group 1's) first take part in round
    10, after the split of round 1: one round from the split's stored adapter routes each
    into its group's cluster (the paper's tree descent), where cluster 0 would have been
    wrong for client 5. Their descent updates are not averaged into any cluster.
    (``max_clusters`` stops the criterion from splitting a converged group of three,
    whose updates then point apart.)"""
    optima = np.vstack([GROUPED, [[2.0, 0.1], [-2.0, 0.0]]])
    alg, state, history = run_with_newcomers(optima, 4, 40, joined=10, max_clusters=2)
    assert history[9] == {0: 0, 1: 0, 2: 1, 3: 1}
    assert history[10] == {0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 1} == history[-1]
    clusters = alg.cluster_adapters(state)
    for members, c in (([0, 1, 4], 0), ([2, 3, 5], 1)):
        np.testing.assert_allclose(clusters[c]["w"].numpy(), optima[members].mean(axis=0),
                                   atol=1e-6)


def test_newcomers_descend_a_two_level_tree_one_split_per_round() -> None:
    """Three groups at 120°, split twice before the newcomers arrive: each newcomer ends
    in its group's cluster, one round per level of the tree, unassigned while it
    descends."""
    angles = np.deg2rad([0, 10, 120, 130, 240, 250, 5, 125, 245])
    optima = 2 * np.stack([np.cos(angles), np.sin(angles)], axis=1)
    _, state, history = run_with_newcomers(optima, 6, 30, joined=20, max_clusters=3)
    assert len(set(history[19].values())) == 3 and len(state.extra["splits"]) == 2
    final = history[-1]
    for newcomer, (a, b) in zip((6, 7, 8), ((0, 1), (2, 3), (4, 5))):
        assert final[newcomer] == final[a] == final[b]
    depth = {k: 1 + int(k not in history[20]) for k in (6, 7, 8)}
    assert sorted(depth.values()) == [1, 2, 2]  # the first split cut one group off
    assert all(k in history[21] for k in (6, 7, 8))


def test_cfl_never_splits_a_cluster_of_two() -> None:
    _, _, history = run_quadratic(GROUPED[[0, 2]], 5, np.zeros(2), name="cfl")
    assert set(history[-1].values()) == {0}


@pytest.mark.parametrize(("key", "value"), [("eps1", -1.0), ("eps2", -0.1),
                                            ("max_cross_similarity", 1.5),
                                            ("warmup_rounds", -1), ("max_clusters", 0),
                                            ("weighting", "capped")])
def test_cfl_refuses_bad_hyperparameters(key: str, value) -> None:
    with pytest.raises(ValueError, match=f"algorithm.{key}"):
        algorithms.create("cfl", **{key: value})


# --- the output contract, on real data --------------------------------------------------------


@needs_glue
@pytest.mark.parametrize("method", ["ifca", "cfl"])
def test_output_contract_on_a_concept_shift_run(method: str, make_config, tmp_path: Path) -> None:
    cfg = make_config(f"algorithm.name={method}", "federation.rounds=2", "partition.num_clients=4",
                      "partition.concept.fraction=0.5", 'partition.concept.kind="swap"')
    exp = Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    clusters = [r for r in rows if r["scope"] == "clusters"]
    assert [r["round"] for r in clusters] == [1, 2]
    assert all(set(r["assignment"]) == {"0", "1", "2", "3"} for r in clusters)
    k = 2 if method == "ifca" else 4  # CFL: up to one split per cluster and round
    assert all(set(r["assignment"].values()) <= set(range(k)) for r in clusters)
    assert summary["clusters"] == clusters[-1]["assignment"]
    assert "global" not in summary and "personal" in summary
    names = set(exp.model.param_names)
    saved = sorted((run.checkpoints / "clusters").glob("cluster_*.safetensors"))
    assert len(saved) == (len(set(summary["clusters"].values())) if method == "cfl" else 2)
    for path in saved:
        assert set(load_params(path)) == names
    train = [r for r in rows if r["scope"] == "train"]
    assert all(np.isfinite(r["train_loss"]) for r in train)
    # `fedloom partition RUN_DIR` overlays the run's clusters on the true grouping; with
    # the two swapped clients together and the other two apart, the adjusted Rand index is
    # (1 − 2·1/6) / ((2 + 1)/2 − 2·1/6) = 4/7 (pairs together in both: 1; in the truth: 2;
    # in the clusters: 1; of 6 pairs)
    clients = json.loads((run.path / "partition.json").read_text())["clients"]
    swapped = [str(c["client_id"]) for c in clients if c["label_map"] is not None]
    kept = [str(c["client_id"]) for c in clients if c["label_map"] is None]
    assert len(swapped) == len(kept) == 2
    found = {swapped[0]: 0, swapped[1]: 0, kept[0]: 1, kept[1]: 2}
    (run.path / "summary.json").write_text(json.dumps({**summary, "clusters": found}))
    shown = CliRunner().invoke(app, ["partition", str(run.path), "--heatmap",
                                     str(tmp_path / "heat.png")], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert "adjusted Rand index of the clusters found: 0.571" in shown.stdout
    assert "labels [1, 0]" in shown.stdout and "labels as given" in shown.stdout


def test_true_groups_and_adjusted_rand() -> None:
    stats = {"clients": [
        {"client_id": 0, "task_counts": {"MRPC": 80, "RTE": 0}, "label_map": None},
        {"client_id": 1, "task_counts": {"MRPC": 2, "RTE": 70}, "label_map": None},
        {"client_id": 2, "task_counts": {"MRPC": 80, "RTE": 0}, "label_map": [1, 0]},
        {"client_id": 3, "task_counts": {"MRPC": 0, "RTE": 80}, "label_map": None}]}
    groups = true_groups(stats)
    assert groups == {0: "MRPC · labels as given", 1: "RTE · labels as given",
                      2: "MRPC · labels [1, 0]", 3: "RTE · labels as given"}
    assert adjusted_rand({"0": 5, "1": 7, "2": 9, "3": 7}, groups) == 1.0  # names don't matter
    assert adjusted_rand({"0": 0, "1": 0, "2": 1, "3": 1}, groups) < 0.5
    assert adjusted_rand({"0": 0}, {0: "all", 1: "all"}) is None


def test_partition_clusters_option_refuses_a_run_without_clusters(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"algorithm": "fedavg"}))
    out = CliRunner().invoke(app, ["partition", "missing.toml", "--clusters", str(run)])
    assert out.exit_code == 2
    assert "the run found no clusters" in out.stderr


@needs_glue
def test_cfl_routes_late_clients_on_a_partial_participation_run(make_config,
                                                                tmp_path: Path) -> None:
    """Half the clients a round and γ = 1 (split whenever a cluster can): clients first
    sampled after round 1's split descend the tree and reach clusters; a clusters row
    names only clients that have been sampled by then."""
    cfg = make_config("algorithm.name=cfl", "algorithm.max_cross_similarity=1.0",
                      "federation.rounds=4", "partition.num_clients=6", "federation.fraction=0.5")
    exp = Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    sampled = [set(map(str, r["clients"])) for r in rows if r["scope"] == "train"]
    clusters = [r["assignment"] for r in rows if r["scope"] == "clusters"]
    assert len(set(clusters[0].values())) == 2  # round 1's three clients split
    assert set(clusters[0]) == sampled[0]
    for r, row in enumerate(clusters):
        assert set(row) <= set().union(*sampled[:r + 1])
    late = set().union(*sampled[1:]) - sampled[0]
    assert late & set(summary["clusters"])  # some reached a leaf

"""FLTrust (Cao, Fang, Liu, Gong, NDSS 2021), ``aggregation.rule = "fltrust"``: the rule's
closed forms and an independent transcription of the paper's Algorithm 2; g_0 reaching the
rule through ``ServerState.extra`` and composing with a server optimizer; the root set
carved from the training data apart from every client, and no other rule's partition
changed; the server's own training seeded and resumed exactly; a tiny run that keeps
learning under a 40 % sign flip where the mean does not; the refusals, one line naming the
key."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import identical, needs_glue, run_tiny_cli, tiny_config, tiny_raw
from test_mixed_backbones import mixed_raw
from test_resume import Stop, _config, _outputs, _stop_at

from fedloom import algorithms
from fedloom.algorithms import ClientResult, ServerState
from fedloom.algorithms import aggregators as agg
from fedloom.algorithms.aggregation_rule import ROOT_UPDATE_KEY, AggregationRule, with_rule
from fedloom.config import ConfigError, validate
from fedloom.data import PartitionPool, make_clients
from fedloom.data.holdout import hold_out
from fedloom.experiment import Experiment, build_algorithm
from fedloom.federation import FederatedData
from fedloom.runtime.checkpoint import load_point
from fedloom.runtime.cohorts import ALL, Servers
from fedloom.runtime.root_update import ROOT_STATE_KEY, root_update
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

F64 = torch.float64
RULE = AggregationRule("fltrust")


def fltrust_paper(updates: np.ndarray, g0: np.ndarray) -> np.ndarray:
    """Cao et al. 2021, Algorithm 2, the server's aggregation written out client by client:
    TS_i = ReLU(cos(g_i, g_0)); g_i rescaled to ||g_0||; g = sum_i TS_i g_i' / sum_j TS_j."""
    total, weighted = 0.0, np.zeros_like(g0)
    for g in updates:
        cos = float(np.dot(g, g0)) / (
            math.sqrt(float(np.dot(g, g))) * math.sqrt(float(np.dot(g0, g0)))
        )
        trust = max(0.0, cos)
        rescaled = math.sqrt(float(np.dot(g0, g0))) / math.sqrt(float(np.dot(g, g))) * g
        total += trust
        weighted += trust * rescaled
    return weighted / total


def point(
    rows: torch.Tensor, g0: torch.Tensor, reference: torch.Tensor | None = None
) -> torch.Tensor:
    reference = torch.zeros(rows.shape[1], dtype=F64) if reference is None else reference
    weights = torch.arange(1, rows.shape[0] + 1, dtype=F64)  # unweighted: ignored
    return RULE.combine(reference + rows, weights, reference, root_update=g0)


# --- the rule -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_fltrust_is_cao_et_al_algorithm_2(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    g0 = torch.randn(30, generator=g, dtype=F64)
    # clients along g_0 at every scale, and some pointing away from it
    scale = torch.rand(8, 1, generator=g, dtype=F64) * 10 - 3
    rows = scale * g0 + torch.randn(8, 30, generator=g, dtype=F64)
    reference = torch.randn(30, generator=g, dtype=F64)
    got = point(rows, g0, reference) - reference
    want = fltrust_paper(rows.numpy(), g0.numpy())
    assert 0 < int((agg.trust_scores(rows, g0) == 0).sum()) < 8
    assert np.allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


def test_a_client_opposite_to_g0_gets_no_weight_however_long() -> None:
    g = torch.Generator().manual_seed(1)
    g0 = torch.randn(12, generator=g, dtype=F64)
    honest = g0 + 0.3 * torch.randn(4, 12, generator=g, dtype=F64)
    for bad in (-g0, -1000.0 * g0, -honest[0]):
        rows = torch.cat([bad[None], honest])
        assert float(agg.trust_scores(rows, g0)[0]) == 0.0
        assert torch.allclose(point(rows, g0), point(honest, g0), rtol=1e-12, atol=1e-12)


def test_a_client_along_g0_scaled_100_contributes_exactly_the_norm_of_g0() -> None:
    g0 = torch.tensor([3.0, 4.0, 0.0], dtype=F64)  # ||g_0|| = 5
    assert torch.allclose(point((100.0 * g0)[None], g0), g0, rtol=1e-12, atol=1e-12)
    v = torch.tensor([1.0, 0.0, 1.0], dtype=F64)  # cos(v, g_0) > 0
    assert torch.allclose(point((100.0 * v)[None], g0), 5.0 * v / v.norm(), rtol=1e-12, atol=1e-12)
    # beside a client of g_0's own length, the long one pulls no harder
    assert torch.allclose(point(torch.stack([100.0 * g0, g0]), g0), g0, rtol=1e-12, atol=1e-12)


def test_no_trusted_client_gives_the_reference_back() -> None:
    reference = torch.tensor([0.5, -2.0, 1.0], dtype=F64)
    g0 = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    away = torch.tensor([[-1.0, 2.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert torch.equal(point(away, g0, reference), reference)
    # a zero server update trusts nobody
    assert torch.equal(
        point(torch.ones(2, 3, dtype=F64), torch.zeros(3, dtype=F64), reference), reference
    )


def test_fltrust_is_permutation_invariant_and_unweighted() -> None:
    g = torch.Generator().manual_seed(2)
    g0 = torch.randn(20, generator=g, dtype=F64)
    rows = g0 + torch.randn(7, 20, generator=g, dtype=F64)
    order = torch.randperm(7, generator=g)
    assert torch.allclose(point(rows[order], g0), point(rows, g0), rtol=1e-12, atol=1e-12)
    reference = torch.zeros(20, dtype=F64)
    assert torch.equal(
        RULE.combine(rows, torch.ones(7, dtype=F64), reference, root_update=g0),
        RULE.combine(rows, torch.rand(7, generator=g, dtype=F64), reference, root_update=g0),
    )
    assert not RULE.weighted and RULE.needs_reference and RULE.needs_root_update


# --- the seam: g_0 in ServerState.extra ---------------------------------------------------


def test_the_server_step_reads_g0_from_the_state_and_composes_with_fedavgm() -> None:
    x = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    g0 = {"a": torch.tensor([0.1, 0.0]), "b": torch.tensor([0.1])}
    deltas = [[0.2, 0.1, 0.3], [-1.0, 0.0, -1.0], [0.05, 0.0, 0.0]]
    results = [
        ClientResult(k, {"a": x["a"] + torch.tensor(d[:2]), "b": x["b"] + torch.tensor(d[2:])}, 5)
        for k, d in enumerate(deltas)
    ]
    state = ServerState(0, x, {ROOT_UPDATE_KEY: g0})
    want = torch.tensor(
        fltrust_paper(np.array(deltas), np.array([0.1, 0.0, 0.1])), dtype=torch.float32
    )
    new = with_rule(algorithms.create("fedavg"), RULE).aggregate(state, results)
    got = torch.cat([new.global_params["a"] - x["a"], new.global_params["b"] - x["b"]])
    assert torch.allclose(got, want, atol=1e-6)
    momentum = with_rule(algorithms.create("fedavgm", server_momentum=0.9), RULE)
    moved = momentum.aggregate(state, results).global_params  # server lr 1, no momentum yet
    assert torch.allclose(moved["a"], new.global_params["a"], atol=1e-6)
    with pytest.raises(ValueError, match="fltrust: needs the server's update g_0"):
        with_rule(algorithms.create("fedavg"), RULE).aggregate(ServerState(0, x), results)


# --- the root set -----------------------------------------------------------------------------


def content(example) -> tuple:
    return (example.text_a, example.text_b, example.label)


@needs_glue
def test_the_root_set_is_carved_apart_from_every_client_and_no_other_partition_moves() -> None:
    plain = FederatedData.build(tiny_config("aggregation.rule=median"))
    assert plain.root == [] and len(plain.train) == 60  # the whole subsample, partitioned
    pool = PartitionPool.from_examples(plain.train)
    expected = make_clients(pool, plain.cfg.partition, 0)
    assert [(s.train.tolist(), s.test.tolist()) for s in plain.splits] == [
        (s.train.tolist(), s.test.tolist()) for s in expected
    ]
    data = FederatedData.build(
        tiny_config("aggregation.rule=fltrust", "aggregation.root_examples=12")
    )
    assert len(data.root) == 12 and len(data.train) == 48
    assert Counter(map(content, data.root + data.train)) == Counter(map(content, plain.train))
    held = {id(data.train[i]) for s in data.splits for i in [*s.train, *s.test]}
    assert held and not held & {id(e) for e in data.root}
    # the same carve every time (Ray actors and Flower nodes build it again)
    again = FederatedData.build(
        tiny_config("aggregation.rule=fltrust", "aggregation.root_examples=12")
    )
    assert list(map(content, again.root)) == list(map(content, data.root))
    # the refactored hold-out draws the validation splits as before
    assert hold_out(list(range(10)), 0.3, (3, 7)) == (
        [i for i in range(10) if i not in set(np.random.default_rng([3, 7]).permutation(10)[:3])],
        sorted(np.random.default_rng([3, 7]).permutation(10)[:3].tolist()),
    )


@needs_glue
def test_the_server_update_is_the_seeded_local_training_on_the_root_set() -> None:
    exp = Experiment.build(tiny_config("aggregation.rule=fltrust", "aggregation.root_examples=10"))
    backbone = next(iter(exp.models))
    assert len(exp.root[backbone]) == 10
    state = Servers.init(exp).states[ALL]
    update, local = root_update(exp, state, backbone, 0)
    assert update.keys() == state.global_params.keys()
    assert sum(float(t.norm()) for t in update.values()) > 0
    assert "optimizer" in local  # train.optimizer_state = "persist": kept for the next round
    assert identical(root_update(exp, state, backbone, 0)[0], update)
    assert not identical(root_update(exp, state, backbone, 1)[0], update)


# --- end to end --------------------------------------------------------------------------------


def _dev_rows(run: RunDir) -> list[dict]:
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    return [r for r in rows if r.get("scope") == "global/dev"]


@needs_glue
def test_fltrust_keeps_learning_under_a_40_percent_sign_flip_where_the_mean_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scores: list[list[float]] = []
    trust = agg.trust_scores
    monkeypatch.setattr(
        agg, "trust_scores", lambda u, g: scores.append(trust(u, g).tolist()) or trust(u, g)
    )
    dev = {}
    for rule in ("mean", "fltrust"):
        cfg = tiny_config(
            f"aggregation.rule={rule}",
            *(["aggregation.root_examples=10"] if rule == "fltrust" else []),
            "partition.num_clients=5",
            "data.max_train_examples=120",
            "federation.rounds=3",
            "attack.name=sign_flip",
            "attack.fraction=0.4",
            "attack.scale=4.0",
            "eval.initial=true",
            output_dir=tmp_path / rule,
        )
        exp = Experiment.build(cfg)
        run = RunDir.create(tmp_path / rule / "runs", cfg.name)
        simulate(exp, run)
        dev[rule] = _dev_rows(run)
    attackers = exp.attack.attackers
    assert len(attackers) == 2 and len(scores) == 3
    for round_scores in scores:  # every client trains every round, in id order
        assert [round_scores[c] for c in attackers] == [0.0, 0.0], round_scores
        assert sum(round_scores) > 0
    loss = {rule: [r["loss"] for r in rows] for rule, rows in dev.items()}
    assert loss["fltrust"][0] == loss["mean"][0]  # the same start
    assert loss["fltrust"][-1] < loss["fltrust"][0] - 0.05 < loss["mean"][-1], loss
    assert dev["fltrust"][-1]["accuracy"] >= dev["mean"][-1]["accuracy"] + 0.3, dev
    # g_0 is the step's only: the server keeps its own local state, not g_0
    states = load_point(run)[0].states
    assert ROOT_UPDATE_KEY not in states[ALL].extra and ROOT_STATE_KEY in states[ALL].extra


@needs_glue
def test_each_backbone_trains_its_own_server_update(tmp_path: Path) -> None:
    cfg = validate(
        mixed_raw(
            "aggregation.rule=fltrust",
            "aggregation.root_examples=10",
            "federation.rounds=1",
            tmp_path=tmp_path,
        )
    )
    exp = Experiment.build(cfg)
    assert {b: len(r) for b, r in exp.root.items()} == {"tiny-bert": 10, "tiny-llama": 10}
    run = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(exp, run)
    states = load_point(run)[0].states
    assert sorted(states) == ["tiny-bert", "tiny-llama"]
    assert all(
        ROOT_STATE_KEY in s.extra and ROOT_UPDATE_KEY not in s.extra for s in states.values()
    )


@needs_glue
def test_a_run_stopped_mid_round_resumes_to_the_uninterrupted_outputs(tmp_path: Path) -> None:
    """The server's optimizer moments on its root set are server state, checkpointed."""
    cfg = _config(
        tmp_path,
        "aggregation.rule=fltrust",
        "aggregation.root_examples=10",
        "algorithm.name=fedavgm",
        "algorithm.server_momentum=0.5",
    )
    whole = RunDir.create(tmp_path / "whole", cfg.name)
    simulate(Experiment.build(cfg), whole)
    broken = RunDir.create(tmp_path / "broken", cfg.name)
    with pytest.raises(Stop):
        simulate(Experiment.build(cfg), broken, _stop_at(3, 1))
    simulate(Experiment.build(cfg), RunDir(broken.path), resume=True)
    assert _outputs(broken.path) == _outputs(whole.path)


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "fragment"),
    [
        (
            {"name": "median", "root_examples": 5},
            "only with rule = 'fltrust' (the rule is 'median')",
        ),
        ({"name": "fltrust", "root_examples": 0}, "must be >= 1 (got 0)"),
        ({"name": "fltrust", "root_examples": -3}, "must be >= 1 (got -3)"),
    ],
)
def test_bad_root_examples_name_the_key(rule: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        AggregationRule(**rule)
    message = str(caught.value)
    assert message.startswith("aggregation.root_examples:") and fragment in message, message
    assert "\n" not in message


def test_a_server_without_data_refuses_fltrust() -> None:
    raw = tiny_raw(
        'runtime.name="flower"', 'runtime.client_data="nodes"', "aggregation.rule=fltrust"
    )
    with pytest.raises(
        ConfigError, match=r'^aggregation.rule: fltrust .*runtime.client_data = "nodes"'
    ):
        build_algorithm(validate(raw))


@needs_glue
@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        # the tiny federation has 60 training examples
        (
            ["aggregation.rule=fltrust"],
            "aggregation.root_examples: a root set of 100 examples leaves 0",
        ),
        (
            ["aggregation.rule=fltrust", "aggregation.root_examples=55"],
            "aggregation.root_examples: a root set of 55 examples leaves 5 of the task's 60",
        ),
        (
            ["aggregation.rule=fltrust", "aggregation.root_examples=0"],
            "aggregation.root_examples: must be",
        ),
        (
            ["aggregation.rule=krum", "aggregation.root_examples=10"],
            "aggregation.root_examples: only with",
        ),
        (
            ["aggregation.rule=fltrust", "aggregation.root_examples=10", "secagg.protocol=secagg+"],
            "aggregation.rule: fltrust needs each client's update",
        ),
    ],
)
def test_the_cli_refuses_in_one_line_with_exit_2(
    overrides: list[str], fragment: str, tmp_path: Path
) -> None:
    result = run_tiny_cli(tmp_path, *overrides)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())

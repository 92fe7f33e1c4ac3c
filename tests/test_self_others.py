"""Self / Others client scores (FedMosaic, Seo et al. 2025, arXiv 2506.11024):
Others_i = mean_{j ≠ i} score(θ_i, D_j), checked against scoring every adapter directly on
every other client's split (a personalized method and FedAvg, tiny-bert runs), the
exclusion of j = i and of undefined metrics and pairs (hand computed), and when
``[eval] others`` writes the scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import needs_glue

from fedloom.config import ConfigError
from fedloom.evaluation.score import evaluate
from fedloom.evaluation.self_others import mean_over_others
from fedloom.evaluation.splits import scored_splits
from fedloom.experiment import Experiment
from fedloom.params import Params
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate

SKEWED = ('partition.scheme="dirichlet"', "partition.alpha=0.3")


def run(cfg, tmp_path: Path) -> tuple[Experiment, RunDir, dict, list[dict]]:
    exp = Experiment.build(cfg)
    rundir = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, rundir)
    rows = [json.loads(line) for line in rundir.metrics_path.read_text().splitlines()]
    return exp, rundir, summary, rows


def adapter_of(rundir: RunDir, cid: int, personal: bool) -> Params:
    name = f"personal/client_{cid:03d}" if personal else "global"
    return load_params(rundir.checkpoints / f"{name}.safetensors")


def direct_scores(exp: Experiment, params: Params) -> dict[int, dict]:
    """``params`` scored with ``evaluate`` on every client's ``clients`` split."""
    return {c.client_id: evaluate(exp.model, params, scored_splits(exp, c)["clients"], 32)
            for c in exp.clients}


def hand_mean(values: list[float | None]) -> float | None:
    defined = [v for v in values if v is not None]
    return sum(defined) / len(defined) if defined else None


def assert_scores_equal(logged: dict, expected: dict, metrics: tuple[str, ...]) -> None:
    """The task's ``metrics`` to rounding; the loss (batch order differs) to 1e-5."""
    for m in metrics:
        assert (logged[m] is None) == (expected[m] is None), m
        if expected[m] is not None:
            assert logged[m] == pytest.approx(expected[m], abs=1e-9), m
    assert logged["loss"] == pytest.approx(expected["loss"], rel=1e-5)



@needs_glue
@pytest.mark.parametrize(("method", "personal"), [("local", True), ("fedavg", False)])
def test_others_is_the_mean_of_direct_scores_on_the_other_clients(
    method: str, personal: bool, make_config, tmp_path: Path
) -> None:
    cfg = make_config(f'algorithm.name="{method}"', "federation.rounds=1", *SKEWED)
    exp, rundir, summary, rows = run(cfg, tmp_path)
    adapter = "personal" if personal else "global"
    (others_row,) = [r for r in rows if r["scope"] == f"{adapter}/others"]
    (self_row,) = [r for r in rows if r["scope"] == f"{adapter}/clients"]
    metrics = exp.task.metrics
    ids = [c.client_id for c in exp.clients]
    including_self_differs = False
    for i in ids:
        on = direct_scores(exp, adapter_of(rundir, i, personal))
        expected = {m: hand_mean([on[j][m] for j in ids if j != i]) for m in (*metrics, "loss")}
        logged = others_row["per_client"][str(i)]
        assert_scores_equal(logged, expected, metrics)
        assert logged["clients"] == len(ids) - 1
        assert_scores_equal(self_row["per_client"][str(i)], on[i], metrics)  # Self: D_i
        with_self = hand_mean([on[j]["accuracy"] for j in ids])
        including_self_differs |= with_self != pytest.approx(expected["accuracy"])
    assert including_self_differs  # the exclusion of j = i is visible in these numbers
    accuracies = [others_row["per_client"][str(i)]["accuracy"] for i in ids]
    assert summary["self_others"] == {
        "adapter": adapter, "self": summary[adapter]["clients"], "others": others_row["metrics"]}
    assert others_row["metrics"]["accuracy"]["mean"] == pytest.approx(hand_mean(accuracies))


def test_others_leaves_out_the_own_client() -> None:
    on = {0: {"accuracy": 1.0, "loss": 0.1, "n": 8},
          1: {"accuracy": 0.0, "loss": 0.9, "n": 6},
          2: {"accuracy": 0.5, "loss": 0.5, "n": 4}}
    assert mean_over_others(on, 0) == {"accuracy": 0.25, "loss": 0.7, "clients": 2}
    assert mean_over_others(on, 1) == {"accuracy": 0.75, "loss": 0.3, "clients": 2}
    assert mean_over_others({0: on[0]}, 0) is None  # no other client


def test_undefined_metrics_and_pairs_are_left_out_of_the_mean() -> None:
    on = {0: {"accuracy": 0.9, "f1": 0.7},
          1: {"accuracy": 0.5, "f1": None},  # F1 undefined on this split
          2: {"accuracy": 0.7, "f1": 0.3},
          3: None}  # an undefined pair (another label space)
    assert mean_over_others(on, 0) == {"accuracy": pytest.approx(0.6), "f1": 0.3, "clients": 2}
    assert mean_over_others(on, 2) == {"accuracy": pytest.approx(0.7), "f1": 0.7, "clients": 2}
    assert mean_over_others({0: on[0], 1: on[1]}, 0) == {"accuracy": 0.5, "f1": None,
                                                          "clients": 1}
    assert mean_over_others({0: on[0], 3: None}, 0) is None


@needs_glue
def test_a_relabelled_client_shares_others_only_with_its_own_label_space(
    make_config, tmp_path: Path
) -> None:
    """Two of three clients swap the labels (the same map): each swapped client's Others is
    its adapter scored directly on the other swapped client's relabelled split; the client
    keeping the true labels shares its label space with no other client: null."""
    cfg = make_config('algorithm.name="local"', "federation.rounds=1",
                      'partition.concept={fraction=0.67, kind="swap"}')
    exp, rundir, summary, rows = run(cfg, tmp_path)
    swapped = [c.client_id for c in exp.clients if c.split.label_map is not None]
    (plain,) = [c.client_id for c in exp.clients if c.split.label_map is None]
    assert len(swapped) == 2
    (others,) = [r for r in rows if r["scope"] == "personal/others"]
    assert others["per_client"][str(plain)] is None
    for i, j in (swapped, swapped[::-1]):
        expected = direct_scores(exp, adapter_of(rundir, i, True))[j]
        logged = others["per_client"][str(i)]
        assert_scores_equal(logged, expected, exp.task.metrics)
        assert logged["clients"] == 1
    assert summary["self_others"]["others"]["accuracy"]["n"] == 2


@needs_glue
@pytest.mark.parametrize(("when", "rounds"), [("never", []), ("final", [2]), ("every", [1, 2])])
def test_eval_others_says_when(when: str, rounds: list[int], make_config, tmp_path: Path) -> None:
    cfg = make_config(f'eval.others="{when}"', "federation.rounds=2")
    _, _, summary, rows = run(cfg, tmp_path)
    assert [r["round"] for r in rows if r["scope"].endswith("/others")] == rounds
    assert ("self_others" in summary) == (when != "never")


def test_an_unknown_others_value_names_the_key(make_config) -> None:
    with pytest.raises(ConfigError, match=r"eval\.others: .*'final', 'every' or 'never'"):
        make_config('eval.others="sometimes"')

"""Every method reports its local compute: a client's training passes per round
(``train_passes`` in each train row, ``compute.train_passes_per_client_round`` in
summary.json), counted where the passes happen (:mod:`fedloom.train.passes`).

Each expected count is the method's definition written out from the config (steps per
round times passes per step), never read back from the counter; the tiny config trains
3 clients for ``train.local_steps = 2`` steps of batch 8 (the G² diagnostics, whose
passes must not count, run every round in FedAvg's case).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import needs_glue, tiny_config

from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate
from fedloom.train.passes import count, counting

pytestmark = needs_glue

STEPS, BATCH = 2, 8


def _run(tmp_path: Path, *overrides: str) -> tuple[Experiment, list[dict], dict[str, Any]]:
    """A tiny simulation: (its experiment, its metrics.jsonl rows, its summary)."""
    cfg = tiny_config(*overrides, output_dir=tmp_path)
    exp = Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    return exp, rows, summary


def _train_passes(rows: list[dict]) -> list[dict[str, float]]:
    """Each round's passes by client."""
    return [r["train_passes"] for r in rows if r.get("scope") == "train"]


def _check(tmp_path: Path, per_client: float, *overrides: str) -> dict[str, Any]:
    """Every client reports ``per_client`` passes every round, and the summary their mean."""
    _, rows, summary = _run(tmp_path, *overrides)
    rounds = _train_passes(rows)
    assert len(rounds) == 2
    assert all(passes == {"0": per_client, "1": per_client, "2": per_client} for passes in rounds)
    assert summary["compute"]["train_passes_per_client_round"] == per_client
    return summary


def test_counting_nests_and_counts_nothing_outside_a_block() -> None:
    count(5)  # no block open: nothing to count into, nothing fails
    with counting() as outer:
        count()
        with counting() as inner:
            count(2)
        assert inner.passes == 2
    assert outer.passes == 3


@pytest.mark.parametrize(
    ("overrides", "per_step"),
    [
        (("diagnostics.every=1",), 1),  # FedAvg: one pass a step, the G² batches not counted
        (("train.grad_accum=2",), 2),  # a pass per micro-batch
        (('algorithm.name="local"',), 1),
        (('algorithm.name="fedprox"',), 1),
        (('algorithm.name="apfl"',), 2),  # ∇f(w) and ∇f(v̄) on each batch
        (('algorithm.name="pfedme"', "algorithm.K=3"), 3),  # K inner gradient steps
        (('algorithm.name="perfedavg"', 'algorithm.variant="hf"'), 4),  # D, D', D''±δu
        (('algorithm.name="perfedavg"', 'algorithm.variant="fo"'), 2),  # D, D'
        (('algorithm.name="ditto"',), 2),  # the global and the personal training
        (('algorithm.name="fedlocal_global"',), 2),  # the local and the global phase
    ],
)
def test_passes_per_round_are_steps_times_passes_per_step(
    tmp_path: Path, overrides: tuple[str, ...], per_step: int
) -> None:
    _check(tmp_path, float(STEPS * per_step), *overrides)


@pytest.mark.parametrize(("steps", "split"), [(2, 1 + 1), (3, 2 + 1)])
def test_ditto_at_equal_compute_costs_fedavgs_passes(
    tmp_path: Path, steps: int, split: int
) -> None:
    """⌈S/2⌉ global and ⌊S/2⌋ personal steps: S passes, FedAvg's at the same budget."""
    _check(
        tmp_path,
        float(split),
        'algorithm.name="ditto"',
        "algorithm.equal_compute=true",
        f"train.local_steps={steps}",
    )


def test_ditto_refuses_to_split_one_step() -> None:
    cfg = tiny_config(
        'algorithm.name="ditto"', "algorithm.equal_compute=true", "train.local_steps=1"
    )
    with pytest.raises(ValueError, match="equal_compute"):
        Experiment.build(cfg)


def test_fedrep_counts_both_phases(tmp_path: Path) -> None:
    """The head phase, ``head_epochs`` passes over the client's data, then the body's S."""
    exp, rows, _ = _run(tmp_path, 'algorithm.name="fedrep"', "algorithm.head_epochs=0.5")
    for passes in _train_passes(rows):
        for c in exp.clients:
            assert passes[str(c.client_id)] == math.ceil(0.5 * len(c.train) / BATCH) + STEPS


def test_an_epoch_budget_is_counted_per_client(tmp_path: Path) -> None:
    exp, rows, _ = _run(
        tmp_path,
        "train.local_steps=null",
        "train.local_epochs=0.5",
        'partition.scheme="dirichlet"',
        "partition.alpha=0.5",
    )
    sizes = {str(c.client_id): len(c.train) for c in exp.clients}
    assert len(set(sizes.values())) > 1  # the clients' budgets differ
    for passes in _train_passes(rows):
        assert passes == {c: math.ceil(0.5 * n / BATCH) for c, n in sizes.items()}


def test_fedavg_ft_counts_its_fine_tuning_where_it_happens(tmp_path: Path) -> None:
    """Training is FedAvg's (S passes a round); the fine-tuning, ``ft_epochs`` passes over
    the client's data before it is scored (no holdout: no early stop), is counted at each
    evaluation as ``adapt_passes``."""
    exp, rows, summary = _run(
        tmp_path, 'algorithm.name="fedavg_ft"', "algorithm.ft_holdout=0", "algorithm.ft_epochs=1.5"
    )
    assert all(set(p.values()) == {float(STEPS)} for p in _train_passes(rows))
    expected = {str(c.client_id): math.ceil(1.5 * len(c.train) / BATCH) for c in exp.clients}
    scored = [r for r in rows if r.get("scope") == "personal/clients"]
    assert len(scored) == 2
    for row in scored:
        assert {c: s["adapt_passes"] for c, s in row["per_client"].items()} == expected
    compute = summary["compute"]
    assert compute["train_passes_per_client_round"] == STEPS
    assert compute["adapt_passes_per_client"] == pytest.approx(
        sum(expected.values()) / len(expected)
    )


def test_perfedavg_adaptation_step_is_one_pass_at_scoring(tmp_path: Path) -> None:
    _, _, summary = _run(tmp_path, 'algorithm.name="perfedavg"', 'algorithm.variant="fo"')
    assert summary["compute"]["adapt_passes_per_client"] == 1.0


def test_a_method_without_scoring_passes_reports_none(tmp_path: Path) -> None:
    summary = _check(tmp_path, float(2 * STEPS), 'algorithm.name="ditto"')
    assert "adapt_passes_per_client" not in summary["compute"]


def test_centralized_trains_no_client(tmp_path: Path) -> None:
    """One pooled party trains S steps a round; no client trains."""
    _, rows, summary = _run(tmp_path, 'algorithm.name="centralized"')
    assert [list(p.values()) for p in _train_passes(rows)] == [[STEPS], [STEPS]]
    assert summary["compute"]["train_passes_per_client_round"] == 0.0
    assert summary["compute"]["pooled_passes_per_round"] == STEPS


def test_clients_trained_together_count_one_pass_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedloom.runtime import clients
    from fedloom.train.together import train_together

    groups: list[list[int]] = []
    monkeypatch.setattr(
        clients,
        "train_together",
        lambda ctxs, starts: (
            groups.append([c.client_id for c in ctxs]) or train_together(ctxs, starts)
        ),
    )
    _check(tmp_path, float(STEPS), "train.clients_per_pass=3")
    assert groups == [[0, 1, 2], [0, 1, 2]]  # the batched path did train them


def test_dp_sgd_counts_its_steps(tmp_path: Path) -> None:
    """A Poisson rate of 1 (batch ≥ every client's examples) draws no empty batch: a pass a
    step."""
    _check(
        tmp_path,
        float(STEPS),
        'privacy.level="sample"',
        "privacy.noise_multiplier=1.0",
        "train.batch_size=64",
    )


def test_fedmosaic_counts_its_anchor_gradients(tmp_path: Path) -> None:
    """S training steps plus ⌈S / grad_every⌉ anchor gradients for the task vector."""
    _check(
        tmp_path,
        float(4 + math.ceil(4 / 3)),
        'algorithm.name="fedmosaic"',
        "algorithm.grad_every=3",
        "train.local_steps=4",
    )

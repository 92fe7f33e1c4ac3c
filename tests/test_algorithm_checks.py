"""An algorithm's hyperparameters checked against the model and the federation before
anything is written: ``fedloom run`` exits 2 with one line naming the key, and leaves no
run directory behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w
import torch
from conftest import needs_glue, tiny_raw
from typer.testing import CliRunner

from fedloom import algorithms
from fedloom.cli import app
from fedloom.config import TrainConfig

runner = CliRunner()


def run_with(tmp_path: Path, *overrides: str):
    """``fedloom run`` of the tiny config with ``overrides``, runs under tmp_path/runs."""
    config = tmp_path / "tiny.toml"
    config.write_text(tomli_w.dumps(tiny_raw(*overrides)))
    return runner.invoke(app, ["run", "--no-report", str(config), "--output-dir", str(tmp_path / "runs")],
                         catch_exceptions=False)


def assert_refused(result, runs: Path, *fragments: str) -> None:
    """Exit 2, one stderr line naming every fragment, no run directory."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())


# --- through the CLI ------------------------------------------------------------------------


@needs_glue
def test_a_personal_pattern_that_selects_nothing_stops_the_run_before_it_starts(
    tmp_path: Path,
) -> None:
    result = run_with(tmp_path, "algorithm.name=fedper", 'algorithm.personal=["no_such_tensor"]')
    assert_refused(result, tmp_path / "runs",
                   "algorithm.personal: ['no_such_tensor'] selects no tensor")


def test_more_ifca_clusters_than_clients_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    result = run_with(tmp_path, "algorithm.name=ifca", "algorithm.num_clusters=5",
                      "partition.num_clients=2")
    assert_refused(result, tmp_path / "runs", "algorithm.num_clusters: 5", "2 clients")


def test_an_overshooting_l2gd_step_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    # θ = lr·λ(1−p)/p = 5e-3 · 300 · 0.5 / 0.5 = 1.5 (train.lr 5e-3, p = 1 / local_steps = 0.5)
    result = run_with(tmp_path, "algorithm.name=l2gd", "algorithm.lam=300.0")
    assert_refused(result, tmp_path / "runs", "algorithm.lam: the aggregation step θ",
                   "= 1.5 > 1", "train.lr")


def test_l2gd_without_p_on_one_local_step_stops_the_run_before_it_starts(
    tmp_path: Path,
) -> None:
    result = run_with(tmp_path, "algorithm.name=l2gd", "train.local_steps=1")
    assert_refused(result, tmp_path / "runs", "algorithm.p: unset", "train.local_steps >= 2")


# --- the checks themselves ------------------------------------------------------------------


def test_an_algorithm_without_model_checks_accepts_any_adapter() -> None:
    algorithms.create("fedavg").check_model({"x.lora_A.weight": torch.zeros(1)})


@pytest.mark.parametrize(
    ("name", "hp", "per_round", "clients", "message"),
    [
        # k-means seeds IFCA's clusters from the first round's clients: at most that many
        ("ifca", {"num_clusters": 5}, 2, 2, "algorithm.num_clusters: 5 clusters .* 2 clients"),
        ("ifca", {"num_clusters": 3}, 2, 4, "algorithm.num_clusters: 3 clusters .* 2 clients"),
        # random clusters need no seeding, but K clients fill at most K of them
        ("ifca", {"num_clusters": 5, "initialization": "random"}, 4, 4,
         "algorithm.num_clusters: 5 clusters .* 4 clients"),
        ("fedem", {"num_components": 4}, 3, 10,
         "algorithm.num_components: 4 components .* 3 clients"),
        # SCAFFOLD's N is the federation's K: any other value scales c's step wrongly
        ("scaffold", {"num_clients": 2}, 2, 3, "algorithm.num_clients: 2, .* 3 clients"),
        ("scaffold", {"num_clients": 10}, 3, 3, "algorithm.num_clients: 10, .* 3 clients"),
    ],
)
def test_what_the_federation_cannot_give_is_refused(
    name: str, hp: dict, per_round: int, clients: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        algorithms.create(name, **hp).check_federation(per_round, clients)


@pytest.mark.parametrize(
    ("name", "hp", "per_round", "clients"),
    [
        ("ifca", {"num_clusters": 2}, 2, 2),
        ("ifca", {"num_clusters": 4, "initialization": "random"}, 2, 4),
        ("fedem", {"num_components": 3}, 3, 3),
        # random components are not seeded from clients: a mixture may have more than K
        ("fedem", {"num_components": 5, "initialization": "random"}, 2, 2),
        ("scaffold", {"num_clients": 10}, 3, 10),
    ],
)
def test_what_the_federation_can_give_passes(
    name: str, hp: dict, per_round: int, clients: int
) -> None:
    algorithms.create(name, **hp).check_federation(per_round, clients)


@pytest.mark.parametrize(
    ("hp", "train", "message"),
    [
        # θ at train.lr: 0.01 · 100 · 0.75 / 0.25 = 3
        ({"lam": 100.0}, {"local_steps": 4, "lr": 1e-2},
         r"algorithm.lam: .* = 3 > 1 .*\(train.lr 0.01, λ 100, p 0.25\)"),
        # the LoRA rate is fine (θ = 0.3), the head's is not (θ = 3)
        ({"lam": 100.0}, {"local_steps": 4, "lr": 1e-3, "head_lr": 1e-2},
         r"algorithm.lam: .* = 3 > 1 .*train.head_lr 0.01"),
        # p set: θ = 0.1 · 1 · 0.9 / 0.1 = 0.9 at lr 0.1, 1.8 at 0.2
        ({"p": 0.1}, {"local_steps": 4, "lr": 0.2}, r"algorithm.lam: .* = 1.8 > 1"),
        # p unset needs a budget in steps: an epoch is a different number of steps on
        # every client, and the coin is shared
        ({}, {"local_epochs": 1.0}, r"algorithm.p: unset, .* train.local_epochs = 1 "),
        ({}, {"local_steps": 1}, r"algorithm.p: unset, .* \(got 1\)"),
    ],
)
def test_what_the_training_settings_cannot_give_is_refused(
    hp: dict, train: dict, message: str
) -> None:
    settings = TrainConfig(**train)
    with pytest.raises(ValueError, match=message):
        algorithms.create("l2gd", **hp).check_training(settings)


@pytest.mark.parametrize(
    ("name", "hp", "train"),
    [
        ("fedavg", {}, {"lr": 10.0, "local_steps": 1}),  # nothing to check by default
        ("l2gd", {"lam": 100.0}, {"local_steps": 4, "lr": 3e-3, "head_lr": 3e-3}),  # θ = 0.9
        ("l2gd", {"lam": 1.0, "p": 0.5}, {"local_steps": 1, "lr": 1.0}),  # θ = 1 exactly
        ("l2gd", {"p": 0.3}, {"local_epochs": 2.0}),  # p set: the budget may be epochs
    ],
)
def test_what_the_training_settings_can_give_passes(name: str, hp: dict, train: dict) -> None:
    algorithms.create(name, **hp).check_training(TrainConfig(**train))

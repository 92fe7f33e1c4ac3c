"""Bad settings (issue 66): each refused in one line naming its key, with exit status 2 on
the command line, before the run starts wherever it can be known then; and the names of
the user's that reach the terminal printed as they are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch
from conftest import needs_glue, run_tiny_cli, tiny_raw
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.cli.consoles import out_console
from fedloom.cli.tables import summary_table
from fedloom.config import ConfigError, validate
from fedloom.experiment import ClientData, build_algorithm, check_chain, check_secure_weights
from fedloom.secagg import SecAggConfig
from fedloom.transforms.secure_sum import SecureSum


def refusal(*overrides: str, build: bool = False) -> str:
    """The one-line refusal of the tiny config with ``overrides``: by validation, or
    (``build``) by the checks of the algorithm and its settings, which read no data."""
    with pytest.raises(ConfigError) as info:
        cfg = validate(tiny_raw(*overrides))
        if build:
            build_algorithm(cfg)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def run_cli(tmp_path: Path, *overrides: str) -> list[str]:
    """``fedloom run`` of the tiny config: its exit status 2 checked, nothing written under
    the output directory, and its stderr lines."""
    result = run_tiny_cli(tmp_path, *overrides)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert not (tmp_path / "runs").exists()
    return result.stderr.strip().splitlines()


# --- floats: finite, unless inf means something -------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["train.lr=inf"], "train.lr"),
        (["train.lr=nan"], "train.lr"),
        (["privacy.level=client", "privacy.noise_multiplier=inf"], "privacy.noise_multiplier"),
        (["privacy.level=client", "privacy.noise_multiplier=nan"], "privacy.noise_multiplier"),
        (["privacy.level=client", "privacy.clip_norm=inf"], "privacy.clip_norm"),
        (["secagg.protocol=secagg+", "secagg.clip_range=inf"], "secagg.clip_range"),
        (["attack.name=sign_flip", "attack.fraction=nan"], "attack.fraction"),
    ],
)
def test_a_non_finite_setting_is_refused_by_key(overrides: list[str], key: str) -> None:
    assert refusal(*overrides).startswith(f"{key}: Input should be a finite number (got ")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["attack.name=sign_flip", "attack.fraction=0.34", "attack.scale=inf"],
            "attack.scale: expected a finite number for sign_flip (got inf)",
        ),
        (
            ["algorithm.name=fedprox", "algorithm.proximal_mu=nan"],
            "algorithm.proximal_mu: expected a finite number for fedprox (got nan)",
        ),
        (
            ['transforms=[{name = "clip_update", max_norm = inf}]'],
            "transforms[0].max_norm: expected a finite number for clip_update (got inf)",
        ),
    ],
)
def test_a_non_finite_hyperparameter_is_refused_by_key(overrides: list[str], message: str) -> None:
    assert refusal(*overrides, build=True) == message


def test_inf_stays_allowed_where_it_means_something() -> None:
    """(p, s)-quantization's ℓ∞ norm."""
    spec = '[{name = "compress", compressor = "ps_quant", norm = inf}]'
    build_algorithm(validate(tiny_raw(f"transforms={spec}")))


def test_the_cli_refuses_an_infinite_learning_rate_with_exit_2(tmp_path: Path) -> None:
    lines = run_cli(tmp_path, "train.lr=inf")
    assert lines == ["error: train.lr: Input should be a finite number (got inf)"]


# --- settings that would do nothing, or nothing sensible ----------------------------------


@pytest.mark.parametrize("level", ["client", "sample"])
def test_no_noise_with_privacy_on_is_refused(level: str) -> None:
    message = refusal(f"privacy.level={level}", "privacy.noise_multiplier=0.0")
    assert message.startswith("privacy.noise_multiplier: 0 adds no noise")
    assert "set privacy.level = 'off'" in message


def test_a_target_epsilon_reached_only_as_zero_is_refused() -> None:
    """ε = 0 at δ = 1/3^1.1 = 0.299: δ alone would be the guarantee."""
    message = refusal("privacy.level=client", "privacy.target_epsilon=1e-12", build=True)
    assert message.startswith(
        "privacy.target_epsilon: 1e-12 is reached only as epsilon = 0 at delta = 0.299 "
        "(1/K^1.1 for K = 3 clients)"
    )
    assert "privacy.delta" in message


def test_a_delta_at_which_the_run_has_epsilon_zero_is_refused() -> None:
    message = refusal("privacy.level=client", "privacy.noise_multiplier=5.0", build=True)
    assert message.startswith("privacy.delta: at delta = 0.299 (1/K^1.1 for K = 3 clients), ")
    assert "gives the run epsilon = 0" in message
    build_algorithm(
        validate(
            tiny_raw("privacy.level=client", "privacy.noise_multiplier=5.0", "privacy.delta=1e-5")
        )
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["attack.fraction=0.0"], "attack.fraction: 0 makes no client an attacker"),
        (["attack.clients=[]"], "attack.clients: [] names no attacker"),
    ],
)
def test_an_attack_without_attackers_is_refused(overrides: list[str], message: str) -> None:
    assert refusal("attack.name=sign_flip", *overrides).startswith(message)


def test_a_secagg_setting_without_the_protocol_is_refused_but_defaults_are_not() -> None:
    assert refusal("secagg.threshold=2") == (
        'secagg.threshold: only with secure aggregation (secagg.protocol is "none")'
    )
    validate(tiny_raw("secagg.bits=32", "secagg.clip_range=1.0"))


# --- secure aggregation: the bits against the weights it sums -----------------------------


def test_secagg_bits_that_leave_too_few_bits_per_value_are_refused_before_data() -> None:
    message = refusal("secagg.protocol=secagg+", "secagg.bits=8", build=True)
    assert message == (
        "secagg.bits: 8 leaves 6 bits per value (63 steps over [-c, c]) for the lightest round "
        "(3 clients, each weighing at least 1); at least 8 are needed: raise secagg.bits to 10 "
        "or more, or set secagg.quant_bits to quantize coarser on purpose"
    )


def test_secagg_bits_are_checked_against_the_clients_examples_once_partitioned() -> None:
    """3 clients of 40 training examples weigh 120: 12 bits leave 5 per value (the config
    alone, 3 clients of weight 1 or more, allowed 10)."""
    cfg = validate(tiny_raw("secagg.protocol=secagg+", "secagg.bits=12"))
    algorithm = build_algorithm(cfg)
    clients = [ClientData(cid, [None] * 40, []) for cid in range(3)]  # type: ignore[list-item]
    with pytest.raises(ConfigError) as info:
        check_secure_weights(cfg, algorithm, clients)
    assert str(info.value).startswith(
        "secagg.bits: 12 leaves 5 bits per value (31 steps over [-c, c]) for the heaviest "
        "round the partition allows (3 clients of 120 training examples in all, each "
        "weighing its examples); at least 8 are needed"
    )
    assert "raise secagg.bits to 15 or more" in str(info.value)
    check_secure_weights(cfg, algorithm, [ClientData(cid, [None], []) for cid in range(3)])  # type: ignore[list-item]


def test_a_fixed_quant_bits_is_checked_against_the_weights_too() -> None:
    cfg = validate(tiny_raw("secagg.protocol=secagg+", "secagg.bits=12", "secagg.quant_bits=6"))
    clients = [ClientData(cid, [None] * 40, []) for cid in range(3)]  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"^secagg\.bits: the weighted sum of the heaviest "):
        check_secure_weights(cfg, build_algorithm(cfg), clients)


def test_a_round_too_heavy_for_the_bits_names_its_weight_not_clients() -> None:
    secure = SecureSum(SecAggConfig(bits=6))
    with pytest.raises(ValueError) as info:
        secure.setup({0: 40, 1: 40}, 0, 10)
    assert str(info.value) == (
        "secagg.bits: 6 bits cannot hold the weighted sum of round 1 even at one bit per "
        "value: its clients weigh 80 in all; it needs secagg.bits = 7 or more"
    )


@needs_glue
def test_the_cli_refuses_secagg_bits_too_few_for_the_partition_with_exit_2(
    tmp_path: Path,
) -> None:
    """6 clients of 8 training examples weigh 48: 12 bits leave 6 per value."""
    lines = run_cli(tmp_path, "secagg.protocol=secagg+", "secagg.bits=12")
    assert len(lines) == 1 and lines[0].startswith("error: secagg.bits: 12 leaves 6 bits"), lines


# --- what the model shows: PowerSGD's rank ------------------------------------------------


def test_a_powersgd_rank_that_compresses_no_matrix_is_refused_naming_the_widest() -> None:
    adapter = {
        "a.lora_A": torch.zeros(4, 32),
        "a.lora_B": torch.zeros(32, 4),
        "bias": torch.zeros(2),
    }

    class Model:
        initial_params = adapter

    for key in ("compress", "compress_down"):
        cfg = validate(
            tiny_raw(f'transforms=[{{name = "{key}", compressor = "powersgd", rank = 4}}]')
        )
        with pytest.raises(ConfigError) as info:
            check_chain(cfg, build_algorithm(cfg), Model())  # type: ignore[arg-type]
        assert str(info.value) == (
            "transforms[0].rank: 4 is not below the smaller side of any matrix sent (the "
            "widest is 4 x 32), so powersgd would send each one whole, as factors no smaller "
            "than the matrix; use a rank below 4"
        )
    cfg = validate(
        tiny_raw('transforms=[{name = "compress_down", compressor = "powersgd", rank = 3}]')
    )
    check_chain(cfg, build_algorithm(cfg), Model())  # type: ignore[arg-type]


# --- keys and names as the terminal shows them --------------------------------------------


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"transforms": [{"name": "clip_update"}, {"name": 3}]}, "transforms[1].name"),
        ({"model": {"groups": [{"clients": [1], "backbone": 3}]}}, "model.groups[0].backbone"),
        ({"eval": {"metrics": ["accuracy", 3]}}, "eval.metrics[1]"),
        ({"faults": {"speeds": {"3": -1.0}}}, "faults.speeds.3"),
    ],
)
def test_an_array_entry_is_named_by_its_index(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(raw)
    assert str(info.value).startswith(f"{key}: ")


def test_a_summary_prints_names_with_markup_as_they_are() -> None:
    summary = {
        "name": "x",
        "algorithm": "fedavg",
        "task": "[bold]t[/bold]",
        "label_names": ["[/red]", ":smile:"],
        "global": {"dev": {"n": 4, "accuracy": 0.5}},
    }
    with out_console.capture() as captured:
        out_console.print(summary_table(summary))
    text = captured.get()
    assert "x: fedavg on [bold]t[/bold]" in text and "labels: [/red], :smile:" in text


def test_the_cli_prints_a_partition_of_labels_with_markup(tmp_path: Path) -> None:
    labels = ["[/bold]", ":smile: [red]"]
    rows = [{"text": f"example {i}", "label": labels[i % 2]} for i in range(40)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = tmp_path / "c.toml"
    config.write_text(
        tomli_w.dumps(
            {
                "data": {"task": "[bold]t", "train_path": str(tmp_path / "train.jsonl")},
                "partition": {"num_clients": 2, "min_size": 2},
            }
        )
    )
    result = CliRunner().invoke(
        app, ["partition", str(config), "--heatmap", str(tmp_path / "h.png")]
    )
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert all(label in result.stdout for label in labels)

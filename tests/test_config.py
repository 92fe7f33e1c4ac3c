"""The experiment schema: defaults, one-line errors naming the dotted key, --set overrides,
and the resolved config's TOML round trip."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pydantic
import pytest
import tomli_w

from fedloom.config import (
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    load_config,
    parse_override,
    to_toml_dict,
    validate,
)


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate(raw)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- defaults -----------------------------------------------------------------------------


def test_defaults_validate() -> None:
    cfg = validate({})
    assert cfg == ExperimentConfig()
    assert cfg.data.task == "MRPC"
    assert cfg.algorithm.name == "fedavg"
    assert cfg.algorithm.hyperparameters == {}
    assert cfg.train.local_epochs == 1.0 and cfg.train.local_steps is None
    assert cfg.model.lora.target_modules == "auto"
    assert cfg.federation.fraction == 1.0


def test_config_is_frozen() -> None:
    cfg = validate({})
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.train.lr = 5.0  # type: ignore[misc]


# --- unknown keys, wrong types, impossible values -----------------------------------------


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"nmae": "x"}, "nmae"),
        ({"train": {"lrr": 0.1}}, "train.lrr"),
        ({"model": {"lora": {"rank": 4}}}, "model.lora.rank"),
        ({"federation": {"round": 3}}, "federation.round"),
        ({"surprise": {"section": 1}}, "surprise"),
    ],
)
def test_unknown_key_names_the_dotted_key(raw: dict, key: str) -> None:
    message = error_of(raw)
    assert message.startswith(f"{key}: "), message
    assert "unknown key" in message


@pytest.mark.parametrize(
    ("raw", "key", "got"),
    [
        ({"train": {"batch_size": "big"}}, "train.batch_size", "'big'"),
        ({"train": {"bf16": "maybe"}}, "train.bf16", "'maybe'"),
        ({"data": {"text_fields": "sentence"}}, "data.text_fields", "'sentence'"),
        ({"federation": {"rounds": 2.5}}, "federation.rounds", "2.5"),
        ({"train": {"schedule": "exponential"}}, "train.schedule", "'exponential'"),
        ({"model": {"lora": {"target_modules": "all"}}}, "model.lora.target_modules", "'all'"),
    ],
)
def test_wrong_type_names_the_key_and_the_value(raw: dict, key: str, got: str) -> None:
    message = error_of(raw)
    assert message.startswith(f"{key}: "), message
    assert f"(got {got})" in message


def test_section_of_the_wrong_type() -> None:
    assert error_of({"train": 5}).startswith("train: ")


@pytest.mark.parametrize(
    ("raw", "key", "fragment"),
    [
        ({"federation": {"fraction": 1.5}}, "federation.fraction", "less than or equal to 1"),
        ({"federation": {"fraction": 0}}, "federation.fraction", "greater than 0"),
        ({"partition": {"test_fraction": 1.0}}, "partition.test_fraction", "less than 1"),
        ({"partition": {"num_clients": 0}}, "partition.num_clients", "greater than or equal"),
        ({"train": {"lr": -0.001}}, "train.lr", "greater than 0"),
        ({"train": {"head_lr": 0}}, "train.head_lr", "greater than 0"),
        ({"train": {"local_epochs": -1}}, "train.local_epochs", "greater than 0"),
        ({"train": {"warmup_ratio": 1.0}}, "train.warmup_ratio", "less than 1"),
        ({"model": {"lora": {"r": 0}}}, "model.lora.r", "greater than or equal to 1"),
        ({"model": {"lora": {"dropout": 1.0}}}, "model.lora.dropout", "less than 1"),
        ({"data": {"text_fields": ["a", "b", "c"]}}, "data.text_fields", "at most 2"),
        ({"data": {"max_length": 4}}, "data.max_length", "greater than or equal to 8"),
        ({"name": "my run"}, "name", "pattern"),
    ],
)
def test_impossible_values(raw: dict, key: str, fragment: str) -> None:
    message = error_of(raw)
    assert message.startswith(f"{key}: "), message
    assert fragment in message


def test_several_mistakes_are_all_named_on_one_line() -> None:
    message = error_of({"train": {"lr": -1, "batch_size": 0}, "federation": {"rounds": True}})
    parts = message.split("; ")
    assert sorted(p.split(":")[0] for p in parts) == ["federation.rounds", "train.batch_size",
                                                      "train.lr"], message
    assert "train.lr: Input should be greater than 0 (got -1)" in parts
    assert "train.batch_size: Input should be greater than or equal to 1 (got 0)" in parts


def test_a_union_key_is_named_once() -> None:
    message = error_of({"model": {"lora": {"target_modules": "all"}}})
    assert message.count("model.lora.target_modules") == 1, message


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"train": {"batch_size": True}}, "train.batch_size"),
        ({"train": {"lr": True}}, "train.lr"),
        ({"train": {"head_lr": False}}, "train.head_lr"),
        ({"federation": {"rounds": True}}, "federation.rounds"),
        ({"federation": {"fraction": True}}, "federation.fraction"),
        ({"partition": {"num_clients": True}}, "partition.num_clients"),
        ({"model": {"lora": {"r": True}}}, "model.lora.r"),
        ({"data": {"max_length": "128"}}, "data.max_length"),
        ({"seed": True}, "seed"),
        ({"eval": {"every": 1.0}}, "eval.every"),
        ({"train": {"bf16": 1}}, "train.bf16"),
        ({"name": 5}, "name"),
    ],
)
def test_no_silent_coercion(raw: dict, key: str) -> None:
    """A bool is not a number, a number not a bool or a string, 1.0 not an int."""
    message = error_of(raw)
    assert message.startswith(f"{key}: "), message
    assert "(got " in message


def test_an_int_is_a_float() -> None:
    cfg = validate({"train": {"lr": 1, "local_epochs": 2}, "federation": {"fraction": 1}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.local_epochs == 2.0


@pytest.mark.parametrize(
    ("raw", "key", "fragment"),
    [
        ({"federation": {"min_clients": 4}}, "federation.min_clients", "more than the 3 clients"),
        ({"federation": {"rounds": 2}, "partition": {"temporal": {"start_round": 3, "end_round": 4}}},
         "partition.temporal.start_round", "after the last round"),
    ],
)
def test_settings_that_contradict_another_section(raw: dict, key: str, fragment: str) -> None:
    message = error_of(raw)
    assert message.startswith(f"{key}: "), message
    assert fragment in message


def test_clients_per_round() -> None:
    assert validate({"partition": {"num_clients": 10}}).clients_per_round == 10
    cfg = validate({"partition": {"num_clients": 10}, "federation": {"fraction": 0.25}})
    assert cfg.clients_per_round == 3
    cfg = validate({"partition": {"num_clients": 10},
                    "federation": {"fraction": 0.1, "min_clients": 4}})
    assert cfg.clients_per_round == 4


# --- local_steps vs local_epochs ----------------------------------------------------------


def test_local_steps_alone_replaces_the_default_epochs() -> None:
    cfg = validate({"train": {"local_steps": 7}})
    assert cfg.train.local_steps == 7
    assert cfg.train.local_epochs is None


def test_local_epochs_alone() -> None:
    cfg = validate({"train": {"local_epochs": 2.5}})
    assert cfg.train.local_epochs == 2.5 and cfg.train.local_steps is None


def test_local_steps_and_local_epochs_together_is_an_error() -> None:
    message = error_of({"train": {"local_steps": 3, "local_epochs": 2}})
    assert message.startswith("train: ")
    assert "local_epochs" in message and "local_steps" in message


def test_neither_local_steps_nor_local_epochs_is_an_error() -> None:
    message = error_of({"train": {"local_epochs": None}})
    assert message.startswith("train: ")
    assert "required" in message


def test_local_steps_must_be_positive() -> None:
    assert error_of({"train": {"local_steps": 0}}).startswith("train.local_steps: ")


# --- algorithm section --------------------------------------------------------------------


def test_algorithm_section_keeps_hyperparameters() -> None:
    cfg = validate({"algorithm": {"name": "fedavg", "weighting": "capped", "cap": 40}})
    assert cfg.algorithm.name == "fedavg"
    assert cfg.algorithm.hyperparameters == {"weighting": "capped", "cap": 40}


# --- --set parsing ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path", "value"),
    [
        ("train.lr=0.01", ["train", "lr"], 0.01),
        ("train.lr=1e-3", ["train", "lr"], 1e-3),
        ("federation.rounds=5", ["federation", "rounds"], 5),
        ("train.bf16=true", ["train", "bf16"], True),
        ('model.lora.target_modules=["query"]', ["model", "lora", "target_modules"], ["query"]),
        ("data.task=MRPC", ["data", "task"], "MRPC"),
        ('data.task="STS-B"', ["data", "task"], "STS-B"),
        ("output_dir=/tmp/some where", ["output_dir"], "/tmp/some where"),
        ("data.task = RTE", ["data", "task"], "RTE"),
        ("name=a=b", ["name"], "a=b"),
    ],
)
def test_parse_override(text: str, path: list[str], value: object) -> None:
    got_path, got_value = parse_override(text)
    assert got_path == path
    assert got_value == value
    assert type(got_value) is type(value)


@pytest.mark.parametrize("text", ["train.lr", "train..lr=1", ".lr=1", "train.=1"])
def test_bad_override_syntax(text: str) -> None:
    with pytest.raises(ConfigError, match="--set"):
        parse_override(text)


def test_apply_overrides_creates_nested_sections() -> None:
    raw = apply_overrides({}, ["model.lora.r=4", "model.backbone=tiny-bert", "seed=3"])
    assert raw == {"model": {"lora": {"r": 4}, "backbone": "tiny-bert"}, "seed": 3}
    cfg = validate(raw)
    assert cfg.model.lora.r == 4
    assert cfg.model.lora.alpha == 32.0  # untouched siblings keep their defaults
    assert cfg.model.backbone == "tiny-bert"


def test_apply_overrides_merges_into_existing_sections() -> None:
    raw = {"train": {"lr": 0.1, "batch_size": 4}}
    apply_overrides(raw, ["train.lr=0.5"])
    assert raw == {"train": {"lr": 0.5, "batch_size": 4}}


def test_override_later_wins() -> None:
    raw = apply_overrides({}, ["train.lr=0.1", "train.lr=0.2"])
    assert raw["train"]["lr"] == 0.2


def test_override_through_a_scalar_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^seed\.x: seed is not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])


def test_override_into_an_unknown_new_section_is_validated() -> None:
    raw = apply_overrides({}, ["trian.lr=0.1"])
    with pytest.raises(ConfigError, match=r"^trian: unknown key"):
        validate(raw)


# --- files --------------------------------------------------------------------------------


def test_load_config_applies_overrides_before_validation(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text('name = "x"\n[train]\nlr = 0.1\n[federation]\nfraction = 0.5\n')
    cfg = load_config(path, ["train.lr=0.02"])
    assert cfg.name == "x" and cfg.train.lr == 0.02 and cfg.federation.fraction == 0.5
    with pytest.raises(ConfigError, match=r"^federation\.fraction: "):
        load_config(path, ["federation.fraction=1.5"])


def test_load_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[train]\nlrr = 0.1\n")
    with pytest.raises(ConfigError, match=r"^train\.lrr: unknown key"):
        load_config(unknown)
    with pytest.raises(ConfigError, match="is a directory, not a config file"):
        load_config(tmp_path)
    latin = tmp_path / "latin.toml"
    latin.write_bytes('name = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="latin.toml: not a UTF-8 text file"):
        load_config(latin)


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"train": {"local_steps": 5}},
        {
            "name": "round-trip",
            "seed": 7,
            "data": {"task": "RTE", "text_fields": ["premise", "hypothesis"], "label_names": ["a", "b"]},
            "model": {"backbone": "tiny-llama", "lora": {"r": 4, "target_modules": ["q_proj"]}},
            "algorithm": {"name": "fedavg", "weighting": "capped", "cap": 12.5},
            "federation": {"rounds": 9, "fraction": 0.25},
            "train": {"head_lr": 0.003, "clip_norm": 0.5, "optimizer_state": "reset"},
        },
    ],
)
def test_to_toml_dict_round_trips(tmp_path: Path, raw: dict) -> None:
    cfg = validate(raw)
    data = to_toml_dict(cfg)
    text = tomli_w.dumps(data)
    assert tomllib.loads(text) == data
    path = tmp_path / "config.toml"
    path.write_text(text)
    assert load_config(path) == cfg


def test_to_toml_dict_drops_none() -> None:
    data = to_toml_dict(validate({"train": {"local_steps": 5}}))
    assert "local_epochs" not in data["train"]
    assert data["train"]["local_steps"] == 5
    assert "data_dir" not in data["data"]


def test_to_toml_dict_keeps_disabled_clipping(tmp_path: Path) -> None:
    cfg = validate({"train": {"clip_norm": 0}})
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(to_toml_dict(cfg)))
    assert load_config(path).train.clip_norm == 0


def test_override_of_a_step_budget_replaces_the_epoch_budget() -> None:
    raw = {"train": {"local_epochs": 2.0}}
    cfg = validate(apply_overrides(raw, ["train.local_steps=8"]))
    assert cfg.train.local_steps == 8 and cfg.train.local_epochs is None
    cfg = validate(apply_overrides({"train": {"local_steps": 8}}, ["train.local_epochs=0.5"]))
    assert cfg.train.local_epochs == 0.5 and cfg.train.local_steps is None
    # both in the same file is still a mistake
    with pytest.raises(ConfigError, match="either local_epochs or local_steps"):
        validate({"train": {"local_epochs": 2.0, "local_steps": 8}})

"""A Flower node runs the server's experiment: it refuses one that differs from its own
config file in a setting that shapes what a client computes, naming the first keys and
both values; its own machine's settings and the server's own bookkeeping may differ
(issue 36). The loopback deployment with a refusing node is in test_flower_runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w
from conftest import tiny_raw

from fedloom.config import validate
from fedloom.runtime.agreement import disagreements, refusal

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict

from fedloom.runtime.flower_node import node_refusal


def _cfg(*overrides: str):
    return validate(tiny_raw(*overrides))


def test_the_same_experiment_agrees_even_with_defaults_spelled_out() -> None:
    assert disagreements(_cfg(), _cfg()) == []
    assert disagreements(_cfg(), _cfg("train.optimizer=adamw", "partition.min_size=5")) == []


def test_a_nodes_own_machine_and_the_servers_bookkeeping_may_differ() -> None:
    node = _cfg('data.data_dir="/elsewhere"', 'train.device="cpu"', "runtime.cpus_per_worker=4",
                'output_dir="/tmp/x"', 'name="other"', "eval.every=2", "checkpoint.every=3")
    assert disagreements(_cfg(), node) == []


def test_every_differing_setting_is_named_with_both_values_in_config_order() -> None:
    server = _cfg("train.local_steps=4", "partition.num_clients=2")
    node = _cfg("train.lr=0.1", "seed=3", "algorithm.name=ditto", "privacy.level=client")
    keys = [k for k, _, _ in disagreements(server, node)]
    assert keys[:3] == ["seed", "partition.num_clients", "algorithm.name"]
    assert {"train.local_steps", "train.lr", "privacy.level"} <= set(keys)
    line = refusal(server, node, "site.toml")
    assert line.startswith(
        "the server's experiment differs from site.toml: seed: the server's 0, site.toml's 3; "
        "partition.num_clients: the server's 2, site.toml's 3; algorithm.name: the server's "
        "'fedavg', site.toml's 'ditto' (and ")
    assert refusal(server, server, "site.toml") == ""


def _context(client_id: int, **node: str) -> Context:
    return Context(0, 1, {"client-id": client_id, **node}, RecordDict(), {})


def _served(*overrides: str) -> str:
    return tomli_w.dumps(tiny_raw(*overrides))


def test_a_node_refuses_another_experiment_than_its_config_file(tmp_path: Path) -> None:
    own = tmp_path / "experiment.toml"
    own.write_text(tomli_w.dumps(tiny_raw()))
    server = _served("train.local_steps=4")
    assert node_refusal(server, _context(0, **{"config-file": str(own)}), 0) == (
        "the server's experiment differs from experiment.toml: "
        "train.local_steps: the server's 4, experiment.toml's 2")
    assert node_refusal(_served(), _context(0, **{"config-file": str(own)}), 0) == ""
    assert node_refusal(server, _context(0), 0) == ""  # no file: the server's, unchecked
    own.write_text("[train]\nlocal_steps = 0\n")
    assert node_refusal(server, _context(0, **{"config-file": str(own)}), 0).startswith(
        "its config file does not load: ")


def test_a_node_outside_the_federation_or_with_the_wrong_data_refuses() -> None:
    assert node_refusal(_served(), _context(3), 3) == (
        "client 3 is not in the server's federation of 3 clients (partition.num_clients)")
    assert "this node holds its own data" in node_refusal(
        _served(), _context(1, **{"data-file": "/data/mine.jsonl"}), 1)
    nodes = _served('runtime.name="flower"', 'runtime.client_data="nodes"')
    assert "was started without its data" in node_refusal(nodes, _context(1), 1)


def test_join_without_a_client_id_or_superlink_is_one_line_and_exit_2() -> None:
    from typer.testing import CliRunner

    from fedloom.cli import app

    runner = CliRunner()
    missing_id = runner.invoke(app, ["join", "--superlink", "127.0.0.1:1"])
    assert missing_id.exit_code == 2 and "--client-id" in missing_id.stderr
    missing_link = runner.invoke(app, ["join", "--client-id", "0"])
    assert missing_link.exit_code == 2 and "--superlink" in missing_link.stderr

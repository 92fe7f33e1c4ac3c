"""A node answers the experiment it accepted, and paths on its machine are its own
(issue 66, item 4): a message carrying another experiment than the greeted one is
refused; the server's ``data.train_path``, ``data.dev_path``, ``data.data_dir`` and
``output_dir`` are never used on the node; ``[secagg]`` must agree; a node that named
no backbone downloads none."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tomli_w
from conftest import tiny_raw

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, RecordDict

from fedloom.config import validate
from fedloom.runtime import flower_node
from fedloom.runtime.agreement import disagreements
from fedloom.runtime.flower_node import GREETED, Hosts, answer, node_view


def _context(**node: str) -> Context:
    return Context(0, 1, {"client-id": 0, **node}, RecordDict(), {})


def _greet(config: str, context: Context) -> str:
    content = RecordDict({"fedloom": ConfigRecord({"op": "hello", "config": config})})
    return str(answer("query", content, context, Hosts())["fedloom"]["refusal"])


def _train(config: str, context: Context) -> RecordDict:
    content = RecordDict(
        {"fedloom": ConfigRecord({"client_id": 0, "verdict": "", "config": config})}
    )
    return answer("train", content, context, Hosts())


def test_a_message_with_another_experiment_than_the_greeted_one_is_refused() -> None:
    greeted, other = tomli_w.dumps(tiny_raw()), tomli_w.dumps(tiny_raw("train.lr=9.0"))
    context = _context()
    with pytest.raises(RuntimeError, match="other than the one the server greeted"):
        _train(greeted, context)  # no greeting yet
    assert _greet(greeted, context) == ""
    assert GREETED in context.state
    with pytest.raises(RuntimeError, match="other than the one the server greeted"):
        _train(other, context)
    # a refused greeting forgets the accepted experiment
    context.node_config["data-file"] = "mine.jsonl"  # against the server's partition
    assert "holds its own data" in _greet(greeted, context)
    assert GREETED not in context.state


def test_the_servers_paths_are_never_the_nodes(tmp_path: Path) -> None:
    server = tiny_raw('output_dir="/etc/fedloom"', 'data.data_dir="/etc"')
    server["data"].update(train_path="/etc/secret.jsonl", dev_path="/etc/dev.jsonl", task="custom")
    # a node without a file of its own refuses to read the server's file
    refusal = _greet(tomli_w.dumps(server), _context())
    assert "data.train_path" in refusal and "did not name" in refusal
    # a node with its own config reads its own paths, wherever the server points
    mine = tiny_raw(f'output_dir="{tmp_path / "runs"}"')
    mine["data"].update(train_path=str(tmp_path / "mine.jsonl"), task="custom")
    own = tmp_path / "site.toml"
    own.write_text(tomli_w.dumps(mine))
    view = node_view(server, _context(**{"config-file": str(own), "data-dir": str(tmp_path)}))
    assert view["data"]["train_path"] == str(tmp_path / "mine.jsonl")
    assert "dev_path" not in view["data"]  # the node names none
    assert view["data"]["data_dir"] == str(tmp_path)
    assert view["output_dir"] == str(tmp_path / "runs")
    # without a config file: the defaults, not the server's
    plain = node_view(tiny_raw('output_dir="/etc/x"', 'data.data_dir="/etc"'), _context())
    assert "data_dir" not in plain["data"] and "output_dir" not in plain
    assert "/etc" not in repr(plain)


def test_secure_aggregation_and_privacy_must_agree() -> None:
    server = validate(tiny_raw())
    node = validate(tiny_raw('secagg.protocol="secagg+"', "secagg.threshold=2"))
    assert any(key.startswith("secagg.") for key, _, _ in disagreements(server, node))


def test_a_node_without_its_own_config_downloads_no_backbone(monkeypatch) -> None:
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    flower_node._no_downloads(_context(**{"config-file": "site.toml"}))
    assert not huggingface_hub.constants.HF_HUB_OFFLINE  # it named its backbone
    flower_node._no_downloads(_context())
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE

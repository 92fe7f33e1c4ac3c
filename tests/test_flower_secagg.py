"""Secure aggregation on the Flower runtime, with the nodes answering in this process: the
server's side (:class:`FlowerClients`, the run of :func:`simulate`) and each node's
(:func:`fedloom.runtime.flower_node.answer` with the worker's :class:`Hosts`) exchange
Flower ``Message`` objects through a :class:`Grid` that records everything the server
pulls.

What is checked: a run equals the local runtime's run under the same secure aggregation;
the server never receives an update (train replies carry no arrays; what the masking
stage brings is uniform modulo 2^b, unlike the node's own input); a node that dies after
sharing its keys is a drop-out whose masks are recovered, and is missing from the rounds
after with its node's failure; a node without a worker refuses the experiment; CKKS runs
as locally. (Real SuperNodes, with one killed mid-protocol: test_flower_runtime.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from uuid import uuid4

import numpy as np
import pytest
import tomli_w
import torch
from conftest import needs_glue, tiny_raw
from scipy import stats

pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedloom.config import to_toml_dict, validate
from fedloom.experiment import Experiment
from fedloom.runtime import flower_app
from fedloom.runtime.flower_app import FlowerClients
from fedloom.runtime.flower_node import CLIENT_ID, WORKER, Hosts, answer
from fedloom.runtime.flower_records import FIELDS, secagg_message_from
from fedloom.runtime.rundir import RunDir
from fedloom.secagg.messages import MaskedInput
from fedloom.server import simulate

CLIENTS = 4


class NodesInProcess:
    """A Flower ``Grid`` whose nodes answer each message as it is pushed, as fedloom's
    ClientApp with a worker does; ``received`` is every reply the server pulled. A node
    in ``dies_after`` (client → (round, stage)) dies once it answered that stage: it
    leaves the federation, and Flower answers messages to it with an error."""

    def __init__(
        self, clients: int, dies_after: dict[int, tuple[int, str]] | None = None,
        worker: bool = True
    ) -> None:
        self.contexts = {
            100 + cid: Context(
                1, 100 + cid,
                {CLIENT_ID: cid, **({WORKER: "in this process"} if worker else {})},
                RecordDict(), {},
            )
            for cid in range(clients)
        }
        self.hosts = {node: Hosts() for node in self.contexts}
        self.dies_after = dies_after or {}
        self.dead: set[int] = set()
        self.replies: dict[str, Message] = {}
        self.received: list[tuple[str, Message]] = []

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.dead]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            mid = str(uuid4())
            message.metadata.__dict__["_message_id"] = mid  # as Flower's InMemoryGrid does
            node, kind = message.metadata.dst_node_id, message.metadata.message_type
            kind = "secagg" if kind == "train.secagg" else kind
            if node in self.dead:
                self.replies[mid] = Message(Error(4, "Node Unavailable"), reply_to=message)
            else:
                content = answer(kind, message.content, self.contexts[node], self.hosts[node])
                self.replies[mid] = Message(content, reply_to=message)
                fields = message.content.config_records[FIELDS]
                if self.dies_after.get(node - 100) == (fields.get("round"), fields.get("stage")):
                    self.dead.add(node)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = [(i, self.replies.pop(i)) for i in message_ids if i in self.replies]
        self.received.extend(out)
        return [m for _, m in out]


@pytest.fixture
def task_identity(monkeypatch):
    """A Flower message needs the identity of the task that sends it."""
    for key, value in {"_run_id": 1, "_node_id": 0, "_task_id": 1}.items():
        monkeypatch.setattr(TaskIdentity, key, value)


@pytest.fixture
def no_discovery_pause(monkeypatch):
    """The nodes here answer a message as it is pushed: :class:`FlowerClients` need not
    pause the half second it gives real SuperNodes to join before it greets them."""
    clock = SimpleNamespace(monotonic=time.monotonic, sleep=lambda seconds: None)
    monkeypatch.setattr(flower_app, "time", clock)


def _raw(tmp_path: Path, *overrides: str) -> dict:
    # Self / Others off, as on Flower by default (the local runs compared score it otherwise)
    return tiny_raw(f"partition.num_clients={CLIENTS}", "data.max_train_examples=60",
                    "federation.rounds=2", "secagg.protocol=secagg+", "eval.others='never'",
                    *overrides, output_dir=tmp_path)


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _on_flower(raw: dict, grid: NodesInProcess, tmp_path: Path) -> Path:
    """The run of ``raw`` as ``fedloom.runtime.flower_app.serve`` runs it over ``grid``."""
    cfg = validate({**raw, "runtime": {"name": "flower", "reply_timeout": 30}})
    run = RunDir.create(tmp_path / "flower", "tiny")
    clients = FlowerClients(grid, tomli_w.dumps(to_toml_dict(cfg)), list(range(CLIENTS)),
                            cfg.runtime)
    simulate(Experiment.build(cfg), run, None, clients=clients)
    return run.path


def _one_thread(fn):
    """``fn()`` with one torch thread, as every Flower node computes (the nodes here set
    it for this process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@needs_glue
def test_a_flower_run_equals_the_local_run_and_the_server_receives_only_masked_inputs(
        tmp_path: Path, task_identity, no_discovery_pause) -> None:
    raw = _raw(tmp_path)
    grid = NodesInProcess(CLIENTS)

    def both() -> tuple[Path, Path]:
        local = RunDir.create(tmp_path / "local", "tiny")
        simulate(Experiment.build(validate(raw)), local)
        return local.path, _on_flower(raw, grid, tmp_path)

    local, flower = _one_thread(both)
    assert _rows(flower) == _rows(local)
    train = [r for r in _rows(flower) if r["scope"] == "train"]
    assert [r["secagg"]["summed"] for r in train] == [CLIENTS, CLIENTS]

    kinds = {}
    masked: list[MaskedInput] = []
    for _, reply in grid.received:
        kinds[reply.metadata.message_type] = kinds.get(reply.metadata.message_type, 0) + 1
        if reply.metadata.message_type == "train":
            arrays = reply.content.array_records.values()
            assert not any(len(a) for a in arrays), "a train reply carried arrays"
        if isinstance(message := secagg_message_from(reply.content) if
                      reply.metadata.message_type == "train.secagg" else None, MaskedInput):
            masked.append(message)
    # 2 rounds: 4 train replies and 4 replies to each of the 4 stages
    assert kinds["train"] == 2 * CLIENTS and kinds["train.secagg"] == 2 * 4 * CLIENTS
    assert len(masked) == 2 * CLIENTS
    for y in masked[-CLIENTS:]:  # the last round's: the nodes still hold their inputs
        (host,) = grid.hosts[100 + y.client]._built.values()
        x = host.secure[y.client].secagg.quantized
        uniform = y.masked.astype(np.float64) / 2.0**y.bits
        assert stats.kstest(uniform, "uniform").pvalue > 1e-3
        assert stats.kstest(x.astype(np.float64) / 2.0**y.bits, "uniform").pvalue < 1e-6
        assert np.mean(y.masked == x) < 0.01


@needs_glue
def test_a_node_that_dies_after_sharing_its_keys_is_recovered_and_missing_after(
        tmp_path: Path, task_identity, no_discovery_pause) -> None:
    raw = _raw(tmp_path, "federation.rounds=3", "federation.min_clients=2")
    grid = NodesInProcess(CLIENTS, dies_after={1: (1, "share")})
    run = _one_thread(lambda: _on_flower(raw, grid, tmp_path))
    train = [r for r in _rows(run) if r["scope"] == "train"]
    assert [r["secagg_dropouts"] for r in train] == [0, 1, 0]
    assert train[1]["missing"] == {
        "1": "dropped out of secure aggregation after sharing its keys (its masks recovered)"}
    assert train[1]["secagg"]["dropouts"] == [1] and train[1]["secagg"]["summed"] == 3
    assert train[2]["missing"] == {"1": "its node failed: Node Unavailable"}
    assert train[2]["secagg"]["summed"] == 3
    assert json.loads((run / "status.json").read_text())["state"] == "finished"


@needs_glue
def test_a_node_without_a_worker_refuses_secure_aggregation(tmp_path: Path, task_identity,
                                                            no_discovery_pause) -> None:
    raw = _raw(tmp_path, "federation.rounds=1", "federation.min_clients=2")
    grid = NodesInProcess(CLIENTS, worker=False)
    cfg = validate({**raw, "runtime": {"name": "flower"}})
    clients = FlowerClients(grid, tomli_w.dumps(to_toml_dict(cfg)), list(range(CLIENTS)),
                            cfg.runtime)
    assert set(clients.refused) == set(range(CLIENTS))
    assert "in the node's worker, and this node has none" in clients.refused[0]


@needs_glue
def test_homomorphic_aggregation_on_flower_equals_the_local_run(
        tmp_path: Path, task_identity, no_discovery_pause) -> None:
    """A homomorphic protocol's stages (CKKS here; Paillier's messages are the same kinds)
    travel as the same ``train.secagg`` rounds; the server receives the public context,
    ciphertexts and the key holder's sum, never an update."""
    raw = _raw(tmp_path, "secagg.protocol=ckks", "federation.rounds=1")
    grid = NodesInProcess(CLIENTS)

    def both() -> tuple[Path, Path]:
        local = RunDir.create(tmp_path / "local", "tiny")
        simulate(Experiment.build(validate(raw)), local)
        return local.path, _on_flower(raw, grid, tmp_path)

    def without_bytes(rows: list[dict]) -> list[dict]:
        """A ciphertext's size varies by a few bytes with its randomness."""
        drop = ("bytes_up", "bytes_down")
        return [{k: ({x: y for x, y in v.items() if x not in drop} if k == "secagg" else v)
                 for k, v in r.items() if k not in drop} for r in rows]

    local, flower = _one_thread(both)
    assert without_bytes(_rows(flower)) == without_bytes(_rows(local))
    kinds = [type(secagg_message_from(reply.content)).__name__ for _, reply in grid.received
             if reply.metadata.message_type == "train.secagg"]
    assert sorted(set(kinds)) == ["Ciphertexts", "PlainSum", "PublicContext"]

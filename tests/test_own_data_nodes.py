"""Clients that hold their own data (``runtime.client_data = "nodes"``): the config's
checks, a node reading its file or folder, ``fedloom partition --export`` round-tripping a
simulated partition, and a federation of own-data nodes (the server without any client
data, every client score from the client's node) equal to the simulation of the same
split: in this process for FedAvg and Ditto, and on a real Flower deployment (``fedloom
serve`` and ``fedloom join --data``, with TLS and SuperNode authentication)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomli_w
import torch
from conftest import needs_glue, tiny_raw

from fedloom.config import ConfigError, validate
from fedloom.data import DataError, get_task
from fedloom.experiment import Experiment
from fedloom.federation import FederatedData
from fedloom.node_data import NodeData, export_partition, read_node_data
from fedloom.params import Params
from fedloom.runtime.clients import ClientHost, Scored, TrainReply
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

NODES = ['runtime.name="flower"', 'runtime.client_data="nodes"']
#: MRPC's two texts, named for the tables a node reads
PAIRS = ['data.text_fields=["sentence1", "sentence2"]']
#: what a simulation must set to be compared with own-data nodes (their defaults there)
COMPARABLE = ['eval.client_mode="split"', 'eval.others="never"', "diagnostics.every=0"]


def _error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        validate(raw)
    return str(err.value)


def test_own_data_needs_flower_and_turns_off_what_reads_client_data_on_the_server() -> None:
    assert "runtime.name" in _error(tiny_raw('runtime.client_data="nodes"'))
    cfg = validate(tiny_raw(*NODES))
    assert (cfg.eval.others, cfg.diagnostics.every) == ("never", 0)
    assert cfg.eval.client_mode == "auto"
    assert _error(tiny_raw(*NODES, 'eval.others="final"')).startswith("eval.others:")
    assert _error(tiny_raw(*NODES, "diagnostics.every=1")).startswith("diagnostics.every:")
    assert _error(tiny_raw(*NODES, 'eval.client_mode="dev_weighted"')).startswith(
        "eval.client_mode:")
    assert _error(tiny_raw(*NODES, 'partition.tasks={names = ["MRPC", "SST-2"]}')).startswith(
        "partition.tasks:")
    assert _error(tiny_raw(*NODES, 'data.train_path="x.jsonl"')).startswith("data.train_path:")
    # the server's dev set of a task of one's own, without a training file of it
    assert validate(tiny_raw(*NODES, 'data.task="intent"', 'data.label_names=["a", "b"]',
                             'data.dev_path="dev.jsonl"')).data.dev_path == "dev.jsonl"
    assert _error(tiny_raw('data.dev_path="dev.jsonl"')).startswith("data.dev_path:")


def test_the_server_needs_a_declared_label_space_and_refuses_pooling_methods() -> None:
    with pytest.raises(ConfigError, match="data.label_names"):
        FederatedData.build(validate(tiny_raw(*NODES, 'data.task="intent"', "eval.dev=false")))
    data = FederatedData.build(validate(tiny_raw(
        *NODES, 'data.task="intent"', 'data.label_names=["no", "yes"]', "eval.dev=false")))
    assert (data.task.label_names, data.train, data.splits, data.dev) == (("no", "yes"), [], [],
                                                                           None)
    assert data.stats() == {"client_data": "nodes", "num_clients": 3,
                            "label_names": ["no", "yes"]}
    with pytest.raises(ConfigError, match="algorithm.name: centralized"):
        Experiment.build(validate(tiny_raw(*NODES, 'algorithm.name="centralized"')))


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_node_reads_its_file_or_its_folder(tmp_path: Path) -> None:
    cfg = validate(tiny_raw(*NODES, *PAIRS))
    task = get_task("MRPC")
    rows = [{"sentence1": f"a{i}", "sentence2": f"b{i}", "label": ["not_equivalent",
                                                                    "equivalent"][i % 2]}
            for i in range(20)]
    file = _write_jsonl(tmp_path / "mine.jsonl", rows)
    train, test = read_node_data(NodeData(1, file), cfg.data, task, 0.2, seed=0)
    assert (len(train), len(test)) == (16, 4)
    assert sorted(e.text_a for e in train + test) == sorted(r["sentence1"] for r in rows)
    again = read_node_data(NodeData(1, file), cfg.data, task, 0.2, seed=0)
    other = read_node_data(NodeData(2, file), cfg.data, task, 0.2, seed=0)
    assert [e.text_a for e in again[1]] == [e.text_a for e in test]  # seeded by (seed, client)
    assert [e.text_a for e in other[1]] != [e.text_a for e in test]
    folder = tmp_path / "client"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", rows[:15])
    with pytest.raises(DataError, match="test.jsonl"):
        read_node_data(NodeData(1, folder), cfg.data, task, 0.2, seed=0)
    _write_jsonl(folder / "test.jsonl", rows[15:])
    train, test = read_node_data(NodeData(1, folder), cfg.data, task, 0.2, seed=0)
    assert [e.text_a for e in test] == [f"a{i}" for i in range(15, 20)]
    assert [e.label for e in train[:2]] == [0, 1]
    _write_jsonl(folder / "test.jsonl", [{**rows[0], "label": "maybe"}])
    with pytest.raises(DataError, match=r"test.jsonl, line 1"):
        read_node_data(NodeData(1, folder), cfg.data, task, 0.2, seed=0)


@needs_glue
def test_an_exported_partition_reads_back_as_each_clients_examples(tmp_path: Path) -> None:
    cfg = validate(tiny_raw(*PAIRS))
    data = FederatedData.build(cfg)
    clients = {s.client_id: (data.examples(s, s.train), data.examples(s, s.test))
               for s in data.splits}
    folders = export_partition(clients, cfg.data, data.task, tmp_path)
    assert [f.name for f in folders] == ["client_000", "client_001", "client_002"]
    for cid, (train, test) in clients.items():
        back = read_node_data(NodeData(cid, folders[cid]), cfg.data, data.task, 0.2, seed=0)
        assert [(e.text_a, e.text_b, e.label) for e in back[0]] == [
            (e.text_a, e.text_b, e.label) for e in train]
        assert [(e.text_a, e.text_b, e.label) for e in back[1]] == [
            (e.text_a, e.text_b, e.label) for e in test]
    with pytest.raises(ConfigError, match="data.text_fields"):
        export_partition(clients, validate(tiny_raw()).data, data.task, tmp_path / "one")


class _Nodes:
    """Own-data nodes in this process: one :class:`ClientHost` per client, each built from
    that client's own folder alone (the Flower runtime's :class:`FlowerClients` without
    the transport)."""

    def __init__(self, make: Callable[[int], Experiment], ids: list[int]) -> None:
        self.hosts = {cid: ClientHost(make(cid), [cid]) for cid in ids}

    def train_many(self, round_: int, attempt: int, payloads: dict[int, Params],
                   on_reply: Callable[[int], None] | None = None) -> list[TrainReply]:
        return [self.hosts[c].train(c, round_, attempt, p) for c, p in payloads.items()]

    def commit(self, client_ids: list[int]) -> None:
        for cid, host in self.hosts.items():
            host.commit([cid] if cid in client_ids else [])

    def evaluate_many(self, round_: int, payloads: dict[int, Params],
                      on_reply: Callable[[int], None] | None = None) -> dict[int, Scored]:
        scored = {}
        for c, p in payloads.items():
            scored[c] = self.hosts[c].evaluate(c, round_, p)
            if on_reply:
                on_reply(len(scored))
        return scored

    def score_many(self, round_: int, params: dict[int, Params]) -> dict[int, Any]:
        return {c: self.hosts[c].score(c, round_, p) for c, p in params.items()}

    def get_states(self) -> dict[int, dict[str, Any]]:
        return {c: h.states[c] for c, h in self.hosts.items()}

    def set_states(self, states: dict[int, dict[str, Any]]) -> None:
        for cid, state in states.items():
            self.hosts[cid].states[cid] = state


def _outputs(run: Path) -> tuple[list[dict], dict]:
    """metrics.jsonl and summary.json without what only a simulation's server knows: the
    clients' label mixes (diagnostics' ``label_js``)."""
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("wall_seconds")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "label_js"} for r in rows], summary


def _exported(tmp_path: Path, *overrides: str) -> tuple[Path, dict]:
    """The tiny federation's partition exported for nodes, and its raw config."""
    raw = tiny_raw(*PAIRS, *COMPARABLE, *overrides, output_dir=tmp_path / "runs")
    cfg = validate(raw)
    data = FederatedData.build(cfg)
    export_partition({s.client_id: (data.examples(s, s.train), data.examples(s, s.test))
                      for s in data.splits}, cfg.data, data.task, tmp_path / "nodes")
    return tmp_path / "nodes", raw


def _simulated(raw: dict[str, Any], tmp_path: Path) -> Path:
    """The run directory of a simulated run of ``raw``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each node process (runtime.cpus_per_worker = 1)
    try:
        local = RunDir.create(tmp_path / "local", "tiny")
        simulate(Experiment.build(validate(raw)), local)
    finally:
        torch.set_num_threads(threads)
    return local.path


def _simulated_and_exported(tmp_path: Path, *overrides: str) -> tuple[Path, Path, dict]:
    """A simulated run of the tiny federation and its partition exported for nodes."""
    folders, raw = _exported(tmp_path, *overrides)
    return _simulated(raw, tmp_path), folders, raw


@needs_glue
@pytest.mark.parametrize("algorithm", ["fedavg", "ditto"])
def test_own_data_nodes_equal_the_simulation_of_their_split(algorithm: str,
                                                             tmp_path: Path) -> None:
    local, folders, raw = _simulated_and_exported(
        tmp_path, f'algorithm.name="{algorithm}"', 'train.optimizer_state="persist"')
    cfg = validate({**raw, "runtime": {"name": "flower", "client_data": "nodes"}})
    server = Experiment.build(cfg)
    assert all(not c.train and not c.test for c in server.clients)
    nodes = _Nodes(lambda cid: Experiment.build(
        cfg, NodeData(cid, folders / f"client_{cid:03d}")), [0, 1, 2])
    assert [len(h.exp.clients) for h in nodes.hosts.values()] == [1, 1, 1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = RunDir.create(tmp_path / "own", "tiny")
        simulate(server, run, clients=nodes)
    finally:
        torch.set_num_threads(threads)
    rows, summary = _outputs(run.path)
    assert any(r.get("scope") == "global/clients" for r in rows)
    assert (rows, summary) == _outputs(local)
    assert json.loads((run.path / "partition.json").read_text())["client_data"] == "nodes"


def _fedloom(*args: str, **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedloom.cli", *args], **kwargs)


def test_join_refuses_data_the_config_does_not_expect(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(tomli_w.dumps(tiny_raw(*PAIRS)))
    out = subprocess.run([sys.executable, "-m", "fedloom.cli", "join", str(config),
                          "--client-id", "0", "--superlink", "127.0.0.1:1", "--data",
                          str(tmp_path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 2 and "runtime.client_data" in out.stderr
    config.write_text(tomli_w.dumps({**tiny_raw(*PAIRS), "runtime": {"client_data": "nodes"}}))
    out = subprocess.run([sys.executable, "-m", "fedloom.cli", "join", str(config),
                          "--client-id", "0", "--superlink", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and "--data" in out.stderr


@needs_glue
@pytest.mark.slow
def test_serve_and_join_with_own_data_tls_and_authentication_equal_the_simulation(
        tmp_path: Path) -> None:
    """``fedloom serve`` with TLS, SuperNode authentication and an override (``--set
    train.local_steps=1``); the nodes join (``fedloom join --data``) with a file of the
    same settings, which names no output_dir of the server's, and train on their own
    data: the run equals the simulation of their split. A node with a key the server never
    registered is turned away. (The refusal of a node whose file differs is in
    test_flower_runtime, on a loopback deployment.)"""
    pytest.importorskip("flwr")
    from fedloom.runtime.flower_credentials import write_credentials
    from fedloom.runtime.flower_deploy import free_port, processes_of

    # two nodes (each a `fedloom join`, its SuperNode and its worker), scored on their own
    # data once, after the last of the two rounds: every message is a process start on a node
    clients = 2
    credentials, rogue = tmp_path / "credentials", tmp_path / "rogue"
    write_credentials(credentials, clients=clients)
    write_credentials(rogue, clients=1)  # a key pair the server never registered ...
    shutil.copy(credentials / "ca.crt", rogue / "ca.crt")  # ... behind the right CA
    folders, raw = _exported(tmp_path, 'algorithm.name="fedavg"', "train.local_steps=1",
                             f"partition.num_clients={clients}", "eval.every=2")
    # the server's config names no client data: a node's examples stay on its machine
    own = {"client_data": "nodes", "nodes_timeout": 180.0}
    served, agreeing = tmp_path / "served.toml", tmp_path / "agreeing.toml"
    served.write_text(tomli_w.dumps({**raw, "train": {**raw["train"], "local_steps": 2},
                                     "runtime": own, "output_dir": str(tmp_path / "flower")}))
    agreeing.write_text(tomli_w.dumps({**raw, "runtime": own,
                                       "output_dir": str(tmp_path / "elsewhere")}))
    port = free_port()
    server = _fedloom("serve", "--no-report", str(served), "--set", "train.local_steps=1", "--port",
                      str(port), "--host", "127.0.0.1", "--credentials", str(credentials),
                      "--quiet", "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
    join = ("join", "--superlink", f"127.0.0.1:{port}", "--client-id")
    nodes = [_fedloom(*join, str(cid), str(agreeing), "--data",
                      str(folders / f"client_{cid:03d}"), "--credentials", str(credentials),
                      stderr=subprocess.DEVNULL, start_new_session=True) for cid in range(clients)]
    # turned away once, it stops (--wait 0: not started again every 5 s until the end)
    impostor = _fedloom(*join, "0", "--credentials", str(rogue), "--wait", "0",
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        start_new_session=True, text=True)
    try:
        local = _simulated(raw, tmp_path)  # while the federation runs
        out, err = server.communicate(timeout=600)
    finally:
        for node in [*nodes, impostor]:
            with contextlib.suppress(ProcessLookupError):  # the impostor may be gone
                os.killpg(node.pid, signal.SIGKILL)
        if server.poll() is None:  # a failure here: stopped as Ctrl-C stops it
            server.terminate()
            server.communicate(timeout=120)
    assert server.returncode == 0, err
    assert json.loads(out)["rounds"] == 2
    (run,) = (tmp_path / "flower").glob("tiny-*")
    assert _outputs(run) == _outputs(local)
    assert not processes_of(run / "flower")
    assert not np.any([p.name == "partition.png" for p in run.iterdir()])
    assert "Failed to activate SuperNode" in impostor.communicate()[0]


def test_aligning_backbones_on_a_task_of_ones_own_names_the_key() -> None:
    from fedloom.federation import public_texts

    cfg = validate(tiny_raw(*NODES, 'data.task="intent"', 'data.label_names=["a", "b"]'))
    with pytest.raises(ConfigError, match="model.alignment"):
        public_texts(cfg, 10)

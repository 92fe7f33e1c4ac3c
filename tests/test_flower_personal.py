"""On Flower a personal adapter never leaves its node (issue 66).

The server's side (:class:`FlowerClients`, the run of :func:`simulate`) and each node's
(:func:`fedloom.runtime.flower_node.answer`) exchange Flower ``Message`` objects in this
process, every content through Flower's own wire encoding (its protobuf serialization, as
Flower's transport and a node's worker carry it), and :class:`RecordingGrid` keeps every
reply the server pulls. For every personalized method of the registry (the clustered and
the partial-sharing ones among them):

- an evaluate reply holds no array at all (scores only);
- a train reply of a partial-sharing method holds exactly its shared names;
- no tensor of a train reply equals one the client keeps to itself: a tensor of its local
  state or of the personal adapter its node checkpointed, unless the server sent the
  client that very tensor. A method whose definition uploads the client's own model
  (:data:`SENDS_ITS_MODEL`: FedALA, FedMosaic, L2GD, MOCHA, ...) keeps a copy of what it
  sends: for it, everything else the client keeps (gates, ALA's weights, a head it never
  sends, optimizer moments).

Each node writes its client's personal checkpoint into its own folder (node config
``checkpoint-dir``), the server none; ``eval.others`` (Self / Others, which scores
personal adapters at the server) is refused on Flower for a personalized method. A
clustered method, both ways compressed, on nodes that served another run before, equals
the local runtime."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import pytest
import tomli_w
import torch
from conftest import needs_glue, tiny_raw
from safetensors.torch import load

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedloom import algorithms
from fedloom.algorithms.partial import PartialFedAvg
from fedloom.config import ConfigError, to_toml_dict, validate
from fedloom.experiment import Experiment, build_algorithm
from fedloom.runtime import flower_app
from fedloom.runtime.flower_app import FlowerClients
from fedloom.runtime.flower_node import CHECKPOINT_DIR, CLIENT_ID, PENDING, STATE, Hosts, answer
from fedloom.runtime.flower_records import take_params
from fedloom.runtime.rundir import RunDir, load_checkpoint
from fedloom.server import simulate

CLIENTS = 2
#: every personalized method: the clustered (IFCA, CFL, FedEM), the partial-sharing
#: (FedPer, FedRep, LG-FedAvg, FedSA-LoRA), the regularized (Ditto, APFL, pFedMe, ...),
#: FedAvg-FT's fine-tuned adapter, ... (qfedavg, not personalized, needs a setting to build)
PERSONALIZED = [
    n for n in algorithms.available() if n != "qfedavg" and algorithms.create(n).personalized
]
#: what a method needs beyond its name on two clients
NEEDS = {"fedem": ["algorithm.num_components=2"]}
#: the methods whose upload is, by their definition, the client's own model, of which they
#: keep a copy: in the personal adapter their node checkpoints and in their local state,
#: at these paths (one ending in "/": a folder of copies named as what they send)
SENDS_ITS_MODEL: dict[str, tuple[str, ...]] = {
    "fedala": ("/ala_local/",),  # its trained model θ_k; the higher part kept for the next ALA
    # its local adapter θ_k and task vector v_k, for the relevance-weighted mean
    "fedmosaic": ("/mosaic_local/", "/task_vector"),
    "l2gd": ("/l2gd_x/",),  # its local model x_k, for the server's mean
    "mixture_admm": (),  # its adapter, which the server's ADMM step mixes
    "mocha": (),  # its adapter, which the server's Ω-step couples
    "oracle_prior": (),  # one party trains on every client's data (the reference)
}


def _wire(content: RecordDict) -> RecordDict:
    """``content`` as it comes out of Flower's wire encoding."""
    proto = ProtoRecordDict.FromString(recorddict_to_proto(content).SerializeToString())
    return recorddict_from_proto(proto)


def _tensors(content: RecordDict) -> Iterator[tuple[str, torch.Tensor]]:
    for record in content.array_records.values():
        yield from record.to_torch_state_dict().items()


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


@dataclass
class Reply:
    """A reply the server pulled: its message type, client and content."""

    kind: str
    client_id: int
    content: RecordDict


class RecordingGrid:
    """A Flower ``Grid`` whose nodes, one per client (its checkpoint folder under
    ``folders``), answer each message as it is pushed, as fedloom's ClientApp does through
    the node's worker. ``replies``: every reply the server pulled; ``sent``: every tensor
    the server sent each client; ``kept``: everything each client held in its local state
    (``state:PATH``) and its personal checkpoints (``checkpoint:NAME``) after each message
    it answered."""

    def __init__(self, clients: int, folders: Path) -> None:
        self.folders = folders
        self.contexts = {
            100 + cid: Context(
                1, 100 + cid, {CLIENT_ID: cid, CHECKPOINT_DIR: str(self.folder(cid))},
                RecordDict(), {},
            )
            for cid in range(clients)
        }
        self.hosts = {node: Hosts() for node in self.contexts}
        self.waiting: dict[str, Message] = {}
        self.replies: list[Reply] = []
        self.sent: dict[int, list[torch.Tensor]] = {cid: [] for cid in range(clients)}
        self.kept: dict[int, list[tuple[str, torch.Tensor]]] = {
            cid: [] for cid in range(clients)}

    def folder(self, client_id: int) -> Path:
        return self.folders / f"client_{client_id:03d}"

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            mid = str(uuid4())
            message.metadata.__dict__["_message_id"] = mid  # as Flower's InMemoryGrid does
            node, kind = message.metadata.dst_node_id, message.metadata.message_type
            received = _wire(message.content)
            if "payload" in received:
                self.sent[node - 100].extend(take_params(received, "payload").values())
            content = answer(kind, received, self.contexts[node], self.hosts[node])
            self.waiting[mid] = Message(_wire(content), reply_to=message)
            self._keep(node - 100)
            ids.append(mid)
        return ids

    def _keep(self, client_id: int) -> None:
        state = self.contexts[100 + client_id].state
        for key in (STATE, PENDING):
            if key in state:
                blob = state.config_records[key]["blob"]
                assert isinstance(blob, bytes)
                self.kept[client_id].extend((f"state:{n}", t) for n, t in load(blob).items())
        for path in self.folder(client_id).glob("personal/*.safetensors"):
            checkpoint = load_checkpoint(path)[0]
            self.kept[client_id].extend((f"checkpoint:{n}", t) for n, t in checkpoint.items())

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = [self.waiting.pop(mid) for mid in message_ids if mid in self.waiting]
        for reply in out:
            cid = reply.metadata.src_node_id - 100
            self.replies.append(Reply(reply.metadata.message_type, cid, reply.content))
        return out

    def personal(self, client_id: int, copies: Callable[[str], bool]) -> list[torch.Tensor]:
        """What client ``client_id`` kept that the server never sent it, but the ``copies``
        of what it sends (by where it kept them)."""
        return [
            tensor
            for where, tensor in self.kept[client_id]
            if not copies(where) and not any(_equal(tensor, s) for s in self.sent[client_id])
        ]


def _copies(method: str, uploads: set[str]) -> Callable[[str], bool]:
    """Whether a tensor a client kept (``checkpoint:NAME``, ``state:PATH``) is ``method``'s
    copy of what it sends (``uploads``, by name): none is, but for a
    :data:`SENDS_ITS_MODEL` method in its personal checkpoint or in a state folder of its
    paths under the name it is sent by, or at one of its paths itself."""
    paths = SENDS_ITS_MODEL.get(method)

    def copies(where: str) -> bool:
        if paths is None:
            return False
        source, path = where.split(":", 1)
        folder, name = path.rsplit("/", 1) if "/" in path else ("", path)
        if source == "checkpoint" or f"{folder}/" in paths:
            return name in uploads
        return path in paths

    return copies


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


def _raw(name: str, tmp_path: Path, *overrides: str) -> dict[str, Any]:
    """Method ``name`` for two rounds on two clients, scored after each round (a personal
    part crosses a round)."""
    return tiny_raw(f"partition.num_clients={CLIENTS}", "data.max_train_examples=40",
                    "data.max_dev_examples=16", "federation.rounds=2", f"algorithm.name={name}",
                    *NEEDS.get(name, []), *overrides, output_dir=tmp_path)


def _serve(raw: dict[str, Any], grid: RecordingGrid, folder: Path) -> tuple[Experiment, Path]:
    """The run of ``raw`` as ``flower_app.serve`` runs it over ``grid``, in a run
    directory under ``folder``; the server's experiment and its run directory."""
    cfg = validate({**raw, "runtime": {"name": "flower", "reply_timeout": 60}})
    run = RunDir.create(folder, "tiny")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every node computes
    try:
        exp = Experiment.build(cfg)
        clients = FlowerClients(grid, tomli_w.dumps(to_toml_dict(exp.cfg)),
                                [p.client_id for p in exp.parties()], cfg.runtime)
        simulate(exp, run, None, clients=clients)
    finally:
        torch.set_num_threads(threads)
    return exp, run.path


def _on_flower(name: str, tmp_path: Path) -> tuple[RecordingGrid, Experiment, Path]:
    """The run of :func:`_raw` over a :class:`RecordingGrid`; the grid, the server's
    experiment and its run directory."""
    grid = RecordingGrid(CLIENTS, tmp_path / "nodes")
    exp, run = _serve(_raw(name, tmp_path), grid, tmp_path / "server")
    return grid, exp, run


@needs_glue
@pytest.mark.parametrize("name", PERSONALIZED)
def test_no_reply_carries_a_personal_tensor(name: str, tmp_path: Path, task_identity,
                                            no_discovery_pause) -> None:
    grid, exp, run = _on_flower(name, tmp_path)
    train = [r for r in grid.replies if r.kind == "train"]
    evaluate = [r for r in grid.replies if r.kind == "evaluate"]
    assert len(train) == 2 * len(exp.parties()) and len(evaluate) == 2 * CLIENTS
    assert not any(r.content.array_records for r in evaluate), "an evaluate reply held arrays"
    alg = exp.algorithm
    if isinstance(alg, PartialFedAvg):
        shared = set(alg.split(exp.model.initial_params)[0])
        assert all({n for n, _ in _tensors(r.content)} == shared for r in train)
    for cid in {r.client_id for r in train}:
        uploads = [t for r in train if r.client_id == cid for t in _tensors(r.content)]
        personal = grid.personal(cid, _copies(name, {n for n, _ in uploads}))
        leaked = [n for n, t in uploads if any(_equal(t, p) for p in personal)]
        assert not leaked, (cid, leaked)
    # each node checkpointed its client's adapter after the last round, in its own folder
    assert not (run / "checkpoints" / "personal").exists()
    for cid in range(CLIENTS):
        path = grid.folder(cid) / "personal" / f"client_{cid:03d}.safetensors"
        assert load_checkpoint(path)[1] == {"round": "2", "client_id": str(cid)}


def _outputs(run: Path) -> tuple[list[dict], dict]:
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("wall_seconds")
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()], summary


@needs_glue
def test_a_clustered_run_on_nodes_that_served_another_equals_the_local_run(
        tmp_path: Path, task_identity, no_discovery_pause) -> None:
    """IFCA (every cluster's adapter in each payload), compressed both ways (the
    downlink's encodings travel in ArrayRecords, its reference is client state on the
    node), writes the metrics.jsonl and summary.json of the local runtime on the nodes'
    side of the message path, Flower's wire encoding between, on nodes whose workers
    served another run just before (a worker keeps what it built by the run's config).
    (FedMosaic so compressed on a real loopback deployment: test_flower_runtime.)"""
    compressed = ('transforms=[{name = "compress", compressor = "topk", ratio = 0.1}, '
                  '{name = "compress_down", compressor = "qsgd", levels = 8}]')
    # Self / Others off, as on Flower by default (the local run scores it otherwise)
    raw = _raw("ifca", tmp_path, "algorithm.num_clusters=2", compressed, "eval.others='never'")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every node computes
    try:
        local = RunDir.create(tmp_path / "local", "tiny")
        simulate(Experiment.build(validate(raw)), local)
    finally:
        torch.set_num_threads(threads)
    before = RecordingGrid(CLIENTS, tmp_path / "nodes")
    _serve(_raw("fedavg", tmp_path / "before"), before, tmp_path / "before")
    grid = RecordingGrid(CLIENTS, tmp_path / "nodes")  # a new run: Flower's new contexts ...
    grid.hosts = before.hosts  # ... on the same nodes' workers
    _, run = _serve(raw, grid, tmp_path / "server")
    assert _outputs(run) == _outputs(local.path)
    assert any(r["scope"] == "clusters" for r in _outputs(run)[0])
    assert {r.kind for r in grid.replies} == {"query", "train", "evaluate"}


def test_a_node_checkpoints_into_its_own_folder_whatever_the_server_says(
        tmp_path: Path, monkeypatch) -> None:
    """The folder is node config ``checkpoint-dir``, else fedloom-node/client_NNN in the
    node's working directory; nothing in the server's messages names it."""
    from fedloom.runtime.flower_node import checkpoint_dir

    def context(**node: object) -> Context:
        return Context(1, 7, {CLIENT_ID: 3, **node}, RecordDict(), {})

    assert checkpoint_dir(context(**{CHECKPOINT_DIR: str(tmp_path / "mine")}), 3) == (
        tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    assert checkpoint_dir(context(), 3) == Path("fedloom-node/client_003")


@pytest.mark.parametrize("others", ["final", "every"])
def test_self_others_of_a_personalized_method_is_simulation_only(others: str) -> None:
    """On Flower a personal adapter stays on its node: ``eval.others`` is refused for a
    personalized method, in one line naming both keys, and off by default there."""
    flower = ("runtime.name='flower'", "algorithm.name='ditto'")
    with pytest.raises(ConfigError) as refused:
        build_algorithm(validate(tiny_raw(*flower, f"eval.others='{others}'")))
    message = str(refused.value)
    assert message.startswith("eval.others:") and "runtime.name" in message
    assert "\n" not in message
    assert validate(tiny_raw(*flower)).eval.others == "never"
    build_algorithm(validate(tiny_raw(*flower)))
    # the global adapter's Self / Others needs no client's tensors; a simulation scores both
    build_algorithm(validate(tiny_raw("runtime.name='flower'", f"eval.others='{others}'")))
    build_algorithm(validate(tiny_raw("algorithm.name='ditto'", f"eval.others='{others}'")))

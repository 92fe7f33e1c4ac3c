"""fedloom on Flower's deployment engine (``[runtime] name = "flower"``): a ``ServerApp``
and a ``ClientApp`` over flwr's Message API.

**Server side.** :data:`server_app` builds the experiment from the config its run was
started with (run config ``config``: a fedloom TOML file; ``run-dir``: the run directory
to write) and runs the embedded simulator's rounds (:func:`fedloom.runtime.local.simulate`)
with :class:`FlowerClients` as the clients: sampling, payloads, the update checks,
aggregation, evaluation and the run directory are the local runtime's, so a run's metrics
equal it (bit for bit with one torch thread per client: ``runtime.cpus_per_worker = 1``).

**Client side.** Each SuperNode is one client: ``client-id`` in its node config (and,
optionally, ``data-dir``: where that machine keeps the GLUE data; ``data-file``: the
client's own examples when the clients hold their own data, ``runtime.client_data =
"nodes"``, :mod:`fedloom.node_data`). The server learns which
node is which client by a ``query`` message. A ``train`` message carries the payload and
the round; an ``evaluate`` message asks for the adapter a personalized client uses and its
scores, or (``adapter = "global"``) the scores of the global adapter on the client's data,
which the server does not hold under ``runtime.client_data = "nodes"``. :data:`client_app` answers them with a :class:`~fedloom.runtime.clients.ClientHost`
for that one client, built from the config the message carries.

**Client state stays on the node.** Optimizer moments, control variates, personal adapters
and gates live in the node's ``context.state`` (Flower keeps it for the run) and never
reach the server: a state reached in training is held there as *pending*, and the next
message to the node says whether the server accepted the round (keep it) or not (drop it),
as :meth:`ClientHost.commit` does in the other runtimes. So a Flower run's checkpoints
hold the server state only, and ``fedloom run --resume`` refuses a Flower run.

**Faults are real here.** A node that fails (its ClientApp raised, its SuperNode was
killed and missed its heartbeats) answers with Flower's error reply: the client is missing
from the round with that reason, and the round goes on by ``federation.below_quorum``.

How fedloom differs from Flower's own strategies: a ``Strategy`` object of flwr's is not
used; the round is fedloom's (one implementation for every runtime), and only the
transport is Flower's.
"""

from __future__ import annotations

import logging
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedloom.params import Params
from fedloom.runtime.clients import Scored, TrainReply
from fedloom.runtime.flower_records import (
    FIELDS,
    request,
    scored_from,
    scored_record,
    take_params,
    train_reply_from,
    train_reply_record,
)

if TYPE_CHECKING:
    from fedloom.config import ExperimentConfig, RuntimeConfig
    from fedloom.node_data import NodeData

#: the node's committed local state and the one reached in its last training
STATE, PENDING = "fedloom.state", "fedloom.pending"
#: the node config keys naming the client a SuperNode is, where the machine keeps the GLUE
#: data, the file or folder of its client's own examples (``runtime.client_data``) and the
#: device it trains on (``fedloom join --device``; default: the config's ``train.device``)
CLIENT_ID, DATA_DIR, DATA_FILE, DEVICE = "client-id", "data-dir", "data-file", "device"
#: seconds a new node has to say which client it is
HELLO_TIMEOUT = 120.0
#: seconds between polls for replies
POLL_SECONDS = 0.2

server_app = ServerApp()
client_app = ClientApp()
log = logging.getLogger("fedloom.flower")


class FlowerClients:
    """The clients ``ids`` of a run, one per SuperNode of ``grid``'s federation
    (:class:`~fedloom.runtime.clients.Clients`); ``config`` is the run's TOML text, sent
    with every message."""

    def __init__(self, grid: Grid, config: str, ids: list[int], runtime: RuntimeConfig) -> None:
        self.grid, self.config, self.ids = grid, config, ids
        self.reply_timeout = runtime.reply_timeout
        self.node_of: dict[int, int] = {}
        self.asked: set[int] = set()
        #: clients that trained since the last commit; the verdict each is told next
        self.trained: set[int] = set()
        self.verdict: dict[int, str] = {}
        self._discover(runtime.nodes_timeout)

    def _discover(self, timeout: float) -> None:
        """Wait until each of ``ids`` has a node (:meth:`_hello_new`), at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while missing := sorted(set(self.ids) - set(self.node_of)):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"runtime.nodes_timeout: no SuperNode joined as client(s) "
                    f"{missing} within {timeout:g} s"
                )
            time.sleep(0.5)
            self._hello_new()

    def _hello_new(self) -> None:
        """Ask every node not asked yet which client it is (a restarted SuperNode is a new
        node: it takes its client over)."""
        new = [n for n in self.grid.get_node_ids() if n not in self.asked]
        self.asked.update(new)
        messages = {
            n: Message(request({"op": "hello"}), dst_node_id=n, message_type="query") for n in new
        }
        for node, reply in self._send_and_receive(messages, HELLO_TIMEOUT).items():
            if reply.has_content():
                self.node_of[int(reply.content[FIELDS]["client_id"])] = node

    def _exchange(
        self, kind: str, round_: int, payloads: dict[int, Params], fields: dict[str, Any]
    ) -> dict[int, Message | str]:
        """Send each client its payload; its reply, or why none came."""
        self._hello_new()
        out: dict[int, Message | str] = {
            cid: f"no reply from its node within runtime.reply_timeout = {self.reply_timeout} s"
            if cid in self.node_of
            else "no SuperNode has joined as this client"
            for cid in payloads
        }
        messages = {}
        for cid, payload in payloads.items():
            if cid not in self.node_of:
                continue
            body = {
                "op": kind,
                "client_id": cid,
                "round": round_,
                "config": self.config,
                "verdict": self.verdict.pop(cid, ""),
                **fields,
            }
            messages[cid] = Message(
                request(body, payload),
                dst_node_id=self.node_of[cid],
                message_type=kind,
                group_id=str(round_),
            )
        for cid, reply in self._send_and_receive(messages, self.reply_timeout).items():
            out[cid] = reply if reply.has_content() else f"its node failed: {reply.error.reason}"
        return out

    def _send_and_receive(
        self, messages: dict[int, Message], timeout: float | None
    ) -> dict[int, Message]:
        """The replies that came within ``timeout`` seconds (None: until all came), by the
        key of the message they answer. Flower's ``Grid.send_and_receive`` returns them
        unkeyed (an error reply comes from the SuperLink, not the node) and polls every 3 s;
        this polls every 0.2 s."""
        if not messages:
            return {}
        keys = list(messages)
        by_id = dict(zip(self.grid.push_messages(messages.values()), keys, strict=True))
        waiting, replies = set(by_id), {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while waiting and (deadline is None or time.monotonic() < deadline):
            for reply in self.grid.pull_messages(list(waiting)):
                answered = reply.metadata.reply_to_message_id
                if answered in waiting:
                    waiting.discard(answered)
                    replies[by_id[answered]] = reply
            if waiting:
                time.sleep(POLL_SECONDS)
        return replies

    def train_many(
        self,
        round_: int,
        attempt: int,
        payloads: dict[int, Params],
        on_reply: Callable[[int], None] | None = None,
    ) -> list[TrainReply]:
        replies = []
        for cid, answer in self._exchange("train", round_, payloads, {"attempt": attempt}).items():
            if isinstance(answer, str):
                replies.append(TrainReply(cid, None, answer))
                continue
            self.trained.add(cid)
            replies.append(train_reply_from(answer.content))
        if on_reply:
            on_reply(len(replies))
        return replies

    def commit(self, client_ids: list[int]) -> None:
        accepted = set(client_ids)
        self.verdict.update({cid: "keep" if cid in accepted else "drop" for cid in self.trained})
        self.trained.clear()

    def evaluate_many(self, round_: int, payloads: dict[int, Params]) -> dict[int, Scored]:
        scored: dict[int, Scored] = {}
        for cid, answer in self._exchange("evaluate", round_, payloads, {}).items():
            if isinstance(answer, str):
                log.warning("round %d: client %d not scored: %s", round_, cid, answer)
                scored[cid] = None
            else:
                scored[cid] = scored_from(answer.content)
        return scored

    def score_many(
        self, round_: int, params: dict[int, Params]
    ) -> dict[int, dict[str, dict[str, float | None]] | None]:
        scores: dict[int, dict[str, dict[str, float | None]] | None] = {}
        for cid, answer in self._exchange(
            "evaluate", round_, params, {"adapter": "global"}
        ).items():
            scored = None if isinstance(answer, str) else scored_from(answer.content)
            if scored is None:
                log.warning(
                    "round %d: client %d did not score the global adapter: %s",
                    round_,
                    cid,
                    answer if isinstance(answer, str) else "no scores",
                )
            scores[cid] = None if scored is None else scored[1]
        return scores

    def get_states(self) -> dict[int, dict[str, Any]]:
        """Nothing: the clients' states live on their nodes."""
        return {}

    def set_states(self, states: dict[int, dict[str, Any]]) -> None:
        if any(states.values()):
            raise RuntimeError(
                "a Flower run's client states live on its SuperNodes and "
                "cannot be restored from a checkpoint"
            )


@server_app.main()
def _serve(grid: Grid, context: Context) -> None:
    serve(grid, Path(str(context.run_config["config"])), Path(str(context.run_config["run-dir"])))


def serve(grid: Grid, config_path: Path, run_path: Path) -> dict[str, Any]:
    """The run of the fedloom config at ``config_path`` over ``grid``'s nodes, written to
    the run directory ``run_path`` (created by whoever started the run)."""
    import tomli_w

    from fedloom.config import load_config, to_toml_dict
    from fedloom.experiment import Experiment
    from fedloom.runtime.local import simulate
    from fedloom.runtime.rundir import RunDir, read_status

    run_path.mkdir(parents=True, exist_ok=True)  # `flwr run` names a new one
    run = RunDir(run_path)
    run.status = {
        k: v
        for k, v in (read_status(run_path) or {}).items()
        if k in ("started", "rounds", "round")
    }
    try:
        cfg = load_config(config_path)
        exp = Experiment.build(_on_a_device_here(cfg))
        text = tomli_w.dumps(to_toml_dict(cfg))  # the nodes resolve train.device themselves
        clients = FlowerClients(grid, text, [p.client_id for p in exp.parties()], cfg.runtime)
    except BaseException as err:
        run.write_status("failed", error=f"{type(err).__name__}: {err}")
        raise
    return simulate(exp, run, None, clients=clients)


def _on_a_device_here(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` for the server's side of a Flower run: its ``train.device`` where this
    machine has it, else the CPU (the server only aggregates and scores; the device the
    config names is the nodes')."""
    from fedloom.device import DeviceError, resolve_device

    try:
        resolve_device(cfg.train.device)
    except DeviceError:
        return cfg.model_copy(update={"train": cfg.train.model_copy(update={"device": "cpu"})})
    return cfg


class _Node:
    """One client on its SuperNode, for the length of one message: its host, with the
    local state the node keeps in ``context.state``."""

    def __init__(self, msg: Message, context: Context) -> None:
        import torch

        from fedloom.config import validate
        from fedloom.experiment import Experiment
        from fedloom.runtime.clients import ClientHost
        from fedloom.runtime.state_file import from_bytes

        fields = msg.content[FIELDS]
        self.client_id = int(fields["client_id"])
        own = int(context.node_config[CLIENT_ID])
        if own != self.client_id:
            raise RuntimeError(
                f"a message for client {self.client_id} reached the node of client {own}"
            )
        raw = tomllib.loads(str(fields["config"]))
        if DATA_DIR in context.node_config:
            raw.setdefault("data", {})["data_dir"] = str(context.node_config[DATA_DIR])
        if DEVICE in context.node_config:  # the node's own device (fedloom join --device)
            raw.setdefault("train", {})["device"] = str(context.node_config[DEVICE])
        cfg = validate(raw)
        torch.set_num_threads(max(1, int(cfg.runtime.cpus_per_worker)))
        self.host = ClientHost(
            Experiment.build(cfg, _own_data(cfg, context, own)), [self.client_id]
        )
        state = context.state
        verdict = str(fields["verdict"])
        if PENDING in state:
            if verdict == "keep":
                state[STATE] = state[PENDING]
            if verdict:
                del state[PENDING]
        if STATE in state:
            self.host.states[self.client_id] = from_bytes(bytes(state[STATE]["blob"]))
        self.fields, self.payload = fields, take_params(msg.content, "payload")

    def hold_pending(self, context: Context) -> None:
        """The state training reached, held on the node until the server's verdict."""
        from fedloom.runtime.state_file import to_bytes

        if self.client_id in self.host.pending:
            context.state[PENDING] = ConfigRecord(
                {"blob": to_bytes(self.host.pending[self.client_id])}
            )


def _own_data(cfg: ExperimentConfig, context: Context, client_id: int) -> NodeData | None:
    """Where this node keeps its client's examples (node config ``data-file``) when the
    clients hold their own data (``runtime.client_data = "nodes"``); a node started
    against the config's choice is an error naming the fix."""
    from fedloom.node_data import NodeData

    path = context.node_config.get(DATA_FILE)
    if cfg.runtime.client_data != "nodes":
        if path is not None:
            raise RuntimeError(
                f"client {client_id}: this node holds its own data ({path}), "
                f"but the run partitions the configured dataset; the server "
                f'sets runtime.client_data = "nodes" for nodes with --data'
            )
        return None
    if path is None:
        raise RuntimeError(
            f'client {client_id}: runtime.client_data = "nodes", but this node '
            f"was started without its data (fedloom join --data PATH)"
        )
    return NodeData(client_id, Path(str(path)))


@client_app.query()
def _hello(msg: Message, context: Context) -> Message:
    return Message(
        RecordDict({FIELDS: ConfigRecord({"client_id": int(context.node_config[CLIENT_ID])})}),
        reply_to=msg,
    )


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    node = _Node(msg, context)
    reply = node.host.train(
        node.client_id, int(node.fields["round"]), int(node.fields["attempt"]), node.payload
    )
    node.hold_pending(context)
    return Message(train_reply_record(reply), reply_to=msg)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    node = _Node(msg, context)
    round_ = int(node.fields["round"])
    if str(node.fields.get("adapter", "")) == "global":  # the server's adapter on our data
        scored: Scored = ({}, node.host.score(node.client_id, round_, node.payload))
    else:
        scored = node.host.evaluate(node.client_id, round_, node.payload)
    return Message(scored_record(scored), reply_to=msg)

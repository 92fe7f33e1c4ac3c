"""What a Flower node answers: the server's greeting, a train message and an evaluate
message, as record dicts (the ClientApp of :mod:`fedloom.runtime.flower_client` wraps them
in Flower messages, in its own process or through the node's worker,
:mod:`fedloom.runtime.node_worker`).

A node is one client. Under secure aggregation (``[secagg]``) its update stays here after
training, in the node's worker, and leaves only masked, in the protocol's message rounds
(:func:`secagg`; a node without a worker refuses such an experiment). Its experiment is the
server's (the config every message carries) with the node's own machine settings (node
config ``data-dir``, ``data-file``, ``device``, ``threads``, ``checkpoint-dir``). Its local
state lives in ``context.state``, Flower's, for the run: a state reached in training is
held there as *pending* until the next message's verdict keeps or drops it, as
:meth:`ClientHost.commit` does in the other runtimes.

Evaluation returns scores only (:func:`evaluate`): the adapter a personalized client uses
(Ditto's, FedPer's head, FedAvg-FT's fine-tuned one, ...) never leaves the node, which
writes it into its own checkpoint folder (:func:`checkpoint_dir`).

:class:`Hosts` keeps the built experiment of each (config, client, node settings) for the
next message: a long-lived worker builds the data, the tokenized features and the model
once, and a message then costs its training. The host's client state is set from
``context.state`` at every message, so a cached host computes what a fresh one would.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, RecordDict

from fedloom.runtime.flower_records import (
    FIELDS,
    field_int,
    scores_record,
    secagg_answer,
    secagg_message_from,
    take_params,
    train_reply_record,
)
from fedloom.runtime.rundir import save_personal

if TYPE_CHECKING:
    from fedloom.config import ExperimentConfig
    from fedloom.node_data import NodeData
    from fedloom.runtime.clients import ClientHost

#: the node's committed local state and the one reached in its last training
STATE, PENDING = "fedloom.state", "fedloom.pending"
#: the digest of the experiment the node accepted at the server's greeting
GREETED = "fedloom.greeted"
#: the node config keys naming the client a SuperNode is, where the machine keeps the GLUE
#: data, the file or folder of its client's own examples (``runtime.client_data``), the
#: device and torch threads it trains with (``fedloom join --device``, ``--threads``), a
#: config file of its own that the server's must agree with (``fedloom join CONFIG``) and
#: the socket of its worker (:mod:`fedloom.runtime.node_worker`)
CLIENT_ID, DATA_DIR, DATA_FILE, DEVICE = "client-id", "data-dir", "data-file", "device"
CONFIG_FILE, THREADS, WORKER = "config-file", "threads", "worker"
#: the node config key of the node's own checkpoint folder (``fedloom join
#: --checkpoint-dir``), where it writes its client's personal adapter (:func:`evaluate`);
#: without it, :data:`NODE_FOLDER`/``client_NNN`` in the working directory of the process
#: that answers
CHECKPOINT_DIR = "checkpoint-dir"
NODE_FOLDER = "fedloom-node"

log = logging.getLogger("fedloom.flower")


def greet(content: RecordDict, context: Context) -> RecordDict:
    """The reply to the server's greeting: which client this node is, and why it refuses
    the server's experiment ("" when it does not). An accepted experiment's digest is
    kept in ``context.state``: the node answers messages carrying that experiment only."""
    own = int(context.node_config[CLIENT_ID])
    config = str(content.config_records[FIELDS]["config"])
    refusal = node_refusal(config, context, own)
    if refusal:
        log.error("client %d: refusing the server's experiment: %s", own, refusal)
        if GREETED in context.state:
            del context.state[GREETED]
    else:  # every later message must carry this experiment (_client)
        context.state[GREETED] = ConfigRecord({"sha256": _digest(config)})
    return RecordDict({FIELDS: ConfigRecord({"client_id": own, "refusal": refusal})})


def node_refusal(server_config: str, context: Context, client_id: int) -> str:
    """Why this node refuses the experiment of ``server_config`` (the server's resolved
    TOML), or "": a client id outside the federation, data of its own against the
    config's choice (or none where the config expects it), or its own config file
    (node config ``config-file``) differing in a must-agree setting."""
    from fedloom.config import ConfigError, validate
    from fedloom.runtime.agreement import refusal

    server = validate(tomllib.loads(server_config))
    clients = server.partition.num_clients
    if not 0 <= client_id < clients:
        return (
            f"client {client_id} is not in the server's federation of {clients} clients "
            f"(partition.num_clients)"
        )
    try:
        own = _own_config(context)
    except ConfigError as err:
        return f"its config file does not load: {err}"
    try:
        _own_data(server, context, client_id)
        node_view(tomllib.loads(server_config), context)
    except RuntimeError as err:
        return str(err).removeprefix(f"client {client_id}: ")
    if server.secagg.protocol != "none" and WORKER not in context.node_config:
        return (
            "secure aggregation keeps the client's update on its node between the "
            "protocol's messages, in the node's worker, and this node has none (start it "
            "with fedloom join)"
        )
    if own is None:
        return ""
    return refusal(server, own, Path(str(context.node_config[CONFIG_FILE])).name)


def _own_config(context: Context) -> ExperimentConfig | None:
    """The node's own config file (node config ``config-file``), as ``fedloom join``
    reads it (run on Flower); None without one."""
    from fedloom.config import load_config

    path = context.node_config.get(CONFIG_FILE)
    return None if path is None else load_config(Path(str(path)), ['runtime.name="flower"'])


def node_view(server: dict[str, Any], context: Context) -> dict[str, Any]:
    """The server's raw experiment ``server`` with this node's own settings in place of
    every setting that names something on the node's machine: ``data.data_dir``,
    ``data.train_path``, ``data.dev_path`` and ``output_dir`` come from the node's own
    config file and ``--data-dir`` (else the defaults), never from the server, so a
    server cannot make a node read or write a path of its choosing; ``train.device``
    from ``--device``. A server's experiment on files of its own (``data.train_path``)
    is refused (RuntimeError) by a node that names no file of its own."""
    raw = copy.deepcopy(server)
    own = _own_config(context)
    data = raw.setdefault("data", {})
    if data.get("train_path") is not None and (own is None or own.data.train_path is None):
        raise RuntimeError(
            "the server's experiment reads data.train_path, a file on this node that the "
            "node did not name; start it with fedloom join CONFIG, whose data.train_path "
            "names this machine's copy"
        )
    for key in ("train_path", "dev_path", "data_dir"):
        mine = None if own is None else getattr(own.data, key)
        data.pop(key, None)
        if mine is not None and (key != "dev_path" or server.get("data", {}).get(key)):
            data[key] = mine
    settings = context.node_config
    if DATA_DIR in settings:
        data["data_dir"] = str(settings[DATA_DIR])
    raw.pop("output_dir", None)
    if own is not None:
        raw["output_dir"] = own.output_dir
    if DEVICE in settings:  # the node's own device (fedloom join --device)
        raw.setdefault("train", {})["device"] = str(settings[DEVICE])
    return raw


def _no_downloads(context: Context) -> None:
    """A node without a config file of its own named no backbone: it loads none from
    the Hugging Face Hub (offline mode), only what the machine already holds."""
    if CONFIG_FILE in context.node_config:
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:  # read at its import: set it there too
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True


def _digest(config: str) -> str:
    return hashlib.sha256(config.encode()).hexdigest()


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


class Hosts:
    """The client hosts this node built, by (config text, client, node settings): the
    most recent few are kept (a node serves one client of one run at a time)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._built: dict[tuple[str, int, str], ClientHost] = {}

    def host(self, config: str, client_id: int, context: Context) -> ClientHost:
        """The host of ``client_id`` for the server's ``config`` on this node, with the
        node's committed state from ``context.state`` (the pending one decided by the
        message's verdict beforehand, :func:`apply_verdict`)."""
        import torch

        from fedloom.config import validate
        from fedloom.experiment import Experiment
        from fedloom.runtime.clients import ClientHost
        from fedloom.runtime.state_file import from_bytes

        settings = {k: str(v) for k, v in sorted(context.node_config.items()) if k != WORKER}
        key = (config, client_id, repr(settings))
        _no_downloads(context)
        cfg = validate(node_view(tomllib.loads(config), context))
        torch.set_num_threads(
            max(1, int(float(settings.get(THREADS, cfg.runtime.cpus_per_worker))))
        )
        if key not in self._built:
            while len(self._built) >= self.keep:
                del self._built[next(iter(self._built))]
            exp = Experiment.build(cfg, _own_data(cfg, context, client_id))
            self._built[key] = ClientHost(exp, [client_id])
        host = self._built[key]
        host.states[client_id] = {}  # a new client's, unless the node holds one
        host.pending.pop(client_id, None)
        if STATE in context.state:
            blob = context.state.config_records[STATE]["blob"]
            if not isinstance(blob, bytes):
                raise TypeError(f"the node's {STATE} record holds no bytes")
            host.states[client_id] = from_bytes(blob)
        return host


def apply_verdict(context: Context, verdict: str) -> None:
    """The server's verdict on the state held pending since the node's last training:
    "keep" commits it, "drop" discards it, "" leaves it waiting."""
    state = context.state
    if PENDING in state:
        if verdict == "keep":
            state[STATE] = state[PENDING]
        if verdict:
            del state[PENDING]


def _client(content: RecordDict, context: Context) -> tuple[ConfigRecord, int]:
    fields = content.config_records[FIELDS]
    client_id, own = field_int(fields, "client_id"), int(context.node_config[CLIENT_ID])
    if own != client_id:
        raise RuntimeError(f"a message for client {client_id} reached the node of client {own}")
    greeted = context.state.config_records.get(GREETED)
    if greeted is None or greeted["sha256"] != _digest(str(fields["config"])):
        raise RuntimeError(
            f"client {own}: the message carries an experiment other than the one the "
            f"server greeted this node with; refused"
        )
    apply_verdict(context, str(fields["verdict"]))
    return fields, client_id


def train(content: RecordDict, context: Context, hosts: Hosts) -> RecordDict:
    """The reply to a train message: the client's update (or why there is none); the
    state it reached is held pending in ``context.state``."""
    from fedloom.runtime.state_file import to_bytes

    fields, client_id = _client(content, context)
    host = hosts.host(str(fields["config"]), client_id, context)
    reply = host.train(
        client_id,
        field_int(fields, "round"),
        field_int(fields, "attempt"),
        take_params(content, "payload"),
    )
    if client_id in host.pending:
        context.state[PENDING] = ConfigRecord({"blob": to_bytes(host.pending[client_id])})
    return train_reply_record(reply)


def evaluate(content: RecordDict, context: Context, hosts: Hosts) -> RecordDict:
    """The reply to an evaluate message: the client's scores by scope, and nothing else.
    The adapter it uses is built and scored here and stays here: after a round (round >
    0, as the simulator's server checkpoints) it is written into the node's own folder
    (:func:`checkpoint_dir`). With field ``adapter = "global"``: the scores of the
    server's adapter on the client's data."""
    fields, client_id = _client(content, context)
    host = hosts.host(str(fields["config"]), client_id, context)
    round_, payload = field_int(fields, "round"), take_params(content, "payload")
    if str(fields.get("adapter", "")) == "global":  # the server's adapter on our data
        return scores_record(host.score(client_id, round_, payload))
    scored = host.evaluate(client_id, round_, payload)
    if scored is None:
        return scores_record(None)
    adapter, scores = scored
    if round_ > 0:
        save_personal(checkpoint_dir(context, client_id), client_id, adapter, round_)
    return scores_record(scores)


def checkpoint_dir(context: Context, client_id: int) -> Path:
    """The node's checkpoint folder: node config ``checkpoint-dir``, else
    ``fedloom-node/client_NNN`` in the working directory. A setting of the node's own:
    nothing in the server's messages names it."""
    folder = context.node_config.get(CHECKPOINT_DIR)
    return Path(str(folder)) if folder else Path(NODE_FOLDER) / f"client_{client_id:03d}"


def secagg(content: RecordDict, context: Context, hosts: Hosts) -> RecordDict:
    """The reply to a stage of secure aggregation (message type ``train.secagg``): the
    client's answer (:meth:`ClientHost.exchange`, with the update its last training left on
    this node), or none when it stopped."""
    fields, client_id = _client(content, context)
    host = hosts.host(str(fields["config"]), client_id, context)
    round_, stage = field_int(fields, "round"), str(fields["stage"])
    answers = host.exchange(round_, stage, {client_id: secagg_message_from(content)})
    what = "answered" if client_id in answers else "stopped"
    log.info("client %d: round %d: secure aggregation: %s %s", client_id, round_ + 1, stage, what)
    return secagg_answer(client_id, answers.get(client_id))


def answer(kind: str, content: RecordDict, context: Context, hosts: Hosts) -> RecordDict:
    """The node's reply to a message of ``kind``: "query" (the greeting), "train",
    "evaluate" or "secagg" (a stage of secure aggregation)."""
    if kind == "query":
        return greet(content, context)
    handlers = {"train": train, "evaluate": evaluate, "secagg": secagg}
    if kind not in handlers:
        raise ValueError(f"a node answers query, train, evaluate and secagg messages, not {kind!r}")
    return handlers[kind](content, context, hosts)

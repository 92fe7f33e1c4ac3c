"""fedloom on Flower's deployment engine (``[runtime] name = "flower"``): the server
side, a ``ServerApp`` over flwr's Message API (the client side:
:mod:`fedloom.runtime.flower_client`, :mod:`fedloom.runtime.flower_node`).

:data:`server_app` builds the experiment from the config its run was started with (run
config ``config``: a fedloom TOML file; ``run-dir``: the run directory to write) and runs
the embedded simulator's rounds (:func:`fedloom.server.simulate`) with
:class:`FlowerClients` as the clients: sampling, payloads, the update checks, aggregation,
evaluation and the run directory are the local runtime's, so a run's metrics equal it (bit
for bit with one torch thread per client: ``runtime.cpus_per_worker = 1``).

**One experiment, the server's.** Every message carries the server's resolved config; a
node brings only its machine's settings. The server greets each new node with a ``query``
message: the node says which client it is, or refuses the experiment (a client id outside
the federation, data held against the config's choice, or a config file of its own that
differs in a must-agree setting, :mod:`fedloom.runtime.agreement`). A refused client is
missing from every round with the node's reason, logged, and ``federation.below_quorum``
decides. A ``train`` message carries the payload and the round (under secure aggregation the
reply carries the metrics only: the update stays on the node, and leaves it masked in the
protocol's stages, one ``train.secagg`` message round each, :meth:`FlowerClients.exchange`;
a SuperNode that dies between stages is a drop-out whose masks the others' shares
rebuild); an ``evaluate`` message
asks for the scores of the adapter a personalized client uses, or (``adapter =
"global"``) the scores of the global adapter on the client's data, which the server does
not hold under ``runtime.client_data = "nodes"``. An evaluate reply carries scores only.

**Client state stays on the node.** Optimizer moments, control variates, personal adapters
and gates live in the node's ``context.state`` (Flower keeps it for the run) and never
reach the server: a state reached in training is held there as *pending*, and the next
message to the node says whether the server accepted the round (keep it) or not (drop it),
as :meth:`ClientHost.commit` does in the other runtimes. The adapter a personalized client
uses is built, scored and checkpointed on its node, in the node's own folder
(:func:`fedloom.runtime.flower_node.checkpoint_dir`). So a Flower run's checkpoints hold
the server state only, ``fedloom run --resume`` refuses a Flower run, and what needs a
client's personal adapter at the server (Self / Others, ``eval.others``) is refused for a
personalized method: it is simulation-only.

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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fedloom.params import Params
from fedloom.runtime.clients import ScopeMetrics, Scored, TrainReply
from fedloom.runtime.flower_records import (
    FIELDS,
    field_int,
    request,
    scores_from,
    secagg_message_from,
    secagg_request,
    train_reply_from,
)

if TYPE_CHECKING:
    from fedloom.config import ExperimentConfig, RuntimeConfig

#: seconds a new node has to say which client it is
HELLO_TIMEOUT = 120.0
#: seconds between polls for replies
POLL_SECONDS = 0.2

server_app = ServerApp()
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
        #: clients whose node refused the experiment (and no node took them since): why
        self.refused: dict[int, str] = {}
        #: clients that trained since the last commit; the verdict each is told next
        self.trained: set[int] = set()
        self.verdict: dict[int, str] = {}
        self._discover(runtime.nodes_timeout)

    def _discover(self, timeout: float) -> None:
        """Wait until each of ``ids`` has a node or a refusal (:meth:`_hello_new`), at most
        ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while missing := sorted(set(self.ids) - set(self.node_of) - set(self.refused)):
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
            n: Message(
                request({"op": "hello", "config": self.config}),
                dst_node_id=n,
                message_type="query",
            )
            for n in new
        }
        for node, reply in self._send_and_receive(messages, HELLO_TIMEOUT).items():
            if not reply.has_content():
                continue
            fields = reply.content.config_records[FIELDS]
            cid, refusal = field_int(fields, "client_id"), str(fields.get("refusal", ""))
            if not refusal:
                self.node_of[cid] = node
                self.refused.pop(cid, None)
            elif cid not in self.node_of:
                log.error("client %d: its node refused the experiment: %s", cid, refusal)
                self.refused[cid] = refusal

    def _exchange(
        self, kind: str, round_: int, payloads: dict[int, Params], fields: dict[str, Any]
    ) -> dict[int, Message | str]:
        """Send each client its payload; its reply, or why none came."""
        self._hello_new()
        out: dict[int, Message | str] = {cid: self._no_reply(cid) for cid in payloads}
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

    def _no_reply(self, cid: int) -> str:
        """Why client ``cid`` has no reply, unless one comes."""
        if cid in self.node_of:
            return f"no reply from its node within runtime.reply_timeout = {self.reply_timeout} s"
        if cid in self.refused:
            return f"its node refused the experiment: {self.refused[cid]}"
        return "no SuperNode has joined as this client"

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

    def exchange(self, round_: int, stage: str, messages: Mapping[int, Any]) -> dict[int, Any]:
        """One stage of secure aggregation as a message round (``train.secagg``): each
        client's node is sent the protocol's message to it as wire bytes, and answers with
        its own, or with none when it stopped; a node that failed, or did not answer within
        ``runtime.reply_timeout``, is a drop-out at this stage."""
        sent = {
            cid: Message(
                secagg_request(
                    {
                        "op": "secagg",
                        "client_id": cid,
                        "round": round_,
                        "stage": stage,
                        "config": self.config,
                        "verdict": "",
                    },
                    message,
                ),
                dst_node_id=self.node_of[cid],
                message_type="train.secagg",
                group_id=str(round_),
            )
            for cid, message in messages.items()
            if cid in self.node_of
        }
        answers: dict[int, Any] = {}
        silent = {cid: f"no reply within {self.reply_timeout} s" for cid in sent}
        for cid, reply in self._send_and_receive(sent, self.reply_timeout).items():
            if not reply.has_content():
                silent[cid] = f"its node failed: {reply.error.reason}"
            elif (answer := secagg_message_from(reply.content)) is None:
                silent[cid] = "it stopped"
            else:
                answers[cid] = answer
                del silent[cid]
        for cid, why in silent.items():
            log.warning(
                "round %d: client %d did not answer secure aggregation's %s stage: %s",
                round_ + 1,
                cid,
                stage,
                why,
            )
        return answers

    def commit(self, client_ids: list[int]) -> None:
        accepted = set(client_ids)
        self.verdict.update({cid: "keep" if cid in accepted else "drop" for cid in self.trained})
        self.trained.clear()

    def evaluate_many(
        self,
        round_: int,
        payloads: dict[int, Params],
        on_reply: Callable[[int], None] | None = None,
    ) -> dict[int, Scored]:
        """Each client's scores after ``round_``, without an adapter: the one a client
        uses stays on its node (which checkpoints it, :func:`flower_node.evaluate`)."""
        scored: dict[int, Scored] = {}
        for cid, answer in self._exchange("evaluate", round_, payloads, {}).items():
            if isinstance(answer, str):
                log.warning("round %d: client %d not scored: %s", round_, cid, answer)
                scored[cid] = None
            else:
                scores = scores_from(answer.content)
                scored[cid] = None if scores is None else (None, scores)
        if on_reply:
            on_reply(len(scored))
        return scored

    def score_many(self, round_: int, params: dict[int, Params]) -> dict[int, ScopeMetrics | None]:
        scores: dict[int, ScopeMetrics | None] = {}
        for cid, answer in self._exchange(
            "evaluate", round_, params, {"adapter": "global"}
        ).items():
            scores[cid] = None if isinstance(answer, str) else scores_from(answer.content)
            if scores[cid] is None:
                log.warning(
                    "round %d: client %d did not score the global adapter: %s",
                    round_,
                    cid,
                    answer if isinstance(answer, str) else "no scores",
                )
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
    from fedloom.runtime.app_guard import check_pinned_run

    config, run_dir = str(context.run_config["config"]), str(context.run_config["run-dir"])
    check_pinned_run(config, run_dir)  # `fedloom serve` runs its own experiment only
    serve(grid, Path(config), Path(run_dir))


def serve(grid: Grid, config_path: Path, run_path: Path) -> dict[str, Any]:
    """The run of the fedloom config at ``config_path`` over ``grid``'s nodes, written to
    the run directory ``run_path`` (created by whoever started the run)."""
    import tomli_w

    from fedloom.config import load_config, to_toml_dict
    from fedloom.experiment import Experiment
    from fedloom.runtime.rundir import RunDir, read_status
    from fedloom.server import simulate

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

"""fedloom's Flower ``ClientApp``: each SuperNode is one client.

Flower starts this app in a new process for every message. When the node has a worker
(node config ``worker``: ``fedloom join`` and the loopback deployment start one), the app
hands the message to it (:mod:`fedloom.runtime.node_worker`), which keeps the experiment
built between messages; without one, it answers in this process
(:func:`fedloom.runtime.flower_node.answer`), building the experiment anew. Either way the
reply is the same (secure aggregation, whose stages need the update kept between
messages, runs with a worker only). The messages: ``query`` (the server's greeting),
``train``, ``evaluate`` and ``train.secagg`` (a stage of secure aggregation). This module imports nothing heavy (no torch): with a worker, a
message's process costs Flower's start-up only.
"""

from __future__ import annotations

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

#: the node config key of the worker's socket (as flower_node.WORKER, without its imports)
WORKER = "worker"

client_app = ClientApp()


def _answer(kind: str, msg: Message, context: Context) -> Message:
    content: RecordDict
    if WORKER in context.node_config:
        from fedloom.runtime.node_worker import ask

        content = ask(str(context.node_config[WORKER]), kind, msg.content, context)
    else:
        from fedloom.runtime.flower_node import Hosts, answer

        content = answer(kind, msg.content, context, Hosts())
    return Message(content, reply_to=msg)


@client_app.query()
def _query(msg: Message, context: Context) -> Message:
    return _answer("query", msg, context)


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    return _answer("train", msg, context)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return _answer("evaluate", msg, context)


@client_app.train("secagg")
def _secagg(msg: Message, context: Context) -> Message:
    return _answer("secagg", msg, context)

"""The server's side of a run, written once for every runtime: the embedded simulator
runs it with all clients in this process, Ray with its actors, Flower's ServerApp with its
nodes (a :class:`~fedloom.runtime.clients.Clients` host each).

Each round: sample clients from a seeded stream (the same clients in the same rounds for
every algorithm of an experiment), give each its payload, train it locally, aggregate,
and every ``eval.every`` rounds (and after the last) score the global adapter on the dev
set and every client's test split, and personal adapters on their own client's split.

One module a part: :mod:`.round` (one round), :mod:`.loop` (the rounds of a run, its
evaluations, checkpoints and resumption), :mod:`.summary` (what the run reports).
"""

from fedloom.server.loop import ProgressHook, clients_for, simulate
from fedloom.server.round import AllClientsFailed, sample_clients

__all__ = ["AllClientsFailed", "ProgressHook", "clients_for", "sample_clients", "simulate"]

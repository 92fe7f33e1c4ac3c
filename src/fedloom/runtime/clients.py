"""The client side of a round, wherever the clients run: :class:`ClientHost`.

A host runs some of the federation's clients on its own copy of the experiment (model and
data) and keeps their local state (optimizer moments, personal adapters, gates), which
never leaves it except into a checkpoint. The embedded simulator runs one host for every
client in its own process; the Ray runtime one per actor. The server side of the round
(sampling, payloads, the update checks, aggregation) is :mod:`fedloom.server`'s
whatever the host.

Training a client (:meth:`ClientHost.train`) runs the client half of the transform chain
(:mod:`fedloom.transforms`: ``down`` on the payload, ``up`` on the update) and the
simulated faults
(:mod:`fedloom.runtime.faults`): a straggler or a crash returns a reason instead of an
update, a drop-out trains and returns a reason, a garbage client returns the corrupted
update. The state a client reaches is held back until the server accepts the round
(:meth:`ClientHost.commit`), so a client left out of a round, or a round skipped or
retried below quorum, leaves the client's state as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fedloom.algorithms import Algorithm, ClientContext, ClientResult
from fedloom.device import to_cpu, to_device
from fedloom.evaluation.score import evaluate
from fedloom.evaluation.splits import scored_splits
from fedloom.params import Params
from fedloom.runtime import faults
from fedloom.runtime.secure_round import SecureClient
from fedloom.train.passes import ADAPT_PASSES, TRAIN_PASSES, counting
from fedloom.train.together import group_key, supported, train_together
from fedloom.transforms.secure_sum import SecureSum

if TYPE_CHECKING:
    from fedloom.experiment import ClientData, Experiment

#: keeps the seeds of client-side scoring (e.g. fine-tuning before scoring) apart from training
EVAL_SALT = 0x3E7A1


def client_seed(seed: int, round_: int, client_id: int) -> int:
    return int(np.random.default_rng([seed, round_, client_id]).integers(2**31 - 1))


def client_context(
    exp: Experiment, client: ClientData, round_: int, state: dict[str, Any], salt: int = 0
) -> ClientContext:
    """Client ``client``'s context in round ``round_`` (0-based) over its local ``state``."""
    cfg = exp.cfg
    anchor = exp.models[exp.anchor] if exp.anchor is not None else None
    return ClientContext(
        client_id=client.client_id,
        model=exp.model_for(client.client_id),
        train=client.train,
        settings=cfg.train,
        round=round_,
        total_rounds=cfg.federation.rounds,
        state=state,
        seed=client_seed(cfg.seed + salt, round_, client.client_id),
        anchor=anchor,
        anchor_train=exp.anchor_train.get(client.client_id),
        rank=exp.ranks.get(client.client_id),
        privacy=cfg.privacy if cfg.privacy.level == "sample" else None,
        val=client.val,
    )


#: the message round in which simulated attackers send what the attack forged
#: (:meth:`ClientHost.exchange`, :func:`fedloom.server.round.send_forgeries`)
SEND_FORGERY = "send_forgery"


@dataclass(frozen=True)
class TrainReply:
    """A client's answer to a round: its update, or why it has none. In a round a simulated
    attack forges, ``trained`` is the update as the client trained it (before the chain's
    client half), which the colluding, omniscient attackers see; a simulated attacker
    answers with that alone and holds its update until the forgery comes back
    (:attr:`holds`)."""

    client_id: int
    result: ClientResult | None
    missing: str | None = None
    trained: ClientResult | None = None

    @property
    def holds(self) -> bool:
        """Whether the client is a simulated attacker waiting for its forgery to send."""
        return self.result is None and self.missing is None and self.trained is not None


class Clients(Protocol):
    """Where a run's clients live: in this process (:class:`ClientHost`) or on Ray actors
    (:class:`fedloom.runtime.ray_clients.RayClients`)."""

    def train_many(
        self,
        round_: int,
        attempt: int,
        payloads: dict[int, Params],
        on_reply: Callable[[int], None] | None = None,
    ) -> list[TrainReply]:
        """Each client of ``payloads`` trained in round ``round_`` (0-based), retry
        ``attempt``: the replies in the order of ``payloads``; ``on_reply(n)`` after each
        of the n replies so far."""

    def exchange(self, round_: int, stage: str, messages: Mapping[int, Any]) -> dict[int, Any]:
        """The answers of the clients of ``messages`` to a stage of a message protocol
        after training (secure aggregation's, :mod:`fedloom.runtime.secure_round`; in a
        simulation, :data:`SEND_FORGERY`): each message delivered to its client and the
        client's answer returned; a client that does not answer is absent. A runtime
        implements this exchange, not the protocol."""

    def commit(self, client_ids: list[int]) -> None:
        """Keep the states the clients ``client_ids`` reached in the round the server
        accepted; drop every other state reached since the last commit."""

    def evaluate_many(
        self,
        round_: int,
        payloads: dict[int, Params],
        on_reply: Callable[[int], None] | None = None,
    ) -> dict[int, Scored]:
        """Each client's metrics after ``round_`` (:meth:`ClientHost.evaluate`) and, in a
        simulation, the adapter it used; ``on_reply(n)`` after each of the n clients
        scored so far."""

    def score_many(
        self, round_: int, params: dict[int, Params]
    ) -> dict[int, dict[str, dict[str, float | None]] | None]:
        """Each client's metrics by scope for the adapter ``params[client]`` after
        ``round_`` (:meth:`ClientHost.score`); None for a client that could not score."""

    def get_states(self) -> dict[int, dict[str, Any]]:
        """Every client's committed local state, for a checkpoint."""

    def set_states(self, states: dict[int, dict[str, Any]]) -> None:
        """Restore the clients' local states from a checkpoint."""


#: a client's metrics by scope (``clients``, ``val``, ``clients_split``)
ScopeMetrics = dict[str, dict[str, float | None]]
#: the adapter a client uses and its metrics by scope; None for a method without one. The
#: adapter is None where it stays on the client's node (Flower: a deployment returns the
#: metrics only); the simulator's clients (this process, Ray actors) return it
Scored = tuple[Params | None, ScopeMetrics] | None


class ClientHost:
    """Runs the clients ``client_ids`` of ``exp`` and keeps their local states."""

    def __init__(self, exp: Experiment, client_ids: list[int]) -> None:
        self.exp = exp
        self.states: dict[int, dict[str, Any]] = {cid: {} for cid in client_ids}
        self.pending: dict[int, dict[str, Any]] = {}
        #: simulated attackers that trained and wait for their forgery to send
        #: (:meth:`exchange`): what :meth:`_send` needs, its update as trained last
        self.held: dict[int, tuple[ClientContext, faults.ClientFate, Params, ClientResult]] = {}
        #: under secure aggregation: each client's side of the round's secure sum (the
        #: update it holds until it leaves masked or encrypted)
        self.secure: dict[int, SecureClient] = {}
        self.cohort_of = {c.client_id: cohort for cohort in exp.cohorts() for c in cohort.clients}
        self.clients = {c.client_id: c for c in exp.clients}

    def _party(self, client_id: int, round_: int) -> ClientData:
        """Client ``client_id``'s data in round ``round_`` (0-based; drifting clients move;
        the one party of a method that pools the data)."""
        if self.exp.algorithm.pools_data:
            return next(p for p in self.exp.parties(round_ + 1) if p.client_id == client_id)
        return self.clients[client_id].at(round_ + 1)

    def _begin(
        self, client_id: int, round_: int, attempt: int, payload: Params
    ) -> tuple[ClientContext, faults.ClientFate, Params] | TrainReply:
        """(its context, its simulated fate, its start after the chain's ``down``), or the
        reply of a client that does not train this round."""
        exp = self.exp
        # the client's state goes to its model's device for the round (fedloom.device)
        state = to_device(dict(self.states[client_id]), exp.model_for(client_id).device)
        ctx = client_context(exp, self._party(client_id, round_), round_, state)
        fate = faults.fate(exp.cfg, round_, attempt, client_id)
        if fate.missed:
            return TrainReply(client_id, None, fate.missed)
        if fate.crashes:
            return TrainReply(client_id, None, "crashed in local training (simulated)")
        return ctx, fate, exp.chain.down(payload, client_id, round_, ctx.state)

    def _finish(
        self,
        ctx: ClientContext,
        fate: faults.ClientFate,
        start: Params,
        round_: int,
        result: ClientResult,
    ) -> TrainReply:
        """The reply of a client that trained (:meth:`_send`). In a round a simulated attack
        forges (:meth:`fedloom.attacks.Attack.forging`) the reply also carries the update
        as trained, for the colluding attackers' view, and an attacker holds its update
        until the forgery comes back (:meth:`exchange`)."""
        cid, attack = ctx.client_id, self.exp.attack
        trained = replace(result, params=to_cpu(result.params))
        if not attack.forging(round_):
            return self._send(ctx, fate, start, round_, trained)
        if cid in attack.attackers:
            self.held[cid] = (ctx, fate, start, trained)
            return TrainReply(cid, None, trained=trained)
        reply = self._send(ctx, fate, start, round_, trained)
        return reply if reply.result is None else replace(reply, trained=trained)

    def _send(
        self,
        ctx: ClientContext,
        fate: faults.ClientFate,
        start: Params,
        round_: int,
        result: ClientResult,
    ) -> TrainReply:
        """What a client sends for ``result``: the chain's ``up`` on its update, then its
        simulated fate; its state held back until :meth:`commit`."""
        cid = ctx.client_id
        sent = self.exp.chain.up(result.params, start, cid, round_, ctx.state)
        result = replace(result, params=sent)
        if isinstance(secure := self.exp.chain.mask, SecureSum):
            # the update stays here until it leaves masked or encrypted (:meth:`exchange`);
            # a simulated drop-out stops mid-protocol, before sending its input
            self.secure[cid] = SecureClient(
                secure,
                cid,
                (sent, to_cpu(start), result.num_examples),
                secure.stages.index(secure.input_stage) if fate.drops_out else None,
            )
            self.pending[cid] = to_cpu(ctx.state)
            return TrainReply(cid, replace(result, params={}))
        if fate.drops_out:
            return TrainReply(cid, None, "dropped out mid-round (simulated)")
        if fate.garbage:
            result = replace(result, params=faults.corrupt(result.params, fate.garbage))
        self.pending[cid] = to_cpu(ctx.state)  # paged to host memory between rounds
        return TrainReply(cid, result)

    def train(self, client_id: int, round_: int, attempt: int, payload: Params) -> TrainReply:
        """One client's local training in round ``round_`` (0-based), retry ``attempt``."""
        begun = self._begin(client_id, round_, attempt, payload)
        if isinstance(begun, TrainReply):
            return begun
        ctx, fate, start = begun
        try:
            with counting() as counted:
                result = self.exp.algorithm.local_train(ctx, to_device(start, ctx.model.device))
        except FloatingPointError as err:
            return TrainReply(client_id, None, str(err))
        result = replace(result, metrics={**result.metrics, TRAIN_PASSES: float(counted.passes)})
        return self._finish(ctx, fate, start, round_, result)

    def train_together(
        self, client_ids: list[int], round_: int, attempt: int, payloads: dict[int, Params]
    ) -> list[TrainReply]:
        """The clients of one of :meth:`passes`' groups trained in one batched pass
        (:func:`fedloom.train.together.train_together`), each replying as :meth:`train`."""
        replies: dict[int, TrainReply] = {}
        begun = []
        for cid in client_ids:
            outcome = self._begin(cid, round_, attempt, payloads[cid])
            if isinstance(outcome, TrainReply):
                replies[cid] = outcome
            else:
                begun.append(outcome)
        with counting() as counted:  # every client of the group takes part in every pass
            trained = (
                train_together(
                    [ctx for ctx, _, _ in begun],
                    [to_device(s, ctx.model.device) for ctx, _, s in begun],
                )
                if begun
                else []
            )
        for (ctx, fate, start), (params, metrics, failure) in zip(begun, trained):
            if params is None:
                replies[ctx.client_id] = TrainReply(ctx.client_id, None, failure)
            else:
                metrics = {**metrics, TRAIN_PASSES: float(counted.passes)}
                result = ClientResult(ctx.client_id, params, len(ctx.train), metrics)
                replies[ctx.client_id] = self._finish(ctx, fate, start, round_, result)
        return [replies[cid] for cid in client_ids]

    def passes(self, round_: int, client_ids: list[int]) -> list[list[int]]:
        """``client_ids`` in the groups trained in one pass each: up to
        ``train.clients_per_pass`` clients of one backbone, step count and optimizer clock
        (:func:`fedloom.train.together.group_key`) where the method's local step is plain
        local training and the model supports it (:func:`fedloom.train.together.supported`);
        else one client a group."""
        exp = self.exp
        per_pass, alg = exp.cfg.train.clients_per_pass, exp.algorithm
        if (
            per_pass == 1
            or alg.pools_data
            or type(alg).local_train is not Algorithm.local_train
            or any(supported(m, exp.cfg.train) for m in exp.models.values())
        ):
            return [[cid] for cid in client_ids]
        groups: dict[Any, list[int]] = {}
        for cid in client_ids:
            ctx = client_context(exp, self._party(cid, round_), round_, self.states[cid])
            groups.setdefault((exp.backbone_of(cid), group_key(ctx)), []).append(cid)
        return [
            ids[i : i + per_pass] for ids in groups.values() for i in range(0, len(ids), per_pass)
        ]

    def train_many(
        self,
        round_: int,
        attempt: int,
        payloads: dict[int, Params],
        on_reply: Callable[[int], None] | None = None,
    ) -> list[TrainReply]:
        replies: dict[int, TrainReply] = {}
        for group in self.passes(round_, list(payloads)):
            if len(group) == 1:
                got = [self.train(group[0], round_, attempt, payloads[group[0]])]
            else:
                got = self.train_together(group, round_, attempt, payloads)
            for reply in got:
                replies[reply.client_id] = reply
                if on_reply:
                    on_reply(len(replies))
        return [replies[cid] for cid in payloads]

    def exchange(self, round_: int, stage: str, messages: Mapping[int, Any]) -> dict[int, Any]:
        """The answers of the clients of ``messages`` to one stage of secure aggregation,
        each its :meth:`SecureClient.answer` (a client that answers nothing is absent); at
        :data:`SEND_FORGERY` each held attacker's :class:`TrainReply` for the forged
        :class:`ClientResult` it is given, sent as it would send its own update."""
        if stage == SEND_FORGERY:
            return {
                cid: self._send(*self.held.pop(cid)[:3], round_, forged)
                for cid, forged in messages.items()
            }
        secure = self.exp.chain.mask
        if not isinstance(secure, SecureSum):
            raise TypeError("secagg: the run's chain has no secure aggregation stage")
        answers: dict[int, Any] = {}
        for cid, message in messages.items():
            side = self.secure.setdefault(cid, SecureClient(secure, cid))
            if (answer := side.answer(stage, message)) is not None:
                answers[cid] = answer
        return answers

    def commit(self, client_ids: list[int]) -> None:
        for cid in client_ids:
            if cid in self.pending:
                self.states[cid] = self.pending[cid]
        self.pending.clear()
        self.secure.clear()
        self.held.clear()

    def evaluate(
        self, client_id: int, round_: int, payload: Params
    ) -> tuple[Params, ScopeMetrics] | None:
        """The adapter client ``client_id`` uses after ``round_`` (built from a copy of its
        state, which scoring never changes) and its metrics by scope (:func:`scored_splits`
        on its backbone's cohort); where building the adapter trained (FedAvg-FT's
        fine-tuning, Per-FedAvg's adaptation step), each scope's metrics carry those
        passes as ``adapt_passes`` (:mod:`fedloom.train.passes`)."""
        cohort = self.cohort_of[client_id]
        client = self.clients[client_id].at(round_)
        device = cohort.model.device
        own = to_device(copy.deepcopy(self.states.get(client_id, {})), device)
        ctx = client_context(cohort, client, round_, own, salt=EVAL_SALT)
        with counting() as counted:
            scored = cohort.algorithm.evaluate_local(
                ctx,
                to_device(payload, device),
                scored_splits(cohort, client),
                cohort.cfg.eval.batch_size,
            )
        if scored is not None and counted.passes:
            adapter, metrics = scored
            passes = float(counted.passes)
            scored = adapter, {scope: {**m, ADAPT_PASSES: passes} for scope, m in metrics.items()}
        return to_cpu(scored)

    def evaluate_many(
        self,
        round_: int,
        payloads: dict[int, Params],
        on_reply: Callable[[int], None] | None = None,
    ) -> dict[int, Scored]:
        scored: dict[int, Scored] = {}
        for cid, payload in payloads.items():
            scored[cid] = self.evaluate(cid, round_, payload)
            if on_reply:
                on_reply(len(scored))
        return scored

    def score(
        self, client_id: int, round_: int, params: Params
    ) -> dict[str, dict[str, float | None]]:
        """The adapter ``params`` (the global one) scored on client ``client_id``'s
        :func:`scored_splits` after ``round_``, by scope; empty splits are skipped."""
        cohort = self.cohort_of[client_id]
        splits = scored_splits(cohort, self.clients[client_id].at(round_))
        return {
            scope: evaluate(cohort.model, params, features, cohort.cfg.eval.batch_size)
            for scope, features in splits.items()
            if features
        }

    def score_many(
        self, round_: int, params: dict[int, Params]
    ) -> dict[int, dict[str, dict[str, float | None]] | None]:
        return {cid: self.score(cid, round_, p) for cid, p in params.items()}

    def get_states(self) -> dict[int, dict[str, Any]]:
        return self.states

    def set_states(self, states: dict[int, dict[str, Any]]) -> None:
        self.states.update({cid: state for cid, state in states.items() if cid in self.states})

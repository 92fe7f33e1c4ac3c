"""One round on the server, in every runtime: sample the clients, send their payloads,
(in a simulated attack, have the attackers send their forgeries), take the updates through
the transform chain's server half, check each, and say who is missing and why.

A client whose training diverges (non-finite loss or update) is dropped from the round
and logged; the round goes on with the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fedloom.algorithms import ClientResult
from fedloom.algorithms.lora_factors import wire_bytes
from fedloom.config import ExperimentConfig
from fedloom.diagnostics import client_drift
from fedloom.experiment import Experiment
from fedloom.params import Params
from fedloom.runtime import faults, secure_round
from fedloom.runtime.clients import SEND_FORGERY, Clients, TrainReply
from fedloom.runtime.cohorts import Servers
from fedloom.transforms.secure_sum import QUANT_BITS_KEY, SUM_KEY, SecureSum

ProgressHook = Callable[[str, int, int], None]


class AllClientsFailed(RuntimeError):
    """No client of a round produced a usable update."""


def sample_clients(
    ids: list[int],
    fraction: float,
    min_clients: int,
    seed: int,
    round_: int,
    attempt: int = 0,
) -> list[int]:
    """``max(min_clients, ceil(fraction * K))`` clients, seeded by (seed, round) and, for a
    retried round, the attempt."""
    k = len(ids)
    m = min(k, max(min_clients, math.ceil(fraction * k)))
    rng = np.random.default_rng([seed, round_, 0x5A3, *([attempt] if attempt else [])])
    return sorted(int(i) for i in rng.choice(ids, size=m, replace=False))


def _rank(exp: Experiment, result: ClientResult) -> int | None:
    """The LoRA rank a client sent at: the one it reports (HetLoRA's pruning), else its own."""
    reported = result.metrics.get("rank")
    return int(reported) if reported is not None else exp.ranks.get(result.client_id)


def reasons(missing: Mapping[int, str]) -> dict[str, str]:
    return {str(c): why for c, why in sorted(missing.items())}


def quorate_round(
    exp: Experiment,
    servers: Servers,
    ids: list[int],
    host: Clients,
    r: int,
    log: logging.Logger,
    progress: ProgressHook | None,
    chain_states: Sequence[Mapping[str, Any]],
) -> tuple[list[int], RoundOutcome, list[dict[str, Any]]]:
    """(the sampled clients, the outcome, the earlier attempts) of round ``r``: with
    ``federation.below_quorum = "retry"`` an attempt with fewer than ``min_clients``
    accepted updates is recorded and the round tried again with a fresh sample; "fail"
    (and "retry" out of retries) raises :class:`AllClientsFailed`; "skip" returns the
    outcome below quorum, for the caller to skip the round."""
    cfg = exp.cfg
    fed = cfg.federation
    attempts = 1 + (fed.retries if fed.below_quorum == "retry" else 0)
    retried: list[dict[str, Any]] = []
    for attempt in range(attempts):
        sampled = sample_clients(ids, fed.fraction, fed.min_clients, cfg.seed, r, attempt)
        outcome = train_round(exp, servers, sampled, host, r, attempt, log, progress, chain_states)
        if len(outcome.results) >= fed.min_clients or fed.below_quorum == "skip":
            return sampled, outcome, retried
        retried.append({"clients": sampled, "missing": reasons(outcome.missing)})
        if attempt + 1 < attempts:
            log.warning("round %d: %s; retrying", r + 1, below_quorum(cfg, r, sampled, outcome))
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    raise AllClientsFailed(below_quorum(cfg, r, sampled, outcome) + tries)


def below_quorum(cfg: ExperimentConfig, r: int, sampled: list[int], outcome: RoundOutcome) -> str:
    if not outcome.results:
        return f"round {r + 1}: every sampled client failed ({sorted(outcome.missing)})"
    return (
        f"round {r + 1}: {len(outcome.results)} of the {len(sampled)} sampled clients "
        f"reported, fewer than federation.min_clients = {cfg.federation.min_clients} "
        f"(missing: {sorted(outcome.missing)})"
    )


@dataclass
class RoundOutcome:
    """One attempt at a round's local training."""

    results: list[ClientResult]
    #: sampled clients without an accepted update, and why
    missing: dict[int, str]
    #: each reporting client's drift ‖w_k − w‖ from its payload
    drifts: dict[int, float]
    #: bytes of the payloads sent (:func:`wire_bytes`)
    bytes_down: int
    #: bytes of the accepted updates as they travelled (after the clients' transforms)
    bytes_up: int = 0
    #: the transform chain's server states after this attempt, and its measurements
    chain_states: list[Mapping[str, Any]] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    #: the train row's secure-aggregation entries (:meth:`SecureRound.row`), if any
    secagg: dict[str, Any] = field(default_factory=dict)


def train_round(
    exp: Experiment,
    servers: Servers,
    sampled: list[int],
    host: Clients,
    r: int,
    attempt: int,
    log: logging.Logger,
    progress: ProgressHook | None,
    chain_states: Sequence[Mapping[str, Any]],
) -> RoundOutcome:
    """Local training of the sampled clients on ``host``; the server checks each update's
    size as it arrived, runs the server half of the transform chain on the round's updates
    (:mod:`fedloom.transforms`) and checks what comes out
    (:func:`fedloom.runtime.faults.update_problem`). A client that misses the round
    (straggler, crash, drop-out, a diverged loss, a rejected update) is logged and left
    out; :meth:`ClientHost.commit` later keeps the states of the accepted ones."""
    alg, cfg = exp.algorithm, exp.cfg
    out = RoundOutcome([], {}, {}, 0)
    payloads = servers.payloads(alg, sampled)
    cast = exp.chain.broadcast(payloads, r, chain_states)
    out.bytes_down = sum(wire_bytes(p, exp.ranks.get(cid)) for cid, p in cast.sent.items())
    starts = cast.starts  # what each client rebuilds and trains from
    replies = host.train_many(
        r,
        attempt,
        cast.sent,
        on_reply=None
        if progress is None
        else (lambda done: progress("client", done, len(sampled))),
    )
    honest: dict[int, Params] = {}  # the attackers' updates as they trained them
    replies = send_forgeries(exp, host, replies, starts, r, honest)
    arrived: dict[int, ClientResult] = {}
    for reply in replies:
        cid, missing = reply.client_id, reply.missing
        if reply.result is not None:
            problem = faults.oversize(reply.result.params, faults.update_limit(cfg, payloads[cid]))
            missing = f"rejected: {problem}" if problem else None
            if problem is None:
                arrived[cid] = reply.result
        if missing is not None:
            _leave_out(out, cid, missing, r, log)
    sent = {cid: res.params for cid, res in arrived.items()}
    if isinstance(secure := exp.chain.mask, SecureSum) and arrived:
        sent = _secure_sum(exp, secure, host, arrived, starts, r, out, log)
    served = exp.chain.server(sent, {cid: starts[cid] for cid in sent}, r, cast.state["states"])
    decoded = served.updates
    out.chain_states, out.measurements = list(served.state["states"]), dict(served.measurements)
    for cid, wire in arrived.items():
        if cid in out.missing:  # not summed under secure aggregation
            continue
        if cid not in decoded:
            _leave_out(out, cid, f"rejected: {served.rejected.get(cid, 'not decoded')}", r, log)
            continue
        payload, params = starts[cid], decoded[cid]
        if problem := faults.update_problem(params, payload, None):
            forged = " (forged by the attack)" if cid in honest else ""
            _leave_out(out, cid, f"rejected: {problem}{forged}", r, log)
            continue
        result = replace(wire, params=params)
        out.results.append(result)
        out.bytes_up += wire_bytes(wire.params, _rank(exp, wire))
        # a method may send nothing (local); under secure aggregation no single update
        if payload.keys() & params.keys() and not out.secagg:
            out.drifts[cid] = client_drift(payload, honest.get(cid, params))
    return out


def send_forgeries(
    exp: Experiment,
    host: Clients,
    replies: list[TrainReply],
    starts: Mapping[int, Params],
    r: int,
    honest: dict[int, Params],
) -> list[TrainReply]:
    """``replies`` with each simulated attacker's (:attr:`TrainReply.holds`) replaced by
    what its client sends for the attack's forgery (:meth:`fedloom.attacks.Attack.poison`):
    the attackers' host takes each forgery through the chain's client half as it takes an
    update (:data:`SEND_FORGERY`), so clipping, compression, noise and secure aggregation
    act on it as on a real attacker's message. The colluding attackers see every update
    of the round as trained that passes the server's checks
    (:func:`fedloom.runtime.faults.update_problem`), in the order of ``replies``;
    ``honest`` gets each forging attacker's own."""
    held = {
        reply.client_id: reply.trained
        for reply in replies
        if reply.holds and reply.trained is not None
    }
    if not held:
        return replies
    seen = [
        reply.trained
        for reply in replies
        if reply.trained is not None
        and not faults.update_problem(reply.trained.params, starts[reply.client_id], None)
    ]
    trained_from = {
        res.client_id: exp.algorithm.trained_from(starts[res.client_id], res) for res in seen
    }
    poisoned = {res.client_id: res for res in exp.attack.poison(seen, trained_from, r)}
    to_send = {cid: poisoned.get(cid, trained) for cid, trained in held.items()}
    honest.update({cid: held[cid].params for cid, res in to_send.items() if res is not held[cid]})
    answers = host.exchange(r, SEND_FORGERY, to_send)
    return [
        answers.get(reply.client_id, TrainReply(reply.client_id, None, "did not send"))
        if reply.holds
        else reply
        for reply in replies
    ]


def _secure_sum(
    exp: Experiment,
    secure: SecureSum,
    host: Clients,
    arrived: dict[int, ClientResult],
    starts: dict[int, Params],
    r: int,
    out: RoundOutcome,
    log: logging.Logger,
) -> dict[int, Params]:
    """Secure aggregation among the clients that trained (:mod:`fedloom.runtime.secure_round`):
    what the chain's server half gets for each summed client (the unmasked sum), the
    others left out of ``out``, the protocol's bytes and row entries added to it."""
    weights = {cid: secure.weight(res.num_examples) for cid, res in arrived.items()}
    done = secure_round.run(host, secure, weights, r, secure.dim(starts[min(arrived)]))
    for cid, why in done.missing.items():
        _leave_out(out, cid, why, r, log)
    out.bytes_up += sum(done.bytes_up.values())
    out.bytes_down += sum(done.bytes_down.values())
    out.secagg = done.row()
    if done.result is None:
        return {}
    summed = {
        SUM_KEY: torch.from_numpy(done.result.total),
        QUANT_BITS_KEY: torch.tensor([done.setup.quant_bits]),
    }
    return {cid: summed for cid in done.result.survivors}


def _leave_out(out: RoundOutcome, cid: int, why: str, r: int, log: logging.Logger) -> None:
    out.missing[cid] = why
    log.warning("round %d: client %d left out: %s", r + 1, cid, why)

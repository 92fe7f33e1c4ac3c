"""The embedded simulator: all clients in one process, sharing one backbone.

Each round: sample clients from a seeded stream (the same clients in the same rounds for
every algorithm of an experiment), give each its payload, train it locally, aggregate,
and every ``eval.every`` rounds (and after the last) score the global adapter on the dev
set and every client's test split, and personal adapters on their own client's split.

A client whose training diverges (non-finite loss or update) is dropped from the round
and logged; the round goes on with the others.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fedloom.algorithms import Algorithm, ClientResult
from fedloom.algorithms.lora_factors import wire_bytes
from fedloom.attacks import Attack
from fedloom.baselines.local import local_config
from fedloom.config import ExperimentConfig, to_toml_dict
from fedloom.data import plot_label_heatmap
from fedloom.device import memory
from fedloom.diagnostics import client_drift
from fedloom.evaluation.round import evaluate_round
from fedloom.evaluation.scopes import Evaluation
from fedloom.experiment import Experiment, alignment_cache
from fedloom.params import Params
from fedloom.privacy import client_level, sample_level
from fedloom.report.relevance import plot_relevance
from fedloom.runtime import faults, secure_round
from fedloom.runtime.checkpoint import ResumePoint, load_point, rewind_metrics, save_point
from fedloom.runtime.client_state import save_client_state
from fedloom.runtime.clients import ClientHost, Clients, client_seed
from fedloom.runtime.cohorts import ALL, Servers
from fedloom.runtime.diagnostics import diagnostics_row, gradient_due, gradient_measures
from fedloom.runtime.root_update import server_step
from fedloom.runtime.rundir import RunDir
from fedloom.train.passes import ADAPT_PASSES, TRAIN_PASSES
from fedloom.transforms.secure_sum import QUANT_BITS_KEY, SUM_KEY, SecureSum
from fedloom.versions import versions

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


def simulate(
    exp: Experiment,
    run: RunDir,
    progress: ProgressHook | None = None,
    *,
    resume: bool = False,
    clients: Clients | None = None,
) -> dict[str, Any]:
    """Run every round of ``exp``, writing metrics and checkpoints into ``run``; with
    ``resume``, continue ``run`` from its newest good resumable checkpoint
    (:mod:`fedloom.runtime.checkpoint`; ``exp`` built from the run's config.toml). The
    clients run where ``clients`` says (Flower's ServerApp passes its nodes), else where
    :func:`clients_for` puts them."""
    cfg = exp.cfg
    start = None
    if resume:
        start, skipped = load_point(run)
        rewind_metrics(run, start)
    else:  # the run directory is complete (and `fedloom eval`-able) however simulate is called
        run.write_config(to_toml_dict(cfg))
        run.write_json("versions.json", versions())  # what made it: Python, torch, fedloom...
        for name in exp.alignment:  # the PQ-LoRA alignments the models use, for `fedloom eval`
            (run.path / "alignment").mkdir(exist_ok=True)
            shutil.copyfile(alignment_cache(cfg) / name, run.path / "alignment" / name)
        run.write_json("partition.json", exp.partition_stats())
        if not exp.data.on_nodes:
            plot_label_heatmap(
                exp.data.label_counts(),
                exp.data.label_names,
                run.path / "partition.png",
                title=f"{cfg.name}: training labels per client",
            )
    hosting = nullcontext(clients) if clients is not None else clients_for(exp)
    with run.logger() as log, run.tracking(cfg.federation.rounds), hosting as host:
        if start is not None:
            for line in skipped:
                log.warning("resume: %s", line)
            log.info("resumed after round %d", start.round)
            run.write_status("running", round_=start.round)
        summary = _run_rounds(exp, run, log, progress, start, host)
        if "local" in cfg.eval.baselines:
            summary = _with_local_baseline(cfg, run, summary, progress, log)
        return summary


def _with_local_baseline(
    cfg: ExperimentConfig,
    run: RunDir,
    summary: dict[str, Any],
    progress: ProgressHook | None,
    log: logging.Logger,
) -> dict[str, Any]:
    """``summary`` with the ``local`` baseline's client scores (:mod:`fedloom.baselines.local`),
    trained into ``RUN_DIR/baselines/local/`` and rewritten into summary.json."""
    log.info("local baseline: every client trains alone (%s)", run.path / "baselines" / "local")
    alone = RunDir(run.path / "baselines" / "local")
    alone.path.mkdir(parents=True, exist_ok=True)
    phase = None if progress is None else _phase(progress, "local baseline")
    scores = simulate(Experiment.build(local_config(cfg)), alone, phase)
    summary = {**summary, "local": scores.get("personal", {})}
    run.write_json("summary.json", summary)
    return summary


def _phase(progress: ProgressHook, name: str) -> ProgressHook:
    """``progress`` with every event's kind prefixed by ``name`` (``"local baseline round"``)."""
    return lambda kind, done, of: progress(f"{name} {kind}", done, of)


@contextmanager
def clients_for(exp: Experiment) -> Iterator[Clients]:
    """Where ``exp``'s clients run (``[runtime] name``): this process, or Ray actors
    (stopped when the block ends, also on error)."""
    ids = [p.client_id for p in exp.parties()]
    if exp.cfg.runtime.name == "ray":
        from fedloom.runtime.ray_clients import RayClients

        with RayClients(exp.cfg, ids) as clients:
            yield clients
    else:
        yield ClientHost(exp, ids)


def _peak_memory(exp: Experiment) -> dict[str, int]:
    """The peak device memory this process allocated (CUDA only; the clients of a Ray or
    Flower run report theirs elsewhere)."""
    used = memory(exp.device)
    return {} if used is None else {"peak_device_bytes": used["peak"]}


def _run_rounds(
    exp: Experiment,
    run: RunDir,
    log: logging.Logger,
    progress: ProgressHook | None,
    start: ResumePoint | None,
    host: Clients,
) -> dict[str, Any]:
    cfg, alg = exp.cfg, exp.algorithm
    ids = [p.client_id for p in exp.parties()]
    rounds = cfg.federation.rounds
    began = time.perf_counter()
    ledger: client_level.Ledger | sample_level.SampleLedger | None = (
        client_level.Ledger(cfg)
        if client_level.on(cfg)
        else sample_level.SampleLedger(cfg)
        if sample_level.on(cfg)
        else None
    )
    if start is None:
        servers = Servers.init(exp)
        chain_states = list(exp.chain.init_state())
        first, elapsed, evaluation = 0, 0.0, Evaluation()
        log.info("experiment %s: %d parties, algorithm %s", cfg.name, len(ids), alg.name)
        if isinstance(ledger, client_level.Ledger):
            _announce_privacy(cfg, log)
        if cfg.eval.initial:
            _evaluate_and_save(exp, run, servers, 0, host, log, progress)
    else:
        host.set_states({cid: start.local_states.get(cid, {}) for cid in ids})
        servers = Servers.restored(exp, start.states)
        chain_states = list(start.chain_states or exp.chain.init_state())
        if ledger is not None:
            ledger = type(ledger).from_json(cfg, start.releases)
        first, elapsed = start.round, start.elapsed
        evaluation = Evaluation(summary=start.evaluation)
    for r in range(first, rounds):
        parties = {p.client_id: p for p in exp.parties(r + 1)}
        # gradient diagnostics compare clients on one model: single-backbone federations
        gradients = (
            gradient_measures(
                exp,
                servers.state_of(ids[0]).global_params,
                list(parties.values()),
                client_seed(cfg.seed, r, 0x6D5),
            )
            if gradient_due(exp, r + 1) and not exp.mixed
            else None
        )
        sampled, outcome, retried = _quorate_round(
            exp, servers, ids, host, r, log, progress, chain_states
        )
        results = outcome.results
        quorate = len(results) >= cfg.federation.min_clients
        host.commit([res.client_id for res in results] if quorate else [])
        released: dict[str, Any] = {}
        if quorate:
            servers = servers.aggregate(alg, results, server_step(exp, r))
            chain_states = exp.chain.commit(
                outcome.chain_states, [res.client_id for res in results]
            )
            if isinstance(ledger, client_level.Ledger) and "dp_fedavg" in outcome.measurements:
                released = ledger.record(outcome.measurements["dp_fedavg"], sampled)
            elif isinstance(ledger, sample_level.SampleLedger):
                released = ledger.record(results)
        losses = {str(res.client_id): res.metrics["train_loss"] for res in results}
        mean_loss = float(np.mean(list(losses.values()))) if losses else None
        run.append_metrics(
            {
                "round": r + 1,
                "scope": "train",
                "clients": sampled,
                "failed": sorted(outcome.missing),
                "missing": _reasons(outcome.missing),
                "train_loss": mean_loss,
                "per_client": losses,
                TRAIN_PASSES: {
                    str(res.client_id): res.metrics.get(TRAIN_PASSES, 0.0) for res in results
                },
                "bytes_down": outcome.bytes_down,
                "bytes_up": outcome.bytes_up,
                **({"retried": retried} if retried else {}),
                **exp.attack.train_row(results, r),
                **outcome.secagg,
                **({} if quorate else {"skipped": _below_quorum(cfg, r, sampled, outcome)}),
                **released,
                **(
                    {"epsilon": ledger.epsilon(), "delta": client_level.delta(cfg)}
                    if isinstance(ledger, client_level.Ledger) and not released
                    else {}
                ),
            }
        )
        steps = {res.client_id: res.metrics.get("local_steps", 0.0) for res in results}
        run.append_metrics(diagnostics_row(exp, r + 1, outcome.drifts, steps, gradients))
        for tag, state in servers.tagged():
            assignment = alg.assignment(state)
            if assignment is not None:
                run.append_metrics(
                    {
                        "round": r + 1,
                        "scope": "clusters",
                        **tag,
                        "assignment": _by_client(assignment),
                    }
                )
            for row in alg.round_rows(state):
                run.append_metrics({"round": r + 1, **row, **tag})
        if quorate:
            log.info("round %d/%d: train_loss %.4f", r + 1, rounds, mean_loss)
        else:
            log.warning(
                "round %d/%d skipped: %s", r + 1, rounds, _below_quorum(cfg, r, sampled, outcome)
            )
        if (r + 1) % cfg.eval.every == 0 or r + 1 == rounds:
            evaluation = _evaluate_and_save(exp, run, servers, r + 1, host, log, progress)
        if (r + 1) % cfg.checkpoint.every == 0 or r + 1 == rounds:
            save_point(
                run,
                ResumePoint(
                    round=r + 1,
                    states=servers.states,
                    local_states=host.get_states(),
                    evaluation=evaluation.summary,
                    elapsed=elapsed + time.perf_counter() - began,
                    metrics_bytes=run.metrics_path.stat().st_size,
                    chain_states=chain_states,
                    releases=ledger.to_json() if ledger is not None else [],
                ),
                cfg.checkpoint.keep,
            )
        run.write_status("running", round_=r + 1)
        if progress:
            progress("round", r + 1, rounds)
    summary = {
        "name": cfg.name,
        "task": exp.task.name,
        "algorithm": alg.name,
        "rounds": rounds,
        "main_metric": exp.task.main_metric,
        "label_names": list(exp.task.label_names),  # class ids index it; [] for a numeric label
        **evaluation.summary,
        **_final_server_entries(alg, servers),
        **({"privacy": ledger.summary()} if ledger is not None else {}),
        "compute": {**exp.compute(), **_peak_memory(exp), **passes_summary(run, alg)},
        "wall_seconds": round(elapsed + time.perf_counter() - began, 2),
    }
    run.write_json("summary.json", summary)
    if (
        isinstance(ledger, client_level.Ledger)
        and summary["privacy"]["epsilon"] > client_level.LOOSE_EPSILON
    ):
        log.warning("privacy: %s", client_level.loose(cfg, summary["privacy"]))
    elif ledger is not None and summary["privacy"]["epsilon"] > client_level.LOOSE_EPSILON:
        log.warning(
            "privacy: a client's DP-SGD epsilon reached %.3g, above %g, which promises "
            "little: raise privacy.noise_multiplier or train fewer steps",
            summary["privacy"]["epsilon"],
            client_level.LOOSE_EPSILON,
        )
    if "relevance" in summary:
        plot_relevance(
            summary["relevance"]["matrix"],
            summary["relevance"]["clients"],
            run.path / "relevance.png",
            title=f"{cfg.name}: client relevance S",
        )
    log.info("done in %.1f s", summary["wall_seconds"])
    return summary


def passes_summary(run: RunDir, alg: Algorithm) -> dict[str, float]:
    """summary.json's local compute, from metrics.jsonl (all rounds, resumed ones too):
    ``train_passes_per_client_round``, the mean training passes (:mod:`fedloom.train.passes`)
    of a client's round over the updates the server received (0 for a method that pools
    the data: one party does the work, ``pooled_passes_per_round`` a round); and where
    building the adapter a client is scored with trains (FedAvg-FT, Per-FedAvg),
    ``adapt_passes_per_client``, their mean over the clients at the last evaluation."""
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines() if line]
    per_round = [
        list(r[TRAIN_PASSES].values())
        for r in rows
        if r.get("scope") == "train" and TRAIN_PASSES in r
    ]
    counts = [float(p) for passes in per_round for p in passes]
    mean = float(np.mean(counts)) if counts else 0.0
    out = (
        {TRAIN_PASSES + "_per_client_round": 0.0, "pooled_passes_per_round": mean}
        if alg.pools_data
        else {TRAIN_PASSES + "_per_client_round": mean}
    )
    scored = [
        r for r in rows if str(r.get("scope", "")).startswith("personal/") and "per_client" in r
    ]
    if scored:  # the last evaluation's first client scope (each scope has the same passes)
        first = next(r for r in scored if r.get("round") == scored[-1].get("round"))
        adapt = [
            float(s[ADAPT_PASSES])
            for s in first["per_client"].values()
            if isinstance(s, dict) and ADAPT_PASSES in s
        ]
        if adapt:
            out[ADAPT_PASSES + "_per_client"] = float(np.mean(adapt))
    return out


def _announce_privacy(cfg: ExperimentConfig, log: logging.Logger) -> None:
    """The noise the run will add, before the first round (and how it was chosen)."""
    p = cfg.privacy
    z = client_level.noise_multiplier(cfg)
    chosen = (
        f" (chosen for target epsilon {p.target_epsilon:g} over {cfg.federation.rounds} rounds)"
        if p.target_epsilon is not None
        else ""
    )
    log.info(
        "privacy: DP-FedAvg, noise multiplier %.4g%s, clip norm %g%s, %s noise, delta %.3g, "
        "%s accountant",
        z,
        chosen,
        p.clip_norm,
        " (adaptive)" if p.adaptive_quantile is not None else "",
        p.noise,
        client_level.delta(cfg),
        client_level.accountant_name(cfg),
    )


def _final_server_entries(alg: Algorithm, servers: Servers) -> dict[str, Any]:
    """The final clusters and the method's own summary entries: as they are for one
    state; by backbone (``{"backbones": {b: ...}}``) for one state per backbone."""
    entries: dict[str, dict[str, Any]] = {}
    for tag, state in servers.tagged():
        own = {
            **({} if (final := alg.assignment(state)) is None else {"clusters": _by_client(final)}),
            **alg.summary(state),
        }
        entries[tag.get("backbone", ALL)] = own
    if ALL in entries:
        return entries[ALL]
    return (
        {"server_by_backbone": {b: e for b, e in entries.items() if e}}
        if any(entries.values())
        else {}
    )


def _by_client(assignment: Mapping[int, int]) -> dict[str, int]:
    return {str(c): int(j) for c, j in sorted(assignment.items())}


def _reasons(missing: Mapping[int, str]) -> dict[str, str]:
    return {str(c): why for c, why in sorted(missing.items())}


def _rank(exp: Experiment, result: ClientResult) -> int | None:
    """The LoRA rank a client sent at: the one it reports (HetLoRA's pruning), else its own."""
    reported = result.metrics.get("rank")
    return int(reported) if reported is not None else exp.ranks.get(result.client_id)


def _quorate_round(
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
        outcome = _train_round(exp, servers, sampled, host, r, attempt, log, progress, chain_states)
        if len(outcome.results) >= fed.min_clients or fed.below_quorum == "skip":
            return sampled, outcome, retried
        retried.append({"clients": sampled, "missing": _reasons(outcome.missing)})
        if attempt + 1 < attempts:
            log.warning("round %d: %s; retrying", r + 1, _below_quorum(cfg, r, sampled, outcome))
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    raise AllClientsFailed(_below_quorum(cfg, r, sampled, outcome) + tries)


def _below_quorum(cfg: ExperimentConfig, r: int, sampled: list[int], outcome: RoundOutcome) -> str:
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


def _train_round(
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
    served = exp.chain.server(
        sent,
        {cid: starts[cid] for cid in sent},
        r,
        cast.state["states"],
    )
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
            _leave_out(out, cid, f"rejected: {problem}", r, log)
            continue
        result = replace(wire, params=params)
        out.results.append(result)
        out.bytes_up += wire_bytes(wire.params, _rank(exp, wire))
        # a method may send nothing (local); under secure aggregation no single update
        if payload.keys() & params.keys() and not out.secagg:
            out.drifts[cid] = client_drift(payload, params)
    # [attack]: model poisoning, on each update from what its client trained
    trained_from = {
        res.client_id: alg.trained_from(starts[res.client_id], res) for res in out.results
    }
    out.results = exp.attack.poison(out.results, trained_from, r)
    check_forged(exp.attack, out, starts, r, log)
    return out


def check_forged(
    attack: Attack,
    out: RoundOutcome,
    starts: dict[int, Params],
    r: int,
    log: logging.Logger,
) -> None:
    """The server's check (:func:`fedloom.runtime.faults.update_problem`) of what the
    round's attackers send in place of their updates: a forged update that is not finite
    (an attack's strength that overflows) is rejected and left out, as any client's is."""
    attackers = set(attack.attacking([res.client_id for res in out.results], r))
    for res in [res for res in out.results if res.client_id in attackers]:
        if problem := faults.update_problem(res.params, starts[res.client_id], None):
            out.results.remove(res)
            out.drifts.pop(res.client_id, None)
            _leave_out(out, res.client_id, f"rejected: {problem} (forged by the attack)", r, log)


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


def _evaluate_and_save(
    exp: Experiment,
    run: RunDir,
    servers: Servers,
    round_: int,
    host: Clients,
    log: logging.Logger,
    progress: ProgressHook | None = None,
) -> Evaluation:
    """The round's evaluation (:func:`fedloom.evaluation.round.evaluate_round`): its rows
    appended to metrics.jsonl and, after a round, the checkpoints written."""
    evaluation = evaluate_round(exp, servers, round_, host, progress)
    for row in evaluation.rows:
        run.append_metrics({"round": round_, **row})
    if round_ > 0:
        _checkpoint(exp, run, servers, evaluation.adapters, host.get_states())
    log.info("round %d evaluation: %s", round_, evaluation.summary)
    return evaluation


def _checkpoint(
    exp: Experiment,
    run: RunDir,
    servers: Servers,
    adapters: dict[int, Params],
    local_states: Mapping[int, dict[str, Any]],
) -> None:
    """The global adapter(s) or the cluster adapters (server side; one file per backbone
    in a mixed federation run within architecture); each client's adapter and local state
    (client side: in a deployment each client writes its own)."""
    for tag, state in servers.tagged():
        if exp.algorithm.has_global:
            run.save_global(state.global_params, state.round, tag.get("backbone"))
        for j, params in enumerate(exp.algorithm.cluster_adapters(state) or []):
            run.save_cluster(j, params, state.round, tag.get("backbone"))
    round_ = max(state.round for state in servers.states.values())
    for cid, params in adapters.items():
        run.save_personal(cid, params, round_)
    for cid, local in local_states.items():
        if local:
            save_client_state(
                run.checkpoints / "clients" / f"client_{cid:03d}.safetensors", local, round_, cid
            )

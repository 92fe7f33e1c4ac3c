"""A run on the server: every round (:mod:`.round`), the evaluations and checkpoints,
resuming, the ``local`` baseline, and where the clients run (this process or Ray actors;
Flower's ServerApp passes its nodes)."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from fedloom.baselines.local import local_config
from fedloom.config import ExperimentConfig, to_toml_dict
from fedloom.data import plot_label_heatmap
from fedloom.evaluation.round import evaluate_round
from fedloom.evaluation.samples import SAMPLES_FILE, generation_samples
from fedloom.evaluation.scopes import Evaluation
from fedloom.experiment import Experiment, alignment_cache
from fedloom.params import Params
from fedloom.privacy.ledger import RoundRelease, ledger_for
from fedloom.runtime.checkpoint import ResumePoint, load_point, rewind_metrics, save_point
from fedloom.runtime.client_state import save_client_state
from fedloom.runtime.clients import ClientHost, Clients, client_seed
from fedloom.runtime.cohorts import Servers
from fedloom.runtime.diagnostics import diagnostics_row, gradient_due, gradient_measures
from fedloom.runtime.root_update import server_step
from fedloom.runtime.rundir import RunDir
from fedloom.server.round import ProgressHook, below_quorum, quorate_round, reasons
from fedloom.server.summary import by_client, write_summary
from fedloom.train.passes import TRAIN_PASSES
from fedloom.versions import versions


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
    ledger = ledger_for(cfg, start.releases if start is not None else None)
    if start is None:
        servers = Servers.init(exp)
        chain_states = list(exp.chain.init_state())
        first, elapsed, evaluation = 0, 0.0, Evaluation()
        log.info("experiment %s: %d parties, algorithm %s", cfg.name, len(ids), alg.name)
        if ledger is not None:
            ledger.announce(log)
        if cfg.eval.initial:
            _evaluate_and_save(exp, run, servers, 0, host, log, progress)
    else:
        host.set_states({cid: start.local_states.get(cid, {}) for cid in ids})
        servers = Servers.restored(exp, start.states)
        chain_states = list(start.chain_states or exp.chain.init_state())
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
        sampled, outcome, retried = quorate_round(
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
            if ledger is not None:
                events = exp.chain.dp_events(outcome.measurements)
                released = ledger.record(RoundRelease(sampled, results, events))
        losses = {str(res.client_id): res.metrics["train_loss"] for res in results}
        mean_loss = float(np.mean(list(losses.values()))) if losses else None
        run.append_metrics(
            {
                "round": r + 1,
                "scope": "train",
                "clients": sampled,
                "failed": sorted(outcome.missing),
                "missing": reasons(outcome.missing),
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
                **({} if quorate else {"skipped": below_quorum(cfg, r, sampled, outcome)}),
                **released,
                **(ledger.unreleased_row() if ledger is not None and not released else {}),
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
                        "assignment": by_client(assignment),
                    }
                )
            for row in alg.round_rows(state):
                run.append_metrics({"round": r + 1, **row, **tag})
        if quorate:
            log.info("round %d/%d: train_loss %.4f", r + 1, rounds, mean_loss)
        else:
            log.warning(
                "round %d/%d skipped: %s", r + 1, rounds, below_quorum(cfg, r, sampled, outcome)
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
    return write_summary(
        exp, run, servers, evaluation, ledger, elapsed + time.perf_counter() - began, log
    )


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
    if exp.task.generative and round_ == exp.cfg.federation.rounds and not exp.data.on_nodes:
        samples = generation_samples(exp, servers, evaluation.adapters, round_)
        run.write_jsonl(SAMPLES_FILE, samples)
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

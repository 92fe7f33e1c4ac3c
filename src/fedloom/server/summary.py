"""What a finished run reports: summary.json (the last evaluation, the method's own
entries, the privacy spent, the compute) and the local compute read back from
metrics.jsonl."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedloom.algorithms import Algorithm
from fedloom.device import memory
from fedloom.evaluation.scopes import Evaluation
from fedloom.experiment import Experiment
from fedloom.privacy.ledger import Ledger
from fedloom.report.relevance import plot_relevance
from fedloom.runtime.cohorts import ALL, Servers
from fedloom.runtime.rundir import RunDir
from fedloom.train.passes import ADAPT_PASSES, TRAIN_PASSES


def write_summary(
    exp: Experiment,
    run: RunDir,
    servers: Servers,
    evaluation: Evaluation,
    ledger: Ledger | None,
    seconds: float,
    log: logging.Logger,
) -> dict[str, Any]:
    """summary.json of a finished run (its last evaluation, the server's final entries,
    the privacy spent, the compute, the wall time ``seconds``), written and returned; a
    warning when the privacy guarantee promises little, and the relevance plot where the
    method measured one."""
    cfg, alg = exp.cfg, exp.algorithm
    summary = {
        "name": cfg.name,
        "task": exp.task.name,
        "algorithm": alg.name,
        "rounds": cfg.federation.rounds,
        "main_metric": exp.task.main_metric,
        "label_names": list(exp.task.label_names),  # class ids index it; [] for a numeric label
        "task_kind": exp.task.kind,
        **({"responses_cut": exp.responses_cut()} if exp.task.generative else {}),
        **evaluation.summary,
        **final_server_entries(alg, servers),
        **({"privacy": ledger.summary()} if ledger is not None else {}),
        "compute": {**exp.compute(), **peak_memory(exp), **passes_summary(run, alg)},
        "wall_seconds": round(seconds, 2),
    }
    run.write_json("summary.json", summary)
    if ledger is not None and (warning := ledger.warning(summary["privacy"])):
        log.warning("privacy: %s", warning)
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


def final_server_entries(alg: Algorithm, servers: Servers) -> dict[str, Any]:
    """The final clusters and the method's own summary entries: as they are for one
    state; by backbone (``{"backbones": {b: ...}}``) for one state per backbone."""
    entries: dict[str, dict[str, Any]] = {}
    for tag, state in servers.tagged():
        own = {
            **({} if (final := alg.assignment(state)) is None else {"clusters": by_client(final)}),
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


def by_client(assignment: Mapping[int, int]) -> dict[str, int]:
    return {str(c): int(j) for c, j in sorted(assignment.items())}


def peak_memory(exp: Experiment) -> dict[str, int]:
    """The peak device memory this process allocated (CUDA only; the clients of a Ray or
    Flower run report theirs elsewhere)."""
    used = memory(exp.device)
    return {} if used is None else {"peak_device_bytes": used["peak"]}

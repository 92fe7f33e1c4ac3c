"""Evaluating a round's server state: :func:`evaluate_round` scores every backbone's cohort
(:func:`evaluate_state`), joins them and adds Self / Others; the round
(:mod:`fedloom.server.loop`) writes the rows and checkpoints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fedloom.algorithms import ServerState
from fedloom.evaluation.majority import score_majority
from fedloom.evaluation.scopes import Evaluation, add_scopes, merge_evaluations
from fedloom.evaluation.score import evaluate
from fedloom.evaluation.self_others import Cohort, DevPredictions, add_self_others, others_due
from fedloom.evaluation.splits import scored_splits
from fedloom.experiment import ClientData, Experiment
from fedloom.models.heads import Feature
from fedloom.params import Params
from fedloom.runtime.clients import ClientHost, Clients
from fedloom.runtime.cohorts import Servers

if TYPE_CHECKING:  # fedloom.server imports this module
    from fedloom.server import ProgressHook


def evaluate_state(
    exp: Experiment,
    state: ServerState,
    round_: int = 0,
    host: Clients | None = None,
    progress: ProgressHook | None = None,
) -> Evaluation:
    """Scores after ``round_``; drifting clients are scored on their test split of then.

    The global adapter (and at the last round the ``zero_shot`` baseline's, the adapter as
    built: LoRA's B is zero, so the backbone alone) is scored by the server on the dev set
    and on every client's
    :func:`scored_splits` (by each client's node when the clients' data are on their
    nodes, ``runtime.client_data = "nodes"``); a personalized method's adapters are built
    and scored by each client from its own local state (:meth:`Algorithm.evaluate_local`)
    on the same splits. In a simulation (the local and Ray runtimes) ``Evaluation.adapters``
    keeps the adapters the clients used, for the run directory's personal checkpoints and
    Self / Others; on Flower only their metrics come back, and each node checkpoints its
    own (:func:`fedloom.runtime.flower_node.evaluate`). The summary records ``client_mode``.
    Self / Others is added over all backbones by :func:`evaluate_round`.
    ``progress("evaluate", n, of)`` follows the clients' evaluations (where a personalized
    method builds its adapters: FedAvg-FT fine-tunes there)."""
    cfg, alg, model = exp.cfg, exp.algorithm, exp.model
    names = exp.task.metrics
    out = Evaluation(summary={"client_mode": exp.data.client_mode})
    clients = {c.client_id: (c, scored_splits(exp, c)) for c in exp.clients_at(round_)}
    if alg.has_global:
        _score_shared(out, exp, "global", state.global_params, clients, host, round_)
    if "zero_shot" in cfg.eval.baselines and round_ == cfg.federation.rounds:
        _score_shared(out, exp, "zero_shot", model.initial_params, clients, host, round_)
    if alg.personalized:
        host = host or ClientHost(exp, list(clients))
        per_scope: dict[str, dict[int, dict[str, float | None]]] = {}
        scored_by = host.evaluate_many(
            round_,
            alg.payloads(state, list(clients)),
            None if progress is None else lambda done: progress("evaluate", done, len(clients)),
        )
        for cid, evaluated in scored_by.items():
            if evaluated is None:
                continue
            adapter, metrics = evaluated
            if adapter is not None:  # a simulation's client: its adapter came back
                out.adapters[cid] = adapter
            for scope, values in metrics.items():
                per_scope.setdefault(scope, {})[cid] = values
        add_scopes(out, "personal", per_scope, names)
    if "majority" in cfg.eval.baselines:
        majority = score_majority(
            exp.task, {cid: (c.train, sp) for cid, (c, sp) in clients.items()}
        )
        add_scopes(out, "majority", majority, names)
    return out


def _score_shared(
    out: Evaluation,
    exp: Experiment,
    adapter: str,
    params: Params,
    clients: Mapping[int, tuple[ClientData, Mapping[str, Sequence[Feature]]]],
    host: Clients | None,
    round_: int,
) -> None:
    """Rows and summary entries of one adapter every client uses alike (``"global"``, or
    the ``"zero_shot"`` baseline's untrained one) in ``out``: scored by the server on the
    dev set and every client's :func:`scored_splits` (by each client's node when the
    clients' data are on their nodes)."""
    cfg, model, bs = exp.cfg, exp.model, exp.cfg.eval.batch_size
    on_dev = DevPredictions(exp, params)
    if cfg.eval.dev and exp.dev:
        dev = on_dev.scores(exp.dev)
        # [attack] backdoor: the attack-success rate on the triggered dev examples
        dev = {**dev, **exp.attack.asr(model, params, exp.data.dev, bs)}
        out.rows.append({"scope": f"{adapter}/dev", **dev})
        out.summary.setdefault(adapter, {})["dev"] = dev
    if not cfg.eval.clients:
        return
    per_scope: dict[str, dict[int, dict[str, float | None]]] = {}
    if exp.data.on_nodes:  # the clients' data: on their nodes
        host = host or ClientHost(exp, list(clients))
        for cid, metrics in host.score_many(round_, dict.fromkeys(clients, params)).items():
            for scope, values in (metrics or {}).items():
                per_scope.setdefault(scope, {})[cid] = values
    else:
        for cid, (c, splits) in clients.items():
            for scope, features in splits.items():
                if not features:
                    continue
                relabelled = c.split is not None and c.split.label_map is not None
                per_scope.setdefault(scope, {})[cid] = (
                    on_dev.scores(features)
                    if "dev_index" in features[0] and not relabelled
                    else evaluate(model, params, features, bs)
                )
    add_scopes(out, adapter, per_scope, exp.task.metrics)


def evaluate_round(
    exp: Experiment,
    servers: Servers,
    round_: int,
    host: Clients,
    progress: ProgressHook | None = None,
) -> Evaluation:
    """Every backbone's cohort evaluated with its state, joined (:func:`merge_evaluations`);
    when ``eval.others`` says so, the adapters the clients use also scored on the other
    clients' splits (Self / Others, :mod:`fedloom.evaluation.self_others`)."""
    cohorts = {next(iter(c.models), ""): c for c in exp.cohorts()}
    evaluation = merge_evaluations(
        {
            b: evaluate_state(c, servers.state_for(b), round_, host, progress)
            for b, c in cohorts.items()
        },
        exp.task.metrics,
    )
    evaluation.summary.update(exp.attack.summary())  # [attack]: what attacked, and how
    if others_due(exp.cfg.eval.others, round_, exp.cfg.federation.rounds):
        add_self_others(
            evaluation,
            [
                Cohort(
                    c,
                    {d.client_id: (d, scored_splits(c, d)) for d in c.clients_at(round_)},
                    servers.state_for(b).global_params if exp.algorithm.has_global else None,
                )
                for b, c in cohorts.items()
            ],
        )
    return evaluation

"""Self and Others: every client's adapter scored on its own data and on the other clients'.

The adapter θ_i client i uses (its personal adapter for a personalized method, else the
global adapter) is scored on its own scored split D_i (**Self**: the ``clients`` scope) and
on every other client's (**Others**):

    Others_i = mean_{j ≠ i} score(θ_i, D_j)

per metric, a metric a split cannot define (None) left out of its mean. These are the
"Self" and "Others" columns of FedMosaic (Seo et al., 2025, "Not All Clients Are Equal:
Collaborative Model Personalization on Heterogeneous Multi-Modal Clients", arXiv
2506.11024): a personal adapter with Others close to Self kept the general knowledge of
the federation, one far below it overfit its own client.

Cost. The global adapter's Others needs no forward pass: Others_i is the mean of the
per-client global scores of the clients j ≠ i, already computed. A personal adapter is
scored on the other clients' splits: dev-weighted splits (``dev_index``) of clients keeping
the true labels reweight the adapter's dev predictions, computed once (one pass over the
dev set per adapter); any other split is scored directly.

Label spaces. A concept-shifted client (``split.label_map``) labels the same inputs
differently. score(θ_i, D_j) is undefined when the label maps of i and j differ (θ_i was
trained for another labelling: the score would measure the relabelling, not general
knowledge); such j are left out of Others_i, and Others_i is null when no other client
shares i's label space. The global adapter serves every client as it is, so each of its
per-client scores counts.

Backbones. In a mixed-backbone federation θ_i runs on client i's own model; a client j of
another backbone counts when D_j is a dev-weighted split with the true labels (the same dev
examples, encoded by i's model), and is left out otherwise.

Where. A personal adapter is scored on the other clients' data by the server, which needs
the adapter: Self / Others of a personalized method is simulation-only (the local and Ray
runtimes). On Flower the adapter stays on its node, and ``eval.others`` is refused for a
personalized method before the run starts (:func:`fedloom.experiment.build_algorithm`).

Output: the metrics.jsonl row ``<adapter>/others`` (per-metric summaries over the clients
and ``per_client``: each client's Others, the mean of every score but ``n``, with
``clients``, how many other clients it averages; null where undefined) and summary.json's
``self_others``: ``{"adapter": "personal" | "global", "self": <clients summary>,
"others": <others summary>}``. When: ``[eval] others`` (:func:`others_due`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedloom.data import summarize
from fedloom.evaluation.scopes import Evaluation
from fedloom.evaluation.score import evaluate, scores
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature
from fedloom.params import Params
from fedloom.train.mixture import is_mixture, mixture_predict_each

if TYPE_CHECKING:
    from fedloom.experiment import ClientData, Experiment

Scores = dict[str, float | None]
#: client id -> (its data, its scored splits by scope), as
#: :func:`fedloom.evaluation.round.evaluate_state` has them
Clients = Mapping[int, tuple["ClientData", Mapping[str, Sequence[Feature]]]]


def others_due(when: str, round_: int, rounds: int) -> bool:
    """Whether an evaluation after ``round_`` scores Others under ``[eval] others = when``:
    ``"every"`` evaluation, only the ``"final"`` one (after the last round) or ``"never"``."""
    return when == "every" or (when == "final" and round_ == rounds)


def predict_each(
    model: FedModel, params: Params, features: Sequence[Feature], batch_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(predictions, labels, per-example losses) of ``params`` (one adapter or a FedEM
    mixture of adapters) over ``features``."""
    if is_mixture(params):
        return mixture_predict_each(model, params, features, batch_size)
    model.set_params(params)
    return model.predict_each(features, batch_size)


class DevPredictions:
    """One adapter's predictions and per-example losses on the dev set, computed once and
    shared by the dev score and every dev-weighted client score that keeps the dev labels
    (a relabelled client's losses differ, so it is scored on its own)."""

    def __init__(self, exp: Experiment, params: Params) -> None:
        self.exp, self.params = exp, params
        self.cached: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def scores(self, features: Sequence[Feature]) -> Scores:
        """Scores of the dev examples ``features`` (the dev set, or a client's weighting
        of it: entries with ``dev_index``)."""
        model = self.exp.model
        if model.task.generative:  # the dev set itself (no dev-weighted client splits)
            return evaluate(model, self.params, features, self.exp.cfg.eval.batch_size)
        if self.cached is None:
            self.cached = predict_each(
                model, self.params, self.exp.dev or [], self.exp.cfg.eval.batch_size
            )
        index = [f.get("dev_index", i) for i, f in enumerate(features)]
        preds, labels, losses = (array[index] for array in self.cached)
        return scores(model, preds, labels, losses, features)


def teacher_forced(
    model: FedModel, params: Params, features: Sequence[Feature], batch_size: int
) -> Scores:
    """A generative task's Others score of ``params`` on ``features``: the references' NLL
    (``nll``, ``perplexity`` where the task scores them, and ``loss``) under teacher
    forcing, no generation: generating every adapter's answers on every other client's
    split would cost K times the evaluation."""
    model.set_params(params)
    nll = model.mean_loss(features, batch_size)
    kept = {"nll": nll, "perplexity": float(np.exp(nll))}
    return {
        **{m: kept[m] for m in model.task.metrics if m in kept},
        "loss": nll,
        "n": len(features),
    }


def mean_over_others(per_split: Mapping[int, Scores | None], own: int) -> dict[str, Any] | None:
    """Others_own: the mean over the clients j ≠ ``own`` of their defined ``per_split[j]``
    (a None entry, an undefined pair, is left out), per score but ``n``, a None score left
    out of its mean (None when no j defines it); ``clients``: how many j are averaged.
    None when no other client has a score."""
    others = [s for j, s in per_split.items() if j != own and s is not None]
    if not others:
        return None
    keys = dict.fromkeys(k for s in others for k in s if k != "n")
    return {**{k: _mean([s.get(k) for s in others]) for k in keys}, "clients": len(others)}


def _mean(values: Sequence[float | None]) -> float | None:
    defined = [v for v in values if v is not None]
    return float(np.mean(defined)) if defined else None


def _label_map(client: ClientData) -> np.ndarray | None:
    return client.split.label_map if client.split is not None else None


def _same_labels(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b))


def scores_on_others(
    exp: Experiment, params: Params, clients: Clients, own: int, foreign: Clients
) -> dict[int, Scores | None]:
    """score(θ_own, D_j) for every client j ≠ ``own`` with a ``clients`` split, ``own``
    and ``clients`` on ``exp``'s backbone, ``foreign`` on others: None where the label maps
    of ``own`` and j differ or where a foreign split is not dev-weighted; dev-weighted
    splits of clients keeping the true labels from ``params``' dev predictions (computed
    once), other splits directly."""
    on_dev = DevPredictions(exp, params)
    own_map = _label_map(clients[own][0])
    out: dict[int, Scores | None] = {}
    for j, (client, splits) in {**clients, **foreign}.items():
        features = splits.get("clients")
        if j == own or not features:
            continue
        label_map = _label_map(client)
        if not _same_labels(own_map, label_map):
            out[j] = None
        elif label_map is None and "dev_index" in features[0]:
            out[j] = on_dev.scores(features)
        elif j in foreign:  # encoded for another backbone's model
            out[j] = None
        elif exp.model.task.generative:
            out[j] = teacher_forced(exp.model, params, features, exp.cfg.eval.batch_size)
        else:
            out[j] = scores(
                exp.model,
                *predict_each(exp.model, params, features, exp.cfg.eval.batch_size),
                features,
            )
    return out


@dataclass(frozen=True)
class Cohort:
    """One backbone's experiment, its clients with their scored splits, and its global
    adapter (None for a method without one)."""

    exp: Experiment
    clients: Clients
    global_params: Params | None


def add_self_others(out: Evaluation, cohorts: Sequence[Cohort]) -> None:
    """Append the ``<adapter>/others`` row and summary.json's ``self_others`` to ``out``
    for the adapter the clients use (``personal`` for a personalized method, else
    ``global``); nothing when that adapter has no ``clients`` scope (no client scored).

    In a mixed-backbone federation (several ``cohorts``) client i's adapter runs on its own
    backbone's model, and another backbone's client j counts in Others_i when D_j is a
    dev-weighted split with the true labels: the dev set is one list of examples, each
    backbone's encoding of it in the same order, so ``dev_index`` names the same example on
    every backbone. Other foreign splits are encoded for a model θ_i cannot run on and are
    left out."""
    exp = cohorts[0].exp
    adapter = "personal" if exp.algorithm.personalized else "global"
    own = next((r for r in out.rows if r["scope"] == f"{adapter}/clients"), None)
    if own is None:
        return
    others: dict[int, dict[str, Any] | None] = {}
    for cohort in cohorts:
        foreign = {
            j: c for other in cohorts if other is not cohort for j, c in other.clients.items()
        }
        if adapter == "personal":
            for i in cohort.clients:
                if i in out.adapters:
                    per_split = scores_on_others(
                        cohort.exp, out.adapters[i], cohort.clients, i, foreign
                    )
                    others[i] = mean_over_others(per_split, i)
            continue
        on_global = {int(j): s for j, s in own["per_client"].items() if int(j) in cohort.clients}
        if foreign and cohort.global_params is not None:
            on_dev = DevPredictions(cohort.exp, cohort.global_params)
            on_global |= {
                j: on_dev.scores(splits["clients"])
                for j, (client, splits) in foreign.items()
                if splits.get("clients")
                and _label_map(client) is None
                and "dev_index" in splits["clients"][0]
            }
        others |= {i: mean_over_others(on_global, i) for i in on_global if i in cohort.clients}
    # a generative task's Others hold the teacher-forced scores alone (:func:`teacher_forced`)
    scored = [m for m in exp.task.metrics if any(o and m in o for o in others.values())]
    metrics = {m: summarize([o.get(m) if o else None for o in others.values()]) for m in scored}
    out.rows.append(
        {
            "scope": f"{adapter}/others",
            "metrics": metrics,
            "per_client": {str(i): others[i] for i in sorted(others)},
        }
    )
    out.summary["self_others"] = {
        "adapter": adapter,
        "self": out.summary[adapter]["clients"],
        "others": metrics,
    }

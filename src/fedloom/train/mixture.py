"""Predicting with a mixture of adapters: p(y | x) = Σ_m π_m p_m(y | x), the model a FedEM
client uses (Marfoq et al. 2021, Eq. 4), and its checkpoint form.

A mixture travels and is saved as one ``Params``: the M component adapters packed as
``cluster<m>/<name>`` (:func:`fedloom.params.pack`) plus the weights π
under ``mixture/pi``, so ``fedloom eval --personal`` scores a FedEM client's checkpoint
exactly as the client scored it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from scipy.special import logsumexp

from fedloom.evaluation.score import scores
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature
from fedloom.params import Params, pack, unpack

WEIGHTS = "mixture/pi"


def pack_mixture(components: Sequence[Params], weights: Sequence[float]) -> Params:
    return {**pack(components), WEIGHTS: torch.tensor(list(weights), dtype=torch.float64)}


def unpack_mixture(params: Params) -> tuple[list[Params], np.ndarray]:
    packed = {n: t for n, t in params.items() if n != WEIGHTS}
    return unpack(packed), params[WEIGHTS].double().cpu().numpy()


def is_mixture(params: Params) -> bool:
    return WEIGHTS in params


def component_log_probs(
    model: FedModel, components: Sequence[Params], features: Sequence[Feature], batch_size: int
) -> np.ndarray:
    """(M, n, classes) log p_m(y | x) of every component."""
    out = []
    for params in components:
        model.set_params(params)
        out.append(model.log_probs(features, batch_size))
    return np.stack(out)


def mixture_log_probs(log_probs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(n, classes) log Σ_m π_m p_m(y | x) from the components' (M, n, classes)."""
    with np.errstate(divide="ignore"):  # a zero weight is a -inf log weight
        log_w = np.log(weights)
    return logsumexp(log_probs + log_w[:, None, None], axis=0)


def mixture_predict_each(
    model: FedModel, params: Params, features: Sequence[Feature], batch_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(predictions, labels, per-example −log p(y | x)) of the mixture, as
    :meth:`FedModel.predict_each` gives them for one adapter."""
    components, weights = unpack_mixture(params)
    mixed = mixture_log_probs(component_log_probs(model, components, features, batch_size), weights)
    labels = np.array([f["label"] for f in features])
    return mixed.argmax(-1), labels, -mixed[np.arange(len(labels)), labels]


def evaluate_mixture(
    model: FedModel, params: Params, features: Sequence[Feature], batch_size: int
) -> dict[str, float | None]:
    """The task's metrics plus ``loss`` (mean −log p(y | x) of the mixture) and ``n``,
    weighted where the examples carry weights (:func:`fedloom.evaluation.score.scores`)."""
    return scores(model, *mixture_predict_each(model, params, features, batch_size), features)

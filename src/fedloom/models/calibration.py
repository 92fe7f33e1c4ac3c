"""Temperature scaling: one scalar T > 0 that makes a classifier's probabilities honest on
held-out data (Guo, Pleiss, Sun & Weinberger, ICML 2017, "On Calibration of Modern Neural
Networks"): p_T(y | x) = softmax(z(x) / T)_y with T minimizing the negative
log-likelihood of held-out labels. It leaves every prediction as it was (argmax z/T =
argmax z) and changes only how sure the model is.

Why fedloom needs it: correcting a classifier for a new label prior (Saerens et al. 2002;
logit adjustment, :mod:`fedloom.models.label_prior`) assumes p(y | x) is calibrated. A
fine-tuned transformer is over-confident on data it did not train on (margins of several
nats where its accuracy warrants one or two), so an uncorrected prior shift of log p_k −
log p barely moves its predictions. Alexandari, Kundaje & Shrikumar (ICML 2020,
"Maximum Likelihood with Bias-Corrected Calibration is Hard-To-Beat at Label Shift
Adaptation") show calibration is what makes the correction work.

The fit is one-dimensional and convex in β = 1/T (the NLL of softmax(β z) is a
log-sum-exp of linear functions of β minus a linear one), solved with SciPy's bounded
scalar minimizer on T ∈ [:data:`T_MIN`, :data:`T_MAX`]. Hand-written around SciPy:
PyTorch, transformers and scikit-learn ship no temperature scaling (scikit-learn's
``CalibratedClassifierCV`` fits Platt or isotonic maps, which change predictions and need
a scikit-learn estimator).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import minimize_scalar

from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import ClassifierHead, Feature

#: the temperatures the fit searches between (T = 1: the model as it is)
T_MIN, T_MAX = 0.05, 100.0
#: the temperatures a federated fit compares (:func:`nll_by_temperature`): 81 values
#: log-spaced over [T_MIN, T_MAX], each about 10 % above the last
T_GRID = np.geomspace(T_MIN, T_MAX, 81)


def fit_temperature(
    logits: torch.Tensor, labels: torch.Tensor, offset: torch.Tensor | None = None
) -> float:
    """The T minimizing the mean NLL of softmax(``logits`` / T + ``offset``) at ``labels``
    ((n, C), (n,) and (C,); no offset: 0); logits may be any per-example shift of them
    (log-probabilities, say). With an offset (a label prior's log p_k − log p) the fit is
    still convex in 1/T."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1] or not len(labels):
        raise ValueError(
            f"fit_temperature: (n, classes) logits and n labels, n > 0 (got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)})"
        )
    if offset is not None and offset.shape != logits.shape[1:]:
        raise ValueError(
            f"fit_temperature: a (classes,) offset (got {tuple(offset.shape)} for "
            f"{logits.shape[1]} classes)"
        )
    z, y = logits.detach().double().cpu(), labels.detach().long().cpu()
    shift = (
        torch.zeros(z.shape[1], dtype=torch.float64) if offset is None else offset.double().cpu()
    )

    def nll(beta: float) -> float:
        return float(F.cross_entropy(z * beta + shift, y))

    found = minimize_scalar(
        nll, bounds=(1 / T_MAX, 1 / T_MIN), method="bounded", options={"xatol": 1e-6}
    )
    return float(1 / found.x)


def nll_by_temperature(
    logits: torch.Tensor, labels: torch.Tensor, grid: np.ndarray = T_GRID
) -> np.ndarray:
    """(len(grid),) the summed NLL of softmax(``logits`` / T) at ``labels`` for each T of
    ``grid``: what each party holding part of a validation set contributes to a fit over
    all of it (the sums add up; :func:`grid_temperature` picks the minimizer)."""
    z, y = logits.detach().double().cpu(), labels.detach().long().cpu()
    return np.array([float(F.cross_entropy(z / t, y, reduction="sum")) for t in grid])


def grid_temperature(nll: np.ndarray, grid: np.ndarray = T_GRID) -> float:
    """The T of ``grid`` with the least summed NLL (``nll``: :func:`nll_by_temperature`
    summed over the parties)."""
    if nll.shape != grid.shape:
        raise ValueError(f"grid_temperature: {nll.shape[0]} NLL sums for {len(grid)} temperatures")
    return float(grid[int(np.argmin(nll))])


def held_out_log_probs(
    model: FedModel, features: Sequence[Feature], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """((n, classes) log p(y | x), (n,) labels) of ``model``'s classifier on ``features``,
    in evaluation mode at the model's precision (its mode restored)."""
    head = model.head
    if not isinstance(head, ClassifierHead) or model.task.is_regression:
        raise ValueError("model.head: temperature scaling needs a classifier over classes")
    (log_probs,) = model.each_example(
        features, batch_size, lambda batch: (head.class_log_probs(batch),)
    )
    return log_probs, torch.as_tensor([int(f["label"]) for f in features], dtype=torch.long)

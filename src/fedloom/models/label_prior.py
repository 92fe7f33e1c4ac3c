"""A client's label prior in its classifier's logits: the seam of the label-skew methods.

Under label skew client k's class prior p_k(y) = n_{k,y} / n_k differs from the
federation's. The methods built for it change the logits z(x) by a per-class offset:

    balanced softmax (FedRoD's generic head)   train on  z_y(x) + log n_{k,y}
    FedLC's calibration                        train on  z_y(x) − τ n_{k,y}^{−1/4}
    logit adjustment (the oracle's scoring)    score  on z_y(x) + log p_k(y) − log p(y)

:func:`offset_logits` adds such an offset to every logit of a classifier head for a block
(training and scoring go through the same logits, so one seam serves both);
:func:`label_counts` reads n_{k,y} from the client's own training features, on the
client: the counts never leave it. :func:`shift_classifier` folds a per-class change of the
logits into the classifier's own tensors of an adapter, so that a client's personal
correction is scored (and saved) as an ordinary adapter.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import ClassifierHead, Feature
from fedloom.params import Params

#: the metric under which a party reports its count of class y with its update
COUNT_METRIC = "label_count_{}"


def count_metrics(counts: np.ndarray) -> dict[str, float]:
    """(classes,) label ``counts`` as the metrics a party reports them under."""
    return {COUNT_METRIC.format(y): float(n) for y, n in enumerate(counts)}


def reported_counts(metrics: Mapping[str, float], who: str) -> torch.Tensor:
    """The (classes,) label counts a party reported in ``metrics`` (:func:`count_metrics`);
    a ValueError naming ``who`` where it reported none, or not every class from 0."""
    pattern = re.compile(COUNT_METRIC.format(r"(\d+)") + "$")
    found = {int(m.group(1)): v for k, v in metrics.items() if (m := pattern.match(k))}
    if not found or sorted(found) != list(range(len(found))):
        raise ValueError(f"{who}: no label counts reported ({found})")
    return torch.tensor([found[y] for y in range(len(found))], dtype=torch.float32)


def label_counts(features: Sequence[Feature], num_labels: int) -> np.ndarray:
    """(num_labels,) how many of ``features`` carry each class label."""
    labels = np.array([int(f["label"]) for f in features], dtype=np.int64)
    return np.bincount(labels, minlength=num_labels).astype(np.float64)


def log_prior(counts: np.ndarray, smoothing: float = 1.0) -> np.ndarray:
    """log p(y) of ``counts`` with add-``smoothing`` (Laplace) smoothing, so a class the
    client never saw gets a finite, low log-prior instead of −∞."""
    smoothed = counts + smoothing
    return np.log(smoothed / smoothed.sum())


def classifier(model: FedModel) -> ClassifierHead:
    """``model``'s classifier head; a ValueError naming ``model.head`` for any other (a
    causal LM's verbalizer scores answer words, not one logit per class)."""
    head = model.head
    if not isinstance(head, ClassifierHead) or model.task.is_regression:
        raise ValueError(
            f"model.head: adjusting logits by a label prior needs a classifier over classes; "
            f"{model.spec.name} on task {model.task.name} has "
            + (
                "a regression output"
                if model.task.is_regression
                else f"a causal LM's {type(head).__name__.removesuffix('Head').lower()} head"
            )
        )
    return head


@contextmanager
def offset_logits(model: FedModel, offset: np.ndarray | torch.Tensor) -> Iterator[None]:
    """Add the (classes,) ``offset`` to every logit of ``model``'s classifier inside the
    block (training steps and scoring alike), then remove it."""
    head = classifier(model)
    values = torch.as_tensor(np.asarray(offset), dtype=torch.float32, device=head.device)
    if values.shape != (model.task.num_labels,):
        raise ValueError(
            f"logit offset of shape {tuple(values.shape)} for {model.task.num_labels} classes"
        )
    previous = head.logit_offset
    head.logit_offset = values
    try:
        yield
    finally:
        head.logit_offset = previous


def classifier_names(model: FedModel) -> tuple[str, str]:
    """The adapter names of ``model``'s classifier weight and bias (a ValueError naming
    ``model.head`` for a head without one, or where either is not a tensor of the
    adapter); a regression output's one unit included."""
    linear = model.head.classifier if isinstance(model.head, ClassifierHead) else None
    if linear is None:
        raise ValueError(f"model.head: {model.spec.name} has no classifier layer")
    names = {id(p): n for n, p in model.trainable_parameters().items()}
    if id(linear.weight) not in names or id(linear.bias) not in names:
        raise ValueError("model.head: the classifier's weight and bias are not in the adapter")
    return names[id(linear.weight)], names[id(linear.bias)]


def shift_classifier(
    model: FedModel,
    adapter: Params,
    *,
    weight: torch.Tensor | None = None,
    bias: np.ndarray | torch.Tensor | None = None,
) -> Params:
    """``adapter`` whose classifier on ``model`` computes (W + ``weight``) z + (b + ``bias``):
    the deltas added in float64, each result in its tensor's dtype and device."""
    names = dict(zip(("weight", "bias"), classifier_names(model), strict=True))
    shifted = dict(adapter)
    for role, delta in (("weight", weight), ("bias", bias)):
        if delta is None:
            continue
        current = adapter[names[role]]
        step = torch.as_tensor(np.asarray(delta) if not torch.is_tensor(delta) else delta)
        total = current.double() + step.to(current.device, torch.float64)
        shifted[names[role]] = total.to(current.dtype)
    return shifted


def adjust_classifier(
    model: FedModel, adapter: Params, offset: np.ndarray | torch.Tensor, temperature: float
) -> Params:
    """``adapter`` whose classifier on ``model`` computes z / ``temperature`` + ``offset``
    (a client's prior correction log p_k − log p on calibrated logits): the weight and
    bias divided by T, the offset added to the bias, folded into the adapter."""
    weight, bias = classifier_names(model)
    cooled = 1 / temperature - 1  # (W / T) h + (b / T + offset) as deltas of W and b
    step = torch.as_tensor(np.asarray(offset) if not torch.is_tensor(offset) else offset)
    return shift_classifier(
        model,
        adapter,
        weight=adapter[weight].double() * cooled,
        bias=adapter[bias].double().cpu() * cooled + step.double().cpu(),
    )


def to_own_prior(
    model: FedModel,
    adapter: Params,
    train: Sequence[Feature],
    reference_counts: torch.Tensor,
    temperature: float,
) -> Params:
    """``adapter`` moved from the label mix of ``reference_counts`` (what it trained on) to
    the client's own mix in ``train``: logits z / ``temperature`` + log p_k − log p, both
    priors add-one smoothed (:func:`adjust_classifier`)."""
    own = log_prior(label_counts(train, model.task.num_labels))
    reference = log_prior(reference_counts.double().cpu().numpy())
    offset = torch.as_tensor(own - reference, dtype=torch.float64)
    return adjust_classifier(model, adapter, offset, temperature)

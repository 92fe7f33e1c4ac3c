"""A client's label prior in its classifier's logits: the seam of the label-skew methods.

Under label skew client k's class prior p_k(y) = n_{k,y} / n_k differs from the
federation's. The methods built for it change the logits z(x) by a per-class offset:

    balanced softmax (FedRoD's generic head)   train on  z_y(x) + log n_{k,y}
    FedLC's calibration                        train on  z_y(x) − τ n_{k,y}^{−1/4}
    logit adjustment (the oracle's scoring)    score  on z_y(x) + log p_k(y) − log p(y)

:func:`offset_logits` adds such an offset to every logit of a classifier head for a block
(training and scoring go through the same logits, so one seam serves both);
:func:`label_counts` reads n_{k,y} from the client's own training features, on the
client: the counts never leave it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import ClassifierHead, Feature


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
            + ("a regression output" if model.task.is_regression else "a verbalizer head")
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

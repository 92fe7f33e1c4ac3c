"""Counting a client's local compute: its training passes.

One pass is one minibatch through the model's forward and backward: a micro-batch under
gradient accumulation (``train.grad_accum`` passes a step), one gradient evaluation of a
hand-written update rule (:func:`fedloom.train.functional.loss_and_grad`), one anchor
gradient of FedMosaic's task vector; a batched pass of several clients
(:mod:`fedloom.train.together`) is one pass for each of them. Forward passes alone
(scoring, IFCA's and FedEM's losses per cluster or component) are not passes.

Every loop that takes a training backward calls :func:`count` where it takes it, so a
method that trains twice (Ditto), takes several gradients a step (pFedMe, Per-FedAvg,
APFL) or trains in phases (FedRep) is counted as it runs, with no arithmetic of its own.
The client host opens :func:`counting` around a client's local training (its
``train_passes`` metric) and around building the adapter it is scored with (FedAvg-FT's
fine-tuning, Per-FedAvg's adaptation step: ``adapt_passes``); outside such a block
:func:`count` does nothing, so the server's gradient diagnostics and any direct call are
not counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

#: the metric a client's round reports its passes under (beside ``local_steps``)
TRAIN_PASSES = "train_passes"
#: the per-client score entry of the passes a client spent building its scored adapter
ADAPT_PASSES = "adapt_passes"


@dataclass
class PassCount:
    passes: int = 0


_current: ContextVar[PassCount | None] = ContextVar("fedloom_train_passes", default=None)


def count(passes: int = 1) -> None:
    """Add ``passes`` forward/backward passes to the innermost open :func:`counting`."""
    counter = _current.get()
    if counter is not None:
        counter.passes += passes


@contextmanager
def counting() -> Iterator[PassCount]:
    """Count the passes taken in the block; an enclosing count includes them."""
    counter = PassCount()
    token = _current.set(counter)
    try:
        yield counter
    finally:
        _current.reset(token)
        count(counter.passes)

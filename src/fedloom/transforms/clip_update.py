"""Update clipping: the client's update Δ = θ_k − θ (over the tensors it was sent) scaled
to an L2 norm of at most ``max_norm``:  Δ ← Δ · min(1, C / ‖Δ‖₂).

The per-client clipping of DP-FedAvg (McMahan et al. 2018, "Learning Differentially
Private Recurrent Language Models", Algorithm 1, ``FlatClip``), applied to the whole shared
update; bounding each client's influence on the average is also a cheap defence against a
client whose update explodes. fedloom clips on the client (``up``); tensors the payload
did not contain (a method's extras) pass unclipped, as they have no reference point.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedloom.params import Params
from fedloom.transforms.base import Stage, Transform


def shared_names(update: Params, payload: Params) -> list[str]:
    """The floating-point tensors of ``update`` that ``payload`` also holds: the shared
    part of an update, which has a reference point."""
    return [n for n in update if n in payload and update[n].is_floating_point()]


def delta_norm(update: Params, payload: Params) -> float:
    """‖Δ‖₂ over the shared tensors, in float64."""
    names = shared_names(update, payload)
    if not names:
        return 0.0
    squares = functools.reduce(
        operator.add, [((update[n].double() - payload[n].double()) ** 2).sum() for n in names]
    )
    return float(torch.sqrt(squares))


def clip_delta(update: Params, payload: Params, max_norm: float) -> tuple[Params, float]:
    """(``update`` with Δ scaled by min(1, C / ‖Δ‖₂), ‖Δ‖₂ before clipping)."""
    norm = delta_norm(update, payload)
    if norm <= max_norm:
        return update, norm
    scale = max_norm / norm
    clipped = {
        n: (payload[n].double() + (update[n].double() - payload[n].double()) * scale).to(
            update[n].dtype
        )
        for n in shared_names(update, payload)
    }
    return {**update, **clipped}, norm


@dataclass(frozen=True)
class ClipUpdate(Transform):
    name: ClassVar[str] = "clip_update"
    stage: ClassVar[Stage] = "clip"
    bounds_norm: ClassVar[bool] = True
    #: C, the largest L2 norm an update may have
    max_norm: float = 1.0

    def __post_init__(self) -> None:
        if not self.max_norm > 0:
            raise ValueError(f"max_norm: must be > 0 (got {self.max_norm})")

    def up(
        self,
        update: Params,
        payload: Params,
        client_id: int,
        round_: int,
        state: dict[str, Any],
    ) -> Params:
        return clip_delta(update, payload, self.max_norm)[0]

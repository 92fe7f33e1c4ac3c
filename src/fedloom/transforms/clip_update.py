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
from typing import ClassVar

import torch

from fedloom.params import Params
from fedloom.transforms.base import Transform


@dataclass(frozen=True)
class ClipUpdate(Transform):
    name: ClassVar[str] = "clip_update"
    #: C, the largest L2 norm an update may have
    max_norm: float = 1.0

    def __post_init__(self) -> None:
        if not self.max_norm > 0:
            raise ValueError(f"max_norm: must be > 0 (got {self.max_norm})")

    def up(self, update: Params, payload: Params, client_id: int, round_: int) -> Params:
        shared = [n for n in update if n in payload and update[n].is_floating_point()]
        if not shared:
            return update
        deltas = {n: update[n].double() - payload[n].double() for n in shared}
        squares = functools.reduce(operator.add, [(d * d).sum() for d in deltas.values()])
        norm = float(torch.sqrt(squares))
        if norm <= self.max_norm:
            return update
        scale = self.max_norm / norm
        return {
            **update,
            **{n: (payload[n].double() + deltas[n] * scale).to(update[n].dtype) for n in shared},
        }

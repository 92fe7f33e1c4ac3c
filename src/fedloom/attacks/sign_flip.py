"""Sign flipping: each attacker sends its own update reversed and scaled.

Rule::

    Δ' = −s · Δ

(s = ``scale``, default 1: the plain reversed gradient). The "reversed gradient" /
sign-flipping Byzantine worker of Damaskinos et al. 2018 ("Asynchronous Byzantine Machine
Learning") and Allen-Zhu et al. 2021 ("Byzantine-Resilient Non-Convex Stochastic Gradient
Descent"), which use s = 1 (some works use larger s, e.g. 4, to push the mean further).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedloom.attacks.base import ModelPoisoning, RoundView
from fedloom.params import Params


@dataclass(frozen=True)
class SignFlip(ModelPoisoning):
    name: ClassVar[str] = "sign_flip"
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"scale: must be > 0 (got {self.scale})")

    def forge(self, view: RoundView) -> dict[int, Params]:
        return {
            cid: {n: -self.scale * t.double() for n, t in own.items()}
            for cid, own in view.honest.items()
        }

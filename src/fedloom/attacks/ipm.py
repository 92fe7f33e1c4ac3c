"""Inner product manipulation (IPM): every attacker sends the benign mean, reversed and
shrunk.

Rule::

    Δ' = −ε · μ,   μ = the mean of the round's benign updates

Xie, Koyejo and Gupta, "Fall of Empires: Breaking Byzantine-tolerant SGD by Inner Product
Manipulation" (UAI 2019). A small ε keeps the malicious updates close to the benign ones,
so distance- and rank-based rules (Krum, the coordinate-wise median, the trimmed mean)
select them, while the aggregate's inner product with the true mean turns negative once
enough of them get through; a large ε (the paper's 100) breaks the plain mean instead,
which any attack does. Default ``epsilon`` = 0.1, the paper's setting against median and
Krum, the one later robustness studies (Karimireddy et al. 2021; Allouah et al. 2023)
run, since the table is about robust rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedloom.attacks.base import ModelPoisoning, RoundView, stacked
from fedloom.params import Params


@dataclass(frozen=True)
class IPM(ModelPoisoning):
    name: ClassVar[str] = "ipm"
    epsilon: float = 0.1

    def __post_init__(self) -> None:
        if not self.epsilon > 0:
            raise ValueError(f"epsilon: must be > 0 (got {self.epsilon})")

    def forge(self, view: RoundView) -> dict[int, Params]:
        reference = view.reference()
        out: dict[int, Params] = {}
        for cid, own in view.honest.items():
            out[cid] = {}
            for n, t in own.items():
                rows = stacked(reference, n, t)
                mu = rows.mean(0) if rows is not None else t.double()
                out[cid][n] = -self.epsilon * mu
        return out

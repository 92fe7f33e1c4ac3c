"""A Little Is Enough (ALIE): every attacker sends the benign mean shifted by z standard
deviations, coordinate-wise.

Rule::

    Δ'_j = μ_j − z · σ_j      (μ_j, σ_j: mean and standard deviation of coordinate j over
                               the round's benign updates; every attacker sends the same Δ')

Baruch, Baruch and Goldberg, "A Little Is Enough: Circumventing Defenses For Distributed
Learning" (NeurIPS 2019). Default ``z`` (None): the paper's z_max for the round's n
reporting clients of which f attack::

    s = ⌊n/2 + 1⌋ − f,   z_max = Φ⁻¹((n − s) / n)

(s: the benign clients the attackers need "on their side" for a majority; Φ the standard
normal CDF), the largest shift for which the malicious coordinate is still closer to the
mean than enough benign ones are. fedloom keeps s ≥ 1 (with f ≥ n/2 the attackers are a
majority already). σ is the sample standard deviation (n − 1 in the denominator), 0 with
a single benign update. E.g. n = 50: f = 12 gives s = 14, z ≈ 0.58; f = 24 gives s = 2,
z ≈ 1.75; n = 20, f = 4: s = 7, z ≈ 0.39.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import ClassVar

from fedloom.attacks.base import ModelPoisoning, RoundView, stacked
from fedloom.params import Params


def z_max(n: int, f: int) -> float:
    """The paper's z_max for n clients of which f attack: Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − f
    (at least 1)."""
    s = max(1, math.floor(n / 2 + 1) - f)
    return NormalDist().inv_cdf((n - s) / n)


@dataclass(frozen=True)
class ALIE(ModelPoisoning):
    name: ClassVar[str] = "alie"
    z: float | None = None

    def __post_init__(self) -> None:
        if self.z is not None and not self.z >= 0:
            raise ValueError(f"z: must be >= 0 (got {self.z})")

    def forge(self, view: RoundView) -> dict[int, Params]:
        z = self.z if self.z is not None else z_max(view.n, view.f)
        reference = view.reference()
        out: dict[int, Params] = {}
        for cid, own in view.honest.items():
            out[cid] = {}
            for n, t in own.items():
                rows = stacked(reference, n, t)
                if rows is None:
                    out[cid][n] = t.double()
                    continue
                sigma = rows.std(0) if len(rows) > 1 else rows[0].new_zeros(rows[0].shape)
                out[cid][n] = rows.mean(0) - z * sigma
        return out

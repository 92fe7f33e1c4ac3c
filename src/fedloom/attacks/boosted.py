"""Boosting (explicit boosting, model replacement): each attacker scales its own update.

Rule::

    Δ' = b · Δ

Bhagoji, Chakraborty, Mittal and Calo, "Analyzing Federated Learning through an
Adversarial Lens" (ICML 2019), boost the malicious update by λ = 1/α_m, the inverse of the
attacker's weight in the server's average, so that it survives averaging; Bagdasaryan et
al., "How To Backdoor Federated Learning" (AISTATS 2020), scale by γ = n/η to replace the
global model. Default ``boost`` (None): the inverse of the round's attackers' total share
of the weighted mean, b = Σ_all n_k / Σ_attackers n_k (n/f with equal weights), so that
under the plain mean the aggregate moves by the attackers' own mean update, as if no
benign client had reported: a per-round exact model replacement, rather than a fixed 10
that overshoots with many attackers and undershoots with many clients. Alone it amplifies
the attackers' (non-IID) updates; with a poisoned objective it is the model-replacement
backdoor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedloom.attacks.base import ModelPoisoning, RoundView
from fedloom.params import Params


@dataclass(frozen=True)
class Boosted(ModelPoisoning):
    name: ClassVar[str] = "boosted"
    boost: float | None = None

    def __post_init__(self) -> None:
        if self.boost is not None and not self.boost > 0:
            raise ValueError(f"boost: must be > 0 (got {self.boost})")

    def factor(self, view: RoundView) -> float:
        """b: ``boost``, else Σ_all n_k / Σ_attackers n_k."""
        if self.boost is not None:
            return self.boost
        attackers = sum(view.weights[c] for c in view.honest)
        return sum(view.weights.values()) / attackers if attackers > 0 else 1.0

    def forge(self, view: RoundView) -> dict[int, Params]:
        b = self.factor(view)
        return {
            cid: {n: b * t.double() for n, t in own.items()} for cid, own in view.honest.items()
        }

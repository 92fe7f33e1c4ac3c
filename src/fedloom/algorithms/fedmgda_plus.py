"""FedMGDA+ (Hu, Guo, Li, Pan & Chen, IEEE TNSE 2022, "Federated Learning Meets
Multi-Objective Optimization"): a common descent direction for every sampled client.

Each sampled client trains from θ and returns θ_i; with the normalised updates
ĝ_i = (θ_i − θ) / ‖θ_i − θ‖ the server takes the minimum-norm point of their convex hull,
with the mixing weights held within ε of FedAvg's weights λ⁰ (λ⁰_i ∝ n_i, or 1/m with
``weighting = "uniform"``, the paper's choice in its experiments),

    λ* = argmin_λ ‖Σ_i λ_i ĝ_i‖²   s.t.  Σ_i λ_i = 1,  max(0, λ⁰_i − ε) ≤ λ_i ≤ λ⁰_i + ε
    θ ← θ + η Σ_i λ*_i ĝ_i

(Algorithm 1 and Eq. 9 of the paper). With ε ≥ 1 it is MGDA's direction, which does not
increase any client's loss to first order (a Pareto-stationary θ gets d = 0); ε = 0 is
FedAvg's weighted mean of the normalised updates. The quadratic program (m variables) is solved by
SciPy's SLSQP; every m × m Gram matrix entry is an inner product of two updates.

The normalisation drops the update lengths, so the server step η (``server_lr``) sets the
length of the step. Default None: η is the mean length of this round's client updates, so
a round moves θ about as far as FedAvg would (the paper tunes a decaying η instead; an
absolute η depends on the learning rate, the local steps and the adapter's size).
ε = 0.1 (``epsilon``), from the paper's grid {0, 0.05, 0.1, 0.5, 1}.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedloom.algorithms.base import Algorithm, ClientResult, ServerState
from fedloom.algorithms.fedavg import aggregation_weights, check_weighting
from fedloom.algorithms.registry import register
from fedloom.params import flatten, unflatten


def min_norm_weights(
    gram: np.ndarray, epsilon: float, center: np.ndarray | None = None
) -> np.ndarray:
    """λ* of the program above for the Gram matrix ``gram`` = [⟨ĝ_i, ĝ_j⟩] of m directions
    and the weights λ⁰ = ``center`` (default uniform)."""
    from scipy.optimize import minimize

    m = len(gram)
    uniform = np.full(m, 1.0 / m) if center is None else np.asarray(center, dtype=np.float64)
    if m == 1 or epsilon == 0:
        return uniform
    bounds = [(max(0.0, u - epsilon), min(1.0, u + epsilon)) for u in uniform]
    solved = minimize(
        lambda lam: float(lam @ gram @ lam),
        uniform,
        jac=lambda lam: 2.0 * gram @ lam,
        method="SLSQP",
        bounds=bounds,
        constraints=[
            {"type": "eq", "fun": lambda lam: lam.sum() - 1.0, "jac": lambda lam: np.ones_like(lam)}
        ],
        options={"ftol": 1e-12, "maxiter": 500},
    )
    if not solved.success:
        raise FloatingPointError(
            f"FedMGDA+: the min-norm program did not converge: {solved.message}"
        )
    lam = np.clip(solved.x, [b[0] for b in bounds], [b[1] for b in bounds])
    return lam / lam.sum()


@register("fedmgda_plus")
@dataclass(frozen=True)
class FedMGDAPlus(Algorithm):
    """The min-norm convex combination of the normalised client updates, within ε of uniform."""

    epsilon: float = 0.1
    server_lr: float | None = None
    weighting: Literal["examples", "uniform"] = "examples"

    def __post_init__(self) -> None:
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"algorithm.epsilon: must be in [0, 1] (got {self.epsilon})")
        if self.server_lr is not None and self.server_lr <= 0:
            raise ValueError(f"algorithm.server_lr: must be > 0 (got {self.server_lr})")
        check_weighting(self.weighting)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        if not results:
            raise ValueError("aggregate of no clients")
        theta = state.global_params
        names = sorted(theta)
        start = flatten(theta, names).double()
        updates = torch.stack([flatten(r.params, names).double() - start for r in results])
        norms = updates.norm(dim=1)
        moved = norms > 0
        if not moved.any():
            return self.next_state(state)
        unit = updates[moved] / norms[moved, None]
        counts = [r.num_examples for r, m in zip(results, moved.tolist()) if m]
        center = np.asarray(aggregation_weights(counts, self.weighting))
        lam = min_norm_weights((unit @ unit.T).numpy(), self.epsilon, center / center.sum())
        direction = torch.from_numpy(lam) @ unit
        step = float(norms[moved].mean()) if self.server_lr is None else self.server_lr
        new = unflatten((start + step * direction).float(), theta, names)
        return self.next_state(
            state,
            global_params=new,
            extra={"weights": lam.tolist(), "direction_norm": float(direction.norm())},
        )

"""Quadratic clients run through the real algorithms and the real local-training loop
(``train_locally`` with plain SGD): the harness of the closed-form tests.

Four clients, F_k(w) = ½ (w − w_k*)ᵀ H_k (w − w_k*), optima (1,0), (0,1), (−1,0), (0,−1),
weighted by p_k = n_k / Σ_j n_j (n_k: the client's number of examples, which the loss
ignores). The federated optimum of F = Σ_k p_k F_k is w* = (Σ p_k H_k)⁻¹ Σ p_k H_k w_k*.
E plain SGD steps of size η from x move a client to y = w_k* + A_k (x − w_k*) with
A_k = (I − η H_k)^E, so FedAvg's fixed point is x̄ = (Σ p_k (I − A_k))⁻¹ Σ p_k (I − A_k) w_k*,
which is not w* when the H_k differ (E > 1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from fedloom import algorithms
from fedloom.algorithms import ClientContext
from fedloom.config import TrainConfig

OPTIMA = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
CURVED = [np.diag([4.0, 0.25]), np.diag([0.25, 4.0]), np.eye(2), np.diag([2.0, 0.5])]
FLAT = [np.eye(2)] * 4


class _Head:
    training = True

    def train(self, mode: bool = True) -> _Head:
        self.training = mode
        return self

    def collate(self, features: list) -> None:
        return None


class Quadratic:
    """The parts of FedModel that local training and the diagnostics touch, for
    F(w) = ½ (w − w*)ᵀ H (w − w*) (the same value on every batch)."""

    def __init__(self, h: np.ndarray, optimum: np.ndarray) -> None:
        self.h = torch.tensor(h, dtype=torch.float64)
        self.optimum = torch.tensor(optimum, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.head = _Head()
        #: FedModel's device and resolved precision: float64 arithmetic on the CPU
        self.device = torch.device("cpu")
        self.precision = "fp32"
        #: the adapter as built (FedModel.initial_params): w = 0
        self.initial_params = self.get_params()

    @property
    def param_names(self) -> list[str]:
        return ["w"]

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {"w": self.w}

    def set_params(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.w.copy_(params["w"])

    def get_params(self) -> dict[str, torch.Tensor]:
        return {"w": self.w.detach().clone()}

    def batches(
        self, features: Sequence[Any], batch_size: int, order: np.ndarray | None = None
    ) -> Iterator[None]:
        order = np.arange(len(features)) if order is None else order
        for start in range(0, len(order), batch_size):
            yield self.head.collate([features[i] for i in order[start : start + batch_size]])

    def loss(self, batch: Any) -> torch.Tensor:
        d = self.w - self.optimum
        return 0.5 * d @ self.h @ d

    @torch.no_grad()
    def predict(self, features: Sequence[Any], batch_size: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(no predictions, no labels, F(w)): what scoring by loss reads."""
        empty = np.zeros(len(features))
        return empty, empty, float(self.loss(None))

    @torch.no_grad()
    def mean_loss(self, features: Sequence[Any], batch_size: int) -> float:
        """F(w): what IFCA's choice of a cluster reads (``FedModel.mean_loss``)."""
        return float(self.loss(None))


def sgd(lr: float, steps: int) -> TrainConfig:
    return TrainConfig(
        local_steps=steps,
        batch_size=1,
        optimizer="sgd",
        momentum=0.0,
        lr=lr,
        weight_decay=0.0,
        schedule="constant",
        warmup_ratio=0.0,
        clip_norm=0.0,
        optimizer_state="reset",
    )


def context(
    model: Quadratic, k: int, size: int, lr: float, steps: int, r: int, rounds: int, state: dict
) -> ClientContext:
    """Client k's round-r context: ``size`` (ignored) examples, ``steps`` SGD steps."""
    return ClientContext(
        k,
        model,
        [{"input_ids": [0]}] * size,
        sgd(lr, steps),
        r,
        rounds,  # type: ignore[arg-type]
        state,
        seed=r,
    )


def simulate(
    name: str,
    curvatures: list[np.ndarray],
    steps: list[int],
    lr: float,
    rounds: int,
    sizes: Sequence[int] = (1, 1, 1, 1),
    start: np.ndarray | None = None,
    **hp: Any,
) -> np.ndarray:
    """The global parameters after ``rounds`` rounds of algorithm ``name`` from ``start``
    (default 0), every client taking part in every round."""
    alg = algorithms.create(name, **hp)
    models = [Quadratic(h, w) for h, w in zip(curvatures, OPTIMA)]
    local_states: list[dict] = [{} for _ in models]
    init = np.zeros(2) if start is None else start
    state = alg.init({"w": torch.tensor(init, dtype=torch.float64)})
    for r in range(rounds):
        results = []
        for k, model in enumerate(models):
            ctx = context(model, k, sizes[k], lr, steps[k], r, rounds, local_states[k])
            results.append(alg.local_train(ctx, alg.payload(state, k)))
        state = alg.aggregate(state, results)
    return state.global_params["w"].double().numpy()


def shares(sizes: Sequence[int] | None) -> np.ndarray:
    """p_k = n_k / Σ_j n_j (uniform when ``sizes`` is None)."""
    n = np.ones(len(OPTIMA)) if sizes is None else np.asarray(sizes, dtype=np.float64)
    return n / n.sum()


def optimum(curvatures: list[np.ndarray], sizes: Sequence[int] | None = None) -> np.ndarray:
    """w* = (Σ p_k H_k)⁻¹ Σ p_k H_k w_k*."""
    p = shares(sizes)
    return np.linalg.solve(
        sum(pk * h for pk, h in zip(p, curvatures)),
        sum(pk * h @ w for pk, h, w in zip(p, curvatures, OPTIMA)),
    )


def fedavg_fixed_point(
    curvatures: list[np.ndarray], steps: list[int], lr: float, sizes: Sequence[int] | None = None
) -> np.ndarray:
    """x̄ = (Σ p_k (I − A_k))⁻¹ Σ p_k (I − A_k) w_k*, A_k = (I − η H_k)^{E_k}."""
    p = shares(sizes)
    gaps = [
        pk * (np.eye(2) - np.linalg.matrix_power(np.eye(2) - lr * h, e))
        for pk, h, e in zip(p, curvatures, steps)
    ]
    return np.linalg.solve(sum(gaps), sum(g @ w for g, w in zip(gaps, OPTIMA)))

"""FedU (Dinh, Vu, Tran, Hong & Pathirana, 2021, "A New Look and Convergence Rate of
Federated Multi-Task Learning with Laplacian Regularization", Algorithm 1).

The objective couples the clients' own adapters x_k over a client graph with weights a_kj,

    min  Σ_k f_k(x_k) + (λ/4) Σ_k Σ_j a_kj ‖x_k − x_j‖²

and FedU alternates the two parts. Each sampled client k takes the round's local steps on
f_k from its x_k and sends the result x̃_k (the method's definition sends it); the server
takes the Laplacian step over the sampled set S,

    x_k ← x̃_k − λ Σ_{j ∈ S, j ≠ k} a_kj (x̃_k − x̃_j)        for k ∈ S

and keeps x_k for client k's next round; it is the adapter client k uses. λ = 0 is local
training; the largest λ the step allows, λ Σ_j a_kj = 1, replaces x̃_k by the weighted mean
of its neighbours. (The paper's step is η λ with η the local learning rate; here the
Laplacian step is the server's, separate from the clients' optimizer, so λ is that
product.)

The graph (``graph``): ``"full"`` (a_kj = 1), ``"similarity"`` (a_kj = max(0, cos(Δ_k, Δ_j))
of this round's updates Δ_k = x̃_k − x_k: clients whose training moves the same way pull
on each other), or the K x K ``adjacency`` matrix given in the config (symmetric, ≥ 0).
Default ``"similarity"``, measured (``benchmarks/personalization.py``, MiniLM + LoRA, 8
rounds, seed 0, selected on the clients' validation splits): on MRPC with 3 of 10 clients swapping
the labels, validation 66.9 % against 61.5 % for the full graph, which pulls the swapped
clients towards the majority; on four GLUE tasks over 8 clients, 60.9 % against 60.2 %.

``lam`` None (default): λ = 1 / (2 max_k Σ_{j ∈ S} a_kj) each round, so the client with
the most neighbours moves half way to their mean — a step that never overshoots whatever
the graph and the number of clients.

**Visible to the server.** The Laplacian step couples the clients' adapters, so the server
keeps each client's x_k in its state (and in checkpoints): FedU's personal adapters are
seen by the server by definition, unlike Ditto's or FedPer's personal tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedloom.algorithms.base import Algorithm, ClientContext, ClientResult, ServerState
from fedloom.algorithms.clustering import cosine_similarities, update
from fedloom.algorithms.registry import register
from fedloom.params import Params, stack, unflatten

MODELS = "models"


@register("fedu")
@dataclass(frozen=True)
class FedU(Algorithm):
    """Clients' own adapters coupled by a Laplacian over a client graph (server step)."""

    personalized = True
    has_global = False
    lam: float | None = None
    graph: Literal["full", "similarity"] | None = None  # None: similarity, or the adjacency
    adjacency: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if self.lam is not None and self.lam < 0:
            raise ValueError(f"algorithm.lam: must be >= 0 (got {self.lam})")
        if self.graph not in (None, "full", "similarity"):
            raise ValueError(f"algorithm.graph: must be full or similarity (got {self.graph!r})")
        if self.adjacency is not None:
            a = np.asarray(self.adjacency, dtype=np.float64)
            if a.ndim != 2 or a.shape[0] != a.shape[1]:
                raise ValueError(
                    f"algorithm.adjacency: must be a square K x K matrix (got shape {a.shape})"
                )
            if (a < 0).any() or not np.allclose(a, a.T):
                raise ValueError("algorithm.adjacency: must be symmetric with entries >= 0")
            if self.graph is not None:
                raise ValueError("algorithm.adjacency: replaces graph; leave graph unset")

    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        """The adjacency matrix must cover the K clients, and a given λ must not overshoot
        (λ Σ_j a_kj ≤ 1 for the largest degree the sampled clients can have)."""
        if self.adjacency is not None and len(self.adjacency) != num_clients:
            raise ValueError(
                f"algorithm.adjacency: is {len(self.adjacency)} x "
                f"{len(self.adjacency)}, the federation has {num_clients} clients "
                f"(partition.num_clients)"
            )
        if self.lam is None:
            return
        if self.adjacency is not None:
            degree = float(np.asarray(self.adjacency).sum(axis=1).max())
        else:
            degree = float(clients_per_round - 1)
        if self.lam * degree > 1.0:
            raise ValueError(
                f"algorithm.lam: {self.lam} x the largest degree {degree:g} is above 1, so the "
                f"Laplacian step would overshoot the neighbours' mean; use lam <= "
                f"{1.0 / degree:.4g} (or leave it unset)"
            )

    def init(self, global_params: Params) -> ServerState:
        return ServerState(0, global_params, {MODELS: {}})

    def payload(self, state: ServerState, client_id: int) -> Params:
        return state.extra[MODELS].get(client_id, state.global_params)

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        return payload

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        if not results:
            raise ValueError("aggregate of no clients")
        ids = [r.client_id for r in results]
        weights = self.weights(state, results)
        degree = weights.sum(axis=1)
        lam = (0.0 if degree.max() == 0 else 0.5 / degree.max()) if self.lam is None else self.lam
        names = sorted(results[0].params)
        x = stack([r.params for r in results], names).double()
        laplacian = np.diag(degree) - weights
        stepped = x - lam * (torch.from_numpy(laplacian) @ x)
        models = dict(state.extra[MODELS])
        for i, cid in enumerate(ids):
            models[cid] = unflatten(stepped[i], results[i].params, names)
        return self.next_state(state, extra={MODELS: models, "lam": lam})

    def weights(self, state: ServerState, results: Sequence[ClientResult]) -> np.ndarray:
        """a_kj over the sampled clients (zero diagonal)."""
        ids = [r.client_id for r in results]
        if self.adjacency is not None:
            a = np.asarray(self.adjacency, dtype=np.float64)[np.ix_(ids, ids)]
        elif self.graph == "full":
            a = np.ones((len(ids), len(ids)))
        else:
            a = np.clip(
                cosine_similarities(
                    [update(r.params, self.payload(state, r.client_id)) for r in results]
                ),
                0.0,
                None,
            )
        np.fill_diagonal(a, 0.0)
        return a

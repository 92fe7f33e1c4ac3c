"""FedEM (Marfoq, Neglia, Bellet, Kameni & Vidal, NeurIPS 2021, "Federated Multi-Task
Learning under a Mixture of Distributions", Algorithm 1), on adapters.

Every client's data distribution is a mixture of M shared components; the server keeps M
component adapters θ_1 … θ_M and sends all of them. Client t keeps its mixture weights π_t
(on the client, never sent) and each round runs

    E-step:  q_t(z_i = m) ∝ π_tm · p_θm(y_i | x_i)          for its training examples i
             π_tm ← (1/n_t) Σ_i q_t(z_i = m)
    M-step:  for each m, the round's local steps on (1/|B|) Σ_{i∈B} q_t(z_i = m) ℓ(θ_m; x_i, y_i)
             from θ_m (moments kept per component), sending the M trained adapters

and the server averages each component over the clients, weighted by examples:
θ_m ← Σ_t n_t θ_m,t / Σ_t n_t. Client t predicts with its mixture

    p_t(y | x) = Σ_m π_tm p_θm(y | x)                            (:mod:`fedloom.train.mixture`)

which is what it is scored with and what its personal checkpoint holds (the components
and π). A client scored before it ever trained first fits π by E-steps on its training
data with the components fixed (``estep_iterations``, as the paper adapts new clients).

Cost: M local trainings and M scoring passes over the client's training data per round,
and M adapters each way. M = 3, the paper's default for its experiments. Classification
tasks only (the mixture is one of class distributions).

Initialization (``initialization``). Identical components get identical responsibilities
and stay identical, so they must start apart:

* ``"clients"`` (default): round 1 is a FedAvg round from the initial adapter (with all
  components equal a client trains one copy), and the server seeds component m with the
  mean of the m-th group of a k-means of the clients' updates (as IFCA does,
  :func:`clustering.group_updates`); the E-steps take over from round 2.
* ``"random"``: the paper's, each component redrawn from the initial adapter's
  distribution (:func:`clustering.redraw`, seeds 0 … M−1). With LoRA, whose B starts at
  zero, the components then differ only in their heads: measured on MRPC with 3 of 10
  clients swapping the labels (BENCHMARKS.md), the mixture weights stayed near uniform
  after 8 rounds (mean max_m π 0.37 for M = 3, 0.52 for M = 2) and the dominant
  components did not match the grouping (adjusted Rand −0.09).

Logged: every client's π after each round it trained (metrics.jsonl, ``scope:
"mixture"``); its dominant component argmax_m π_tm is its ``clusters`` assignment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from scipy.special import softmax

from fedloom.algorithms.base import Algorithm, ClientContext, ClientResult, ServerState
from fedloom.algorithms.clustering import (
    all_identical,
    average_groups,
    check_initialization,
    check_seeding,
    group_updates,
    initial_adapters,
)
from fedloom.algorithms.fedavg import aggregation_weights, check_weighting
from fedloom.algorithms.registry import register
from fedloom.models.heads import Feature
from fedloom.params import Params, pack, unpack, weighted_average
from fedloom.train.local import train_locally
from fedloom.train.mixture import component_log_probs, evaluate_mixture, pack_mixture

WEIGHTS, MIXTURES, SEEDED = "mixture", "mixtures", "seeded"


def responsibilities(
    log_likelihood: np.ndarray, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """E-step: (q, π) from the (M, n) log p_m(y_i | x_i) and the weights π (M,):
    q_mi ∝ π_m p_m(y_i | x_i) (each column sums to 1), π_m = mean_i q_mi."""
    with np.errstate(divide="ignore"):
        log_w = np.log(weights)
    q = softmax(log_likelihood + log_w[:, None], axis=0)
    return q, q.mean(axis=1)


@register("fedem")
@dataclass(frozen=True)
class FedEM(Algorithm):
    """A mixture of M shared component adapters, with mixture weights per client."""

    personalized = True
    has_global = False
    needs_classes = True
    num_components: int = 3
    initialization: Literal["clients", "random"] = "clients"
    estep_iterations: int = 10
    weighting: Literal["examples", "uniform"] = "examples"

    def __post_init__(self) -> None:
        if self.num_components < 1:
            raise ValueError(f"algorithm.num_components: must be >= 1 (got {self.num_components})")
        if self.estep_iterations < 1:
            raise ValueError(
                f"algorithm.estep_iterations: must be >= 1 (got {self.estep_iterations})"
            )
        check_weighting(self.weighting)
        check_initialization(self.initialization)

    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        """With ``initialization = "clients"`` every component must be seeded from one of
        the first round's clients (M ≤ clients per round). Random components need no
        seeding, and a mixture may have more components than the federation has clients."""
        check_seeding(
            "num_components",
            self.num_components,
            "components",
            self.initialization,
            clients_per_round,
        )

    def init(self, global_params: Params) -> ServerState:
        components = initial_adapters(global_params, self.num_components, self.initialization)
        return ServerState(
            0, pack(components), {MIXTURES: {}, SEEDED: self.initialization == "random"}
        )

    # --- client ---------------------------------------------------------------------------
    def log_likelihood(
        self, ctx: ClientContext, components: Sequence[Params], features: Sequence[Feature]
    ) -> np.ndarray:
        """(M, n) log p_m(y_i | x_i)."""
        log_probs = component_log_probs(ctx.model, components, features, ctx.settings.batch_size)
        labels = np.array([f["label"] for f in features])
        return log_probs[:, np.arange(len(labels)), labels]

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        components = unpack(payload)
        m_count = len(components)
        weights = np.asarray(ctx.state.get(WEIGHTS, np.full(m_count, 1.0 / m_count)))
        if all_identical(components):  # not seeded yet: every component would train alike
            ctx.model.set_params(components[0])
            metrics = train_locally(ctx, state_key="optimizer/component0")
            return ClientResult(
                ctx.client_id,
                pack([ctx.model.get_params()] * m_count),
                len(ctx.train),
                {**metrics, **{f"pi_{m}": float(w) for m, w in enumerate(weights)}},
            )
        q, weights = responsibilities(self.log_likelihood(ctx, components, ctx.train), weights)
        ctx.state[WEIGHTS] = weights.tolist()  # client state stores lists, not arrays
        trained, loss = [], 0.0
        for m, component in enumerate(components):
            ctx.model.set_params(component)
            component_ctx = replace(ctx, seed=ctx.seed + m)  # same state dict: moments persist
            metrics = train_locally(
                component_ctx, state_key=f"optimizer/component{m}", example_weights=q[m]
            )
            loss += metrics["train_loss"]
            trained.append(ctx.model.get_params())
        return ClientResult(
            ctx.client_id,
            pack(trained),
            len(ctx.train),
            {
                "train_loss": loss,
                "local_steps": metrics["local_steps"],
                **{f"pi_{m}": float(w) for m, w in enumerate(weights)},
            },
        )

    def client_weights(self, ctx: ClientContext, components: Sequence[Params]) -> np.ndarray:
        """π_t: the client's own, or fitted by E-steps with the components fixed."""
        if WEIGHTS in ctx.state:
            return np.asarray(ctx.state[WEIGHTS])
        weights = np.full(len(components), 1.0 / len(components))
        log_likelihood = self.log_likelihood(ctx, components, ctx.train)
        for _ in range(self.estep_iterations):
            _, weights = responsibilities(log_likelihood, weights)
        return weights

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        components = unpack(payload)
        return pack_mixture(components, self.client_weights(ctx, components).tolist())

    def evaluate_local(
        self,
        ctx: ClientContext,
        payload: Params,
        splits: Mapping[str, Sequence[Feature]],
        batch_size: int,
    ) -> tuple[Params, dict[str, dict[str, float | None]]]:
        mixture = self.client_adapter(ctx, payload)
        return mixture, {
            name: evaluate_mixture(ctx.model, mixture, features, batch_size)
            for name, features in splits.items()
            if features
        }

    # --- server ---------------------------------------------------------------------------
    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        if not results:
            raise ValueError("aggregate of no clients")
        trained = [unpack(r.params) for r in results]
        weights = aggregation_weights([r.num_examples for r in results], self.weighting)
        components = [
            weighted_average([t[m] for t in trained], weights) for m in range(len(trained[0]))
        ]
        if not state.extra[SEEDED]:
            components = self.seed(unpack(state.global_params)[0], results, trained, components)
        mixtures = {
            **state.extra[MIXTURES],
            **{
                r.client_id: [r.metrics[f"pi_{m}"] for m in range(len(components))] for r in results
            },
        }
        return self.next_state(
            state, global_params=pack(components), extra={MIXTURES: mixtures, SEEDED: True}
        )

    def seed(
        self,
        start: Params,
        results: Sequence[ClientResult],
        trained: Sequence[Sequence[Params]],
        means: list[Params],
    ) -> list[Params]:
        """Component m: the mean of the m-th k-means group of the first round's updates
        (the mean over all clients, ``means``, for a group left empty)."""
        firsts = [ClientResult(r.client_id, t[0], r.num_examples) for r, t in zip(results, trained)]
        groups = group_updates(start, firsts, len(means))
        return average_groups(firsts, groups, means, self.weighting)

    def round_rows(self, state: ServerState) -> list[dict]:
        """Every client's π as last reported (``scope: "mixture"``)."""
        return [
            {
                "scope": "mixture",
                "weights": {
                    str(c): [round(w, 6) for w in pi]
                    for c, pi in sorted(state.extra[MIXTURES].items())
                },
            }
        ]

    def assignment(self, state: ServerState) -> Mapping[int, int]:
        """Each client's dominant component argmax_m π_tm."""
        return {c: int(np.argmax(pi)) for c, pi in state.extra[MIXTURES].items()}

    def cluster_adapters(self, state: ServerState) -> list[Params]:
        return unpack(state.global_params)

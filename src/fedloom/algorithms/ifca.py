"""IFCA, the Iterative Federated Clustering Algorithm (Ghosh, Chung, Yin & Ramchandran,
NeurIPS 2020, "An Efficient Framework for Clustered Federated Learning"), in its
model-averaging form (their Algorithm 2), on adapters.

The server keeps k cluster adapters θ_1 … θ_k and sends all of them to every sampled
client. Client i estimates which cluster it belongs to and trains that one:

    ĵ_i = argmin_j F_i(θ_j)        (mean loss on its training data, at most
                                    ``assign_examples`` examples of it)
    θ_i ← θ_ĵ after the round's local steps;  it sends θ_i and ĵ_i

and the server averages each cluster over the clients that chose it,

    θ_j ← Σ_{i: ĵ_i = j} n_i θ_i / Σ_{i: ĵ_i = j} n_i      (unchanged when none chose j).

The adapter a client uses is θ_ĵ, chosen by the same rule on its training data when it is
scored. Each client keeps optimizer moments per cluster (a switch of cluster does not
carry the other adapter's moments over). Communication: k adapters down, one up.

Initialization (``initialization``):

* ``"clients"`` (default): round 1 is a FedAvg round from the initial adapter (every
  cluster starts equal, so every client trains the same start); the server then seeds the
  k clusters from the clients' updates, k-means (scikit-learn, k-means++ with 10 restarts,
  fixed random state) on the unit-normalised updates Δ_i = θ_i − θ⁰, and averages each
  group. Updates from one start are comparable, which makes them the best evidence of
  grouping the server will get (the same signal CFL splits on).
* ``"random"``: the paper's — cluster j's tensors are redrawn from their initial
  distribution (seed j; :func:`clustering.redraw`). With LoRA, B starts at zero, so
  random clusters differ only in their heads at first and the first choices are close to
  arbitrary; Ghosh et al. note that random initialization may need restarts.

The assignment the server learns (ĵ of every client that trained) is logged every round
(``scope: "clusters"``) and is the run summary's ``clusters``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from fedloom.algorithms.base import Algorithm, ClientContext, ClientResult, ServerState
from fedloom.algorithms.clustering import (
    average_groups,
    check_initialization,
    check_seeding,
    group_updates,
    initial_adapters,
    lowest_loss,
)
from fedloom.algorithms.fedavg import check_weighting
from fedloom.algorithms.registry import register
from fedloom.params import Params, pack, unpack
from fedloom.train.local import train_locally

ASSIGNMENT, SEEDED = "assignment", "seeded"


@register("ifca")
@dataclass(frozen=True)
class IFCA(Algorithm):
    """k cluster adapters; each client trains the one with the lowest loss on its data."""

    personalized = True
    has_global = False
    num_clusters: int = 2
    initialization: Literal["clients", "random"] = "clients"
    #: examples a client scores each cluster on (None: all its training data)
    assign_examples: int | None = 256
    weighting: Literal["examples", "uniform"] = "examples"

    def __post_init__(self) -> None:
        if self.num_clusters < 1:
            raise ValueError(f"algorithm.num_clusters: must be >= 1 (got {self.num_clusters})")
        check_initialization(self.initialization)
        if self.assign_examples is not None and self.assign_examples < 1:
            raise ValueError(
                f"algorithm.assign_examples: must be >= 1 (got {self.assign_examples})"
            )
        check_weighting(self.weighting)

    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        """Every cluster must be able to hold a client (k ≤ K), and with ``initialization =
        "clients"`` be seeded from one of the first round's (k ≤ clients per round)."""
        if self.num_clusters > num_clients:
            raise ValueError(
                f"algorithm.num_clusters: {self.num_clusters} clusters for the {num_clients} "
                f"clients of the federation (partition.num_clients): each client is in one "
                f"cluster, so at most {num_clients} can ever hold one"
            )
        check_seeding(
            "num_clusters", self.num_clusters, "clusters", self.initialization, clients_per_round
        )

    def init(self, global_params: Params) -> ServerState:
        clusters = initial_adapters(global_params, self.num_clusters, self.initialization)
        return ServerState(
            0, pack(clusters), {ASSIGNMENT: {}, SEEDED: self.initialization == "random"}
        )

    # --- client ---------------------------------------------------------------------------
    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        clusters = unpack(payload)
        chosen, losses = lowest_loss(ctx, clusters, self.assign_examples, ctx.settings.batch_size)
        ctx.model.set_params(clusters[chosen])
        metrics = train_locally(ctx, state_key=f"optimizer/cluster{chosen}")
        scored = {f"cluster_loss_{j}": v for j, v in enumerate(losses) if not math.isnan(v)}
        return ClientResult(
            ctx.client_id,
            ctx.model.get_params(),
            len(ctx.train),
            {**metrics, **scored, "cluster": float(chosen)},
        )

    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params:
        clusters = unpack(payload)
        chosen, _ = lowest_loss(ctx, clusters, self.assign_examples, ctx.settings.batch_size)
        return clusters[chosen]

    def trained_from(self, payload: Params, result: ClientResult) -> Params:
        """The cluster adapter the client chose and trained (its ``cluster`` metric)."""
        return unpack(payload)[int(result.metrics["cluster"])]

    # --- server ---------------------------------------------------------------------------
    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        clusters = unpack(state.global_params)
        if state.extra[SEEDED]:
            choice = {r.client_id: int(r.metrics["cluster"]) for r in results}
        else:
            choice = group_updates(clusters[0], results, self.num_clusters)
        new = average_groups(results, choice, clusters, self.weighting)
        assignment = {**state.extra[ASSIGNMENT], **choice}
        return self.next_state(
            state, global_params=pack(new), extra={ASSIGNMENT: assignment, SEEDED: True}
        )

    def assignment(self, state: ServerState) -> Mapping[int, int]:
        return state.extra[ASSIGNMENT]

    def cluster_adapters(self, state: ServerState) -> list[Params]:
        return unpack(state.global_params)

"""The core protocol every algorithm follows (see docs/architecture.md, "The algorithm protocol").

    state   = alg.init(global_params)                 # ServerState
    payload = alg.payload(state, client_id)           # Params the client receives
    result  = alg.local_train(ctx, payload)           # ClientResult   (on the client)
    state   = alg.aggregate(state, results)           # next ServerState (a pure function)
    scores  = alg.evaluate_local(ctx, payload, splits)  # metrics      (on the client)
    groups  = alg.assignment(state)                   # client -> cluster, clustered methods

Before anything runs, ``alg.check_federation(clients_per_round, num_clients)``,
``alg.check_training(settings)`` and ``alg.check_model(initial_params)`` refuse
hyperparameters the federation, the training settings or the model cannot satisfy (a
ValueError naming the config key, which the caller reports as bad input).

An algorithm is a frozen dataclass whose fields are its hyperparameters; the server step
never touches models, only ``Params``, which keeps checkpoint/resume exact and lets the
same algorithm run unchanged in every runtime.

Personal state lives on the client. A method's personal tensors (Ditto's personal
adapter, FedPer's head, APFL's mixing weight, optimizer moments) are kept in the client's
persistent ``ctx.state``; ``ClientResult.params`` holds only what the method's definition
sends to the server. The adapter a client actually uses is built on the client by
:meth:`Algorithm.client_adapter` from its state and the current payload, and scored there
by :meth:`Algorithm.evaluate_local`: the server receives metrics, never personal weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from fedloom.client_context import ClientContext
from fedloom.config import TrainConfig
from fedloom.evaluation.score import evaluate
from fedloom.models.heads import Feature
from fedloom.params import Params
from fedloom.train.local import train_locally


@dataclass(frozen=True)
class ServerState:
    """Everything the server carries from one round to the next."""

    round: int
    global_params: Params
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientResult:
    """What one client sends back: ``params`` is only what the method shares."""

    client_id: int
    params: Params
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Algorithm:
    """Base class: FedAvg-style payload and local training; subclasses define aggregate."""

    name: ClassVar[str] = "base"
    #: the clients use adapters of their own (scored on each client's own test split)
    personalized: ClassVar[bool] = False
    #: has a meaningful global adapter (scored on the dev set and every client)
    has_global: ClassVar[bool] = True
    #: trains one party on all clients' data (the centralized reference)
    pools_data: ClassVar[bool] = False
    #: the adapter structure the method is defined on ([model] adapters: "dual" for global +
    #: local LoRA and a gate, "mosaic" for FedMosaic's), which Experiment.build then
    #: chooses by itself; None: any
    adapter_model: ClassVar[str | None] = None
    #: aggregates across backbones in a mixed-backbone federation ([[model.groups]]): one
    #: server state for every client, initialized by :meth:`init_mixed`; any other method
    #: runs once per backbone, within architecture
    spans_backbones: ClassVar[bool] = False
    #: is defined on class probabilities (FedEM's mixture): refuses regression tasks
    needs_classes: ClassVar[bool] = False
    #: moves the classifier's logits by a client's label counts
    #: (:mod:`fedloom.models.label_prior`: FedLC, FedRoD, the oracle): refuses regression
    #: tasks and heads without one logit per class (a causal LM's verbalizer)
    adjusts_logits: ClassVar[bool] = False
    #: is defined on per-client LoRA ranks ([[model.ranks]]): its first state then comes
    #: from :meth:`init_ranked`; every other method refuses such a federation
    mixed_ranks: ClassVar[bool] = False
    #: why the server step is not a mean of the clients' shared updates, None when it is
    #: (FedAvg and the methods built on its combine): secure aggregation gives the server
    #: only their sum, and DP-FedAvg's noise is calibrated to their mean
    #: (:mod:`fedloom.composition`)
    not_a_mean: ClassVar[str | None] = "its server step is not a weighted mean of the updates"
    #: what a client sends the server each round: "updates", its shared tensors, which the
    #: transform chain and a simulated attack act on; "encoded", the method's own encoding
    #: of them, which only its aggregation decodes; "nothing"
    sends: ClassVar[Literal["updates", "encoded", "nothing"]] = "updates"
    #: its client step reads the training data only through the shared local-training loop
    #: on a mean of per-example losses, so DP-SGD covers everything it derives
    #: (:mod:`fedloom.privacy.sample_level`). Read with :func:`declares`: each method
    #: states it for itself, a subclass does not inherit it (one that adds a proximal term
    #: or a loss-based choice to its parent's client step would pass as covered)
    per_example_client_step: ClassVar[bool] = False

    # --- checks before anything runs: a ValueError naming the config key -------------------
    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        """Refuse hyperparameters the federation cannot satisfy (``num_clients`` clients,
        ``clients_per_round`` of them sampled each round), e.g. Krum's n > 2f + 2.
        Called before data or a model is loaded; nothing to check by default."""

    def check_training(self, settings: TrainConfig) -> None:
        """Refuse hyperparameters the local training ``settings`` (``[train]``: learning
        rates, the local budget) cannot satisfy, e.g. L2GD's aggregation step θ > 1.
        Called before data or a model is loaded; nothing to check by default."""

    def check_model(self, params: Params) -> None:
        """Refuse hyperparameters the model cannot satisfy, given its initial adapter
        ``params`` (the names and shapes :meth:`init` will receive), e.g. a personal name
        pattern that selects no tensor. Called once the model is built, before anything is
        written; nothing to check by default."""

    def init(self, global_params: Params) -> ServerState:
        return ServerState(round=0, global_params=global_params)

    def init_mixed(
        self, initial: Mapping[str, Params], backbone_of: Mapping[int, str]
    ) -> ServerState:
        """A spanning method's first state in a mixed-backbone federation: ``initial`` is
        each backbone's initial adapter, ``backbone_of`` every client's backbone."""
        raise NotImplementedError(f"{self.name} does not aggregate across backbones")

    def init_ranked(self, global_params: Params, ranks: Mapping[int, int]) -> ServerState:
        """A rank-aware method's first state in a mixed-rank federation: ``global_params``
        at the largest rank, ``ranks`` every client's rank."""
        raise NotImplementedError(f"{self.name} is not defined on per-client ranks")

    def payload(self, state: ServerState, client_id: int) -> Params:
        return state.global_params

    def payloads(self, state: ServerState, client_ids: Sequence[int]) -> dict[int, Params]:
        """:meth:`payload` of each of ``client_ids``; a method whose payloads share work
        (one matrix product for all of them) computes them together here."""
        return {cid: self.payload(state, cid) for cid in client_ids}

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        ctx.model.set_params(payload)
        metrics = train_locally(ctx)
        return ClientResult(ctx.client_id, ctx.model.get_params(), len(ctx.train), metrics)

    def trained_from(self, payload: Params, result: ClientResult) -> Params:
        """What the client trained ``result.params`` from, given the ``payload`` it received:
        the start of its update Δ = θ − start, which a model-poisoning attack forges
        (:meth:`fedloom.attacks.Attack.poison`). The payload itself by default; a method
        whose payload holds several adapters names the one the client trained (IFCA)."""
        return payload

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        raise NotImplementedError

    # --- on the client: the adapter it uses, and its scores ------------------------------
    def client_adapter(self, ctx: ClientContext, payload: Params) -> Params | None:
        """The full adapter client ``ctx.client_id`` uses, built from its local state and
        the ``payload`` it receives now; None when it uses the global adapter as is.

        Must not change ``ctx.state``: scoring never alters training."""
        return None

    def evaluate_local(
        self,
        ctx: ClientContext,
        payload: Params,
        splits: Mapping[str, Sequence[Feature]],
        batch_size: int,
    ) -> tuple[Params, dict[str, dict[str, float | None]]] | None:
        """Score the client's own adapter on its ``splits`` (e.g. ``{"test": ..., "val":
        ...}``); returns the adapter and ``{split: metrics}``, or None without one."""

        adapter = self.client_adapter(ctx, payload)
        if adapter is None:
            return None
        return adapter, {
            name: evaluate(ctx.model, adapter, features, batch_size)
            for name, features in splits.items()
            if features
        }

    # --- clustered methods: the groups the server knows ---------------------------------
    def assignment(self, state: ServerState) -> Mapping[int, int] | None:
        """Client → cluster as the server knows it after ``state``'s round (clients that
        never trained are absent); None for a method without clusters."""
        return None

    def cluster_adapters(self, state: ServerState) -> Sequence[Params] | None:
        """The server's cluster adapters (checkpointed one file each); None without."""
        return None

    def round_rows(self, state: ServerState) -> list[dict[str, Any]]:
        """Extra metrics.jsonl rows the server logs after ``state``'s round, each with its
        ``scope`` (e.g. MOCHA's Ω, FedEM's mixture weights)."""
        return []

    def summary(self, state: ServerState) -> dict[str, Any]:
        """Extra entries for summary.json after the last round (e.g. FedMosaic's last
        relevance matrix, under ``"relevance"``, which the run directory also draws)."""
        return {}

    @staticmethod
    def next_state(state: ServerState, **changes: Any) -> ServerState:
        return replace(state, round=state.round + 1, **changes)


def declares(cls: type[Algorithm], capability: str) -> bool:
    """Whether the class ``cls`` itself states ``capability`` (a ClassVar such as
    :attr:`Algorithm.per_example_client_step`), not a parent of it: for promises that a
    subclass changing the client step must make again for itself."""
    return bool(vars(cls).get(capability, False))

"""The aggregation rule (``[aggregation]``): how an averaging algorithm combines the sampled
clients' parameters, composed with any algorithm that averages rather than written into it.

An algorithm that averages (FedAvg and everything that takes its aggregation step from
:meth:`FedAvg.combine`: FedAvgM, FedAdagrad/FedAdam/FedYogi, FedProx, FedSGD, Ditto's and
the partial-sharing methods' global part, ...) holds an :class:`AggregationRule` in its
``rule`` field; ``[aggregation]`` in the config sets it (:func:`with_rule`), and the rules
themselves are :mod:`fedloom.algorithms.aggregators`' (mean, coordinate-wise median,
trimmed mean, Krum, Multi-Krum, Bulyan, norm bounding, centered clipping, FLTrust).
``rule = "mean"`` is the algorithm's own weighted mean.

The seam is :meth:`AggregationRule.combine` (``matrix, weights, reference, state ->
point``), which :meth:`FedAvg.combine_flat` calls for every averaging algorithm with the
global parameters the clients started from as ``reference`` (x_t) and, for a
:attr:`~AggregationRule.stateful` rule, its state from ``ServerState.extra[STATE_KEY]``;
the state it keeps there is the round's aggregate update, point - x_t. FLTrust's server
update g_0 reaches the rule the same way, in ``ServerState.extra[ROOT_UPDATE_KEY]``, put
there for the round's server step by the runtime (:mod:`fedloom.runtime.root_update`).
An algorithm whose server step is not an average (SCAFFOLD's control variates aside,
FedNova's normalized mean, RELA's per-client mixtures, clustering) has no ``rule`` and
refuses a robust one by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeGuard

import torch

from fedloom.algorithms import aggregators
from fedloom.algorithms.aggregators import RuleName

#: the hyperparameter of each rule that has one, and the rules it belongs to
_OWNERS = {
    "beta": ("trimmed_mean",),
    "num_malicious_nodes": ("krum", "multikrum", "bulyan"),
    "num_nodes_to_select": ("multikrum",),
    "max_norm": ("norm_bounding",),
    "clip_radius": ("centered_clipping",),
    "clip_iterations": ("centered_clipping",),
    "root_examples": ("fltrust",),
}
#: the ``ServerState.extra`` entry of a stateful rule: centered clipping's last aggregate
#: update, as float32 ``Params`` over the aggregated names
STATE_KEY = "aggregation_update"
#: the ``ServerState.extra`` entry FLTrust reads during the round's server step: g_0, the
#: server's update on its root set, as float32 ``Params`` over the aggregated names
ROOT_UPDATE_KEY = "fltrust_root_update"


@dataclass(frozen=True)
class AggregationRule:
    """One rule and its hyperparameters (None: Flower's defaults, see :mod:`aggregators`).
    Errors name the ``aggregation.*`` key."""

    name: RuleName = "mean"
    #: trimmed_mean: fraction cut at each end (None: Flower's 0.2)
    beta: float | None = None
    #: krum / multikrum: f, the number of Byzantine clients tolerated (None: 0)
    num_malicious_nodes: int | None = None
    #: multikrum: m, how many lowest-score clients are averaged (None: 1)
    num_nodes_to_select: int | None = None
    #: norm_bounding: M, the L2 norm each update is clipped to (None: the round's median)
    max_norm: float | None = None
    #: centered_clipping: tau, the clipping radius around v (None: the round's median)
    clip_radius: float | None = None
    #: centered_clipping: L, clipping iterations per aggregation (None: 1)
    clip_iterations: int | None = None
    #: fltrust: |D0|, the examples of the server's root set (None: 100; the data side
    #: carves it, :attr:`fedloom.config.AggregationConfig.root_size`)
    root_examples: int | None = None

    def __post_init__(self) -> None:
        if self.name not in aggregators.AGGREGATORS:
            raise ValueError(
                f"aggregation.rule: must be one of "
                f"{', '.join(aggregators.AGGREGATORS)} (got {self.name!r})"
            )
        for key, owners in _OWNERS.items():
            if getattr(self, key) is not None and self.name not in owners:
                raise ValueError(
                    f"aggregation.{key}: only with rule = "
                    f"{' or '.join(map(repr, owners))} (the rule is {self.name!r})"
                )
        if self.beta is not None and not 0.0 <= self.beta < 0.5:
            raise ValueError(f"aggregation.beta: must be in [0, 0.5) (got {self.beta})")
        if self.num_malicious_nodes is not None and self.num_malicious_nodes < 0:
            raise ValueError("aggregation.num_malicious_nodes: must be >= 0")
        if self.num_nodes_to_select is not None and self.num_nodes_to_select < 1:
            raise ValueError("aggregation.num_nodes_to_select: must be >= 1")
        for key in ("max_norm", "clip_radius"):
            value = getattr(self, key)
            if value is not None and not 0.0 < value < float("inf"):
                raise ValueError(f"aggregation.{key}: must be > 0 and finite (got {value})")
        if self.clip_iterations is not None and self.clip_iterations < 1:
            raise ValueError(
                f"aggregation.clip_iterations: must be >= 1 (got {self.clip_iterations})"
            )
        if self.root_examples is not None and self.root_examples < 1:
            raise ValueError(f"aggregation.root_examples: must be >= 1 (got {self.root_examples})")

    @property
    def is_a_mean(self) -> bool:
        """Whether the rule is the weighted mean, a function of the updates' sum; every
        other rule needs each client's update."""
        return self.name == "mean"

    @property
    def weighted(self) -> bool:
        """Whether the clients' aggregation weights enter the rule (median and the trimmed
        mean, Bulyan, centered clipping and FLTrust are unweighted)."""
        return self.name not in (
            "median",
            "trimmed_mean",
            "bulyan",
            "centered_clipping",
            "fltrust",
        )

    @property
    def needs_reference(self) -> bool:
        """Whether the rule acts on updates, so needs the clients' starting point x_t."""
        return self.name in aggregators.ON_UPDATES

    @property
    def stateful(self) -> bool:
        """Whether the rule carries state across rounds (in ``ServerState.extra``)."""
        return self.name == "centered_clipping"

    @property
    def needs_root_update(self) -> bool:
        """Whether the rule reads the server's update on its root set (FLTrust's g_0)."""
        return self.name == "fltrust"

    def check_federation(self, clients_per_round: int) -> None:
        """Reject a setting that ``clients_per_round`` sampled clients cannot satisfy (or
        that silently degenerates): a trimmed mean that trims floor(beta n) = 0 clients is
        the plain mean; Krum tolerates f Byzantine clients among n only when n > 2f + 2
        (Blanchard et al. 2017; below it a client's n - f - 2 nearest neighbours do not
        exist and the rule picks arbitrarily), Multi-Krum cannot select m > n clients, and
        Bulyan needs n >= 4f + 3 (El Mhamdi et al. 2018: theta = n - 2f Krum picks, then
        beta = theta - 2f >= 3 values per coordinate). The rules see only the sampled
        clients."""
        n = clients_per_round
        if self.name == "trimmed_mean":
            beta = aggregators.DEFAULT_BETA if self.beta is None else self.beta
            if beta > 0 and int(beta * n) == 0:
                raise ValueError(
                    f"aggregation.beta: {beta} of the {n} clients sampled per round trims "
                    f"floor({beta} x {n}) = 0 from each end, so trimmed_mean would be the plain "
                    f"mean; use beta >= {1 / n:.3g} or sample more clients (beta = 0 asks for "
                    f"the plain mean explicitly)"
                )
        if self.name not in ("krum", "multikrum", "bulyan"):
            return
        f = (
            aggregators.DEFAULT_MALICIOUS
            if self.num_malicious_nodes is None
            else self.num_malicious_nodes
        )
        if self.name == "bulyan" and n < 4 * f + 3:
            raise ValueError(
                f"aggregation.num_malicious_nodes: Bulyan needs at least 4f + 3 = {4 * f + 3} "
                f"clients per round for f = {f}, the federation samples {n} "
                f"(partition.num_clients, federation.fraction and federation.min_clients set it)"
            )
        if n <= 2 * f + 2:
            raise ValueError(
                f"aggregation.num_malicious_nodes: Krum needs more than 2f + 2 = {2 * f + 2} "
                f"clients per round for f = {f}, the federation samples {n} "
                f"(partition.num_clients, federation.fraction and federation.min_clients set it)"
            )
        m = (
            aggregators.DEFAULT_SELECT
            if self.num_nodes_to_select is None
            else self.num_nodes_to_select
        )
        if self.name == "multikrum" and m > n:
            raise ValueError(
                f"aggregation.num_nodes_to_select: {m} is more than the {n} "
                f"clients sampled per round"
            )

    def combine(
        self,
        matrix: torch.Tensor,
        weights: torch.Tensor,
        reference: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        root_update: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The rule applied to the K x P ``matrix`` with the clients' ``weights`` (K,):
        the P-vector point. ``reference`` is x_t, the point the clients started from
        (needed when :attr:`needs_reference`); ``state`` a :attr:`stateful` rule's state
        (the previous aggregate update; None in the first round). The next state is
        point - ``reference``. ``root_update`` is g_0 (needed when
        :attr:`needs_root_update`)."""
        return aggregators.combine(
            self.name,
            matrix,
            weights,
            self.beta,
            self.num_malicious_nodes,
            self.num_nodes_to_select,
            reference=reference,
            state=state,
            max_norm=self.max_norm,
            clip_radius=self.clip_radius,
            clip_iterations=self.clip_iterations,
            root_update=root_update,
        )


#: the weighted mean every averaging algorithm starts with
MEAN = AggregationRule()


class Averaging(Protocol):
    """An algorithm (a dataclass) that combines its clients with a rule."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    rule: AggregationRule


def averages(algorithm: Any) -> TypeGuard[Averaging]:
    """Whether ``algorithm`` (an instance or class) takes an aggregation rule."""
    return any(f.name == "rule" for f in dataclasses.fields(algorithm))


def with_rule(algorithm: Any, rule: AggregationRule) -> Any:
    """``algorithm`` combining its clients with ``rule``; a method that does not average
    refuses any rule but the mean."""
    if not averages(algorithm):
        if rule == MEAN:
            return algorithm
        raise ValueError(
            f"aggregation.rule: {algorithm.name} does not average the clients' "
            f"updates, so it takes no aggregation rule (got {rule.name!r})"
        )
    return dataclasses.replace(algorithm, rule=rule)

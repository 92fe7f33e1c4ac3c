"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data").

Server step:  theta_{t+1} = sum_k w_k theta_k / sum_k w_k  over the sampled clients, with

* ``examples`` (default): w_k = n_k, the client's number of training examples;
* ``uniform``:            w_k = 1;
* ``capped``:             w_k = min(n_k, cap), cap defaulting to the median n_k of the
  round, so that no single large client dominates (a common fairness variant).

``rule`` (``[aggregation]``, :mod:`fedloom.algorithms.aggregation_rule`) swaps the
weighted mean for a robust rule (``median``, ``trimmed_mean``, ``krum``, ``multikrum``,
``bulyan``, ``norm_bounding``, ``centered_clipping``, ``fltrust``). Every algorithm built
on FedAvg (FedAvgM, FedAdagrad, FedAdam, FedYogi, FedProx, SCAFFOLD's model step, Ditto's
and the partial methods' shared part, ...) takes its aggregation step from
:meth:`FedAvg.combine_flat`, so the robust rules compose with them; the rule's state (if
any) comes back as ``ServerState.extra`` entries the algorithm keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from fedloom.algorithms.aggregation_rule import (
    MEAN,
    ROOT_UPDATE_KEY,
    STATE_KEY,
    AggregationRule,
)
from fedloom.algorithms.base import Algorithm, ClientResult, ServerState
from fedloom.algorithms.registry import register
from fedloom.params import (
    Params,
    aggregation_weight_vector,
    flatten,
    stack,
    unflatten,
    weighted_mean_flat,
)


def aggregation_weights(
    counts: Sequence[int], weighting: str = "examples", cap: float | None = None
) -> list[float]:
    if weighting == "examples":
        return [float(n) for n in counts]
    if weighting == "uniform":
        return [1.0] * len(counts)
    if weighting != "capped":
        raise ValueError(f"algorithm.weighting: unknown weighting {weighting!r}")
    limit = float(np.median(counts)) if cap is None else cap
    return [min(float(n), limit) for n in counts]


def check_weighting(weighting: str, allowed: tuple[str, ...] = ("examples", "uniform")) -> None:
    """Refuse a ``weighting`` hyperparameter outside ``allowed``."""
    if weighting not in allowed:
        raise ValueError(f"algorithm.weighting: must be {' or '.join(allowed)} (got {weighting!r})")


@register("fedavg")
@dataclass(frozen=True)
class FedAvg(Algorithm):
    per_example_client_step: ClassVar[bool] = True
    not_a_mean: ClassVar[str | None] = None
    weighting: Literal["examples", "uniform", "capped"] = "examples"
    cap: float | None = None
    #: how the clients are combined: ``[aggregation]`` sets it (not an ``[algorithm]`` key)
    rule: AggregationRule = field(default=MEAN, metadata={"section": "aggregation"})

    def __post_init__(self) -> None:
        if self.weighting not in ("examples", "uniform", "capped"):
            raise ValueError(
                f"algorithm.weighting: must be examples, uniform or capped (got {self.weighting!r})"
            )
        if self.cap is not None and (self.weighting != "capped" or self.cap <= 0):
            raise ValueError("algorithm.cap: only with weighting = 'capped', and must be > 0")
        if not self.rule.weighted and self.weighting != "examples":
            raise ValueError(
                f"algorithm.weighting: aggregation rule {self.rule.name} is unweighted"
            )

    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        """The aggregation rule's checks (:meth:`AggregationRule.check_federation`)."""
        self.rule.check_federation(clients_per_round)

    def combine_flat(
        self, state: ServerState, results: Sequence[ClientResult], names: Sequence[str]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The aggregation step as a float64 vector over ``names`` (the weighted mean
        streamed block by block, :func:`fedloom.params.weighted_mean_flat`; a robust rule on
        the K x P matrix), and the ``ServerState.extra`` entries the rule keeps ({} for a
        stateless rule). The rule's reference point x_t is ``state.global_params`` over
        ``names``: what the clients started from; FLTrust's g_0 is
        ``state.extra[ROOT_UPDATE_KEY]`` over ``names``."""
        if not results:
            raise ValueError("aggregate of no clients")
        weights = aggregation_weights([r.num_examples for r in results], self.weighting, self.cap)
        w = aggregation_weight_vector(weights)
        if self.rule.name == "mean":
            return weighted_mean_flat([r.params for r in results], names, w), {}
        matrix = stack([r.params for r in results], names).double()
        if not self.rule.needs_reference:
            return self.rule.combine(matrix, w), {}
        reference = flatten(state.global_params, names).double()
        previous = state.extra.get(STATE_KEY) if self.rule.stateful else None
        carried = None if previous is None else flatten(previous, names).double()
        root = state.extra.get(ROOT_UPDATE_KEY) if self.rule.needs_root_update else None
        g0 = None if root is None else flatten(root, names).double()
        point = self.rule.combine(matrix, w, reference, carried, g0)
        if not self.rule.stateful:
            return point, {}
        update = unflatten(point - reference, results[0].params, names, torch.float32)
        return point, {STATE_KEY: update}

    def combine(
        self, state: ServerState, results: Sequence[ClientResult]
    ) -> tuple[Params, dict[str, Any]]:
        """The aggregation step as ``Params`` (:meth:`combine_flat`), and the rule's extra
        state entries."""
        if not results:
            raise ValueError("aggregate of no clients")
        names = sorted(results[0].params)
        point, extra = self.combine_flat(state, results, names)
        return unflatten(point, results[0].params, names), extra

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        params, extra = self.combine(state, results)
        return self.next_state(state, global_params=params, extra={**state.extra, **extra})

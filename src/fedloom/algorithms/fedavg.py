"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data").

Server step:  theta_{t+1} = sum_k w_k theta_k / sum_k w_k  over the sampled clients, with

* ``examples`` (default): w_k = n_k, the client's number of training examples;
* ``uniform``:            w_k = 1;
* ``capped``:             w_k = min(n_k, cap), cap defaulting to the median n_k of the
  round, so that no single large client dominates (a common fairness variant).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedloom.algorithms.base import Algorithm, ClientResult, ServerState
from fedloom.algorithms.registry import register
from fedloom.params import weighted_average


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


@register("fedavg")
@dataclass(frozen=True)
class FedAvg(Algorithm):
    weighting: Literal["examples", "uniform", "capped"] = "examples"
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.weighting not in ("examples", "uniform", "capped"):
            raise ValueError(
                f"algorithm.weighting: must be examples, uniform or capped (got {self.weighting!r})"
            )
        if self.cap is not None and (self.weighting != "capped" or self.cap <= 0):
            raise ValueError("algorithm.cap: only with weighting = 'capped', and must be > 0")

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        weights = aggregation_weights([r.num_examples for r in results], self.weighting, self.cap)
        mean = weighted_average([r.params for r in results], weights)
        return self.next_state(state, global_params=mean)

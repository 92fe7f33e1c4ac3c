"""Byzantine-robust aggregation as algorithms: FedAvg whose aggregation step is a robust
rule of :mod:`fedloom.algorithms.aggregators` (the rules are written out there).

* ``median``        coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed
                    Learning: Towards Optimal Statistical Rates");      Flower's FedMedian
* ``trimmed_mean``  coordinate-wise beta-trimmed mean, ``beta`` = 0.2 (Yin et al. 2018);
                                                                    Flower's FedTrimmedAvg
* ``krum``          Krum with ``num_malicious_nodes`` = f = 0 (Blanchard et al. 2017,
                    "Machine Learning with Adversaries: Byzantine Tolerant Gradient
                    Descent");                                               Flower's Krum
* ``multikrum``     Multi-Krum, f = 0 and ``num_nodes_to_select`` = m = 1, selected clients
                    averaged by examples as in Flower (``weighting = "uniform"`` for the
                    paper's plain mean);                                Flower's MultiKrum

The same rules plug into any FedAvg-family algorithm through its ``aggregator``
hyperparameter, e.g. ``algorithms.create("fedadam", aggregator="median")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register

Rule = Literal["mean", "median", "trimmed_mean", "krum", "multikrum"]


@register("median")
@dataclass(frozen=True)
class FedMedian(FedAvg):
    aggregator: Rule = "median"


@register("trimmed_mean")
@dataclass(frozen=True)
class FedTrimmedAvg(FedAvg):
    aggregator: Rule = "trimmed_mean"
    beta: float | None = 0.2


@register("krum")
@dataclass(frozen=True)
class Krum(FedAvg):
    aggregator: Rule = "krum"
    num_malicious_nodes: int | None = 0


@register("multikrum")
@dataclass(frozen=True)
class MultiKrum(FedAvg):
    aggregator: Rule = "multikrum"
    num_malicious_nodes: int | None = 0
    num_nodes_to_select: int | None = 1

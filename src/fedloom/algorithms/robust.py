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
* ``bulyan``        Bulyan over iterated Krum, f = 0 (El Mhamdi, Guerraoui, Rouault 2018,
                    "The Hidden Vulnerability of Distributed Learning in Byzantium"); needs
                    4f + 3 clients per round;          Flower's aggregate_bulyan with Krum
* ``norm_bounding`` the weighted mean of the updates clipped to L2 norm ``max_norm``
                    (default: the round's median update norm) (Sun et al. 2019, "Can You
                    Really Backdoor Federated Learning?")
* ``centered_clipping``  v += mean_k clip(update_k - v, ``clip_radius``), ``clip_iterations``
                    = 1 times from the previous round's aggregate update (Karimireddy, He,
                    Jaggi 2021, "Learning from History for Byzantine Robust Optimization")

Each name is FedAvg with that ``rule`` (:mod:`fedloom.algorithms.aggregation_rule`);
``[aggregation]`` sets the rule's hyperparameters (``beta``, ``num_malicious_nodes``,
``num_nodes_to_select``, ``max_norm``, ``clip_radius``, ``clip_iterations``) and plugs the same rules into any averaging algorithm, e.g.
``algorithm.name = "fedadam"`` with ``aggregation.rule = "median"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedloom.algorithms.aggregation_rule import AggregationRule, RuleName
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import register


def _rule(name: RuleName) -> AggregationRule:
    return field(default=AggregationRule(name), metadata={"section": "aggregation"})


@register("median")
@dataclass(frozen=True)
class FedMedian(FedAvg):
    rule: AggregationRule = _rule("median")


@register("trimmed_mean")
@dataclass(frozen=True)
class FedTrimmedAvg(FedAvg):
    rule: AggregationRule = _rule("trimmed_mean")


@register("krum")
@dataclass(frozen=True)
class Krum(FedAvg):
    rule: AggregationRule = _rule("krum")


@register("multikrum")
@dataclass(frozen=True)
class MultiKrum(FedAvg):
    rule: AggregationRule = _rule("multikrum")


@register("bulyan")
@dataclass(frozen=True)
class Bulyan(FedAvg):
    rule: AggregationRule = _rule("bulyan")


@register("norm_bounding")
@dataclass(frozen=True)
class NormBounding(FedAvg):
    rule: AggregationRule = _rule("norm_bounding")


@register("centered_clipping")
@dataclass(frozen=True)
class CenteredClipping(FedAvg):
    rule: AggregationRule = _rule("centered_clipping")

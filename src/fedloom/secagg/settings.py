"""``[secagg]`` in an experiment: the mask stage it adds to the chain, and the settings it
cannot run with (each refused by the key that asks for it, before any data is read; the
bits against the clients' weights once the data is partitioned, before the first round).
What the mask stage composes with (the algorithm, the rule, the other stages, an attack,
simulated garbage) is :func:`fedloom.composition.check_composition`'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from fedloom import homomorphic
from fedloom.homomorphic import HomomorphicConfig
from fedloom.secagg.messages import SecAggConfig, setup_round
from fedloom.secagg.quantize import bits_left, bits_needed
from fedloom.transforms.base import Transform
from fedloom.transforms.secure_sum import SecureSum, quant_bits_for_weight

if TYPE_CHECKING:
    from fedloom.algorithms import Algorithm
    from fedloom.config import ExperimentConfig


#: the fewest bits per value a round's quantization may be left with when b_q is derived
#: from the bits (``secagg.quant_bits`` unset): 255 steps over [−c, c]. Fewer quantize an
#: update more coarsely than it moves: ``secagg.bits = 8`` once left one bit per value for
#: a round's weight, every coordinate rounded to ±c, and doubled a run's dev loss (1.67
#: against 0.82)
MIN_QUANT_BITS = 8


def on(cfg: ExperimentConfig) -> bool:
    return cfg.secagg.protocol != "none"


def transforms(cfg: ExperimentConfig, weighting: str) -> list[Transform]:
    """The chain's mask stage for ``cfg`` (none when secure aggregation is off), weighting
    the clients as the algorithm's ``weighting`` does (uniformly under DP-FedAvg)."""
    return [_secure_sum(cfg, weighting)] if on(cfg) else []


def _secure_sum(cfg: ExperimentConfig, weighting: str) -> SecureSum:
    summed: Literal["examples", "uniform"] = (
        "uniform" if cfg.privacy.level == "client" or weighting == "uniform" else "examples"
    )
    return SecureSum(config(cfg), weighting=summed, seed=cfg.seed)


def config(cfg: ExperimentConfig) -> SecAggConfig | HomomorphicConfig:
    """The protocol's settings of ``[secagg]``."""
    s = cfg.secagg
    protocol = HomomorphicConfig if s.protocol in homomorphic.PROTOCOLS else SecAggConfig
    # the protocol's own settings are the section's keys of the same names
    return protocol(**{f.name: getattr(s, f.name) for f in dataclasses.fields(protocol)})


def check(cfg: ExperimentConfig, algorithm: Algorithm) -> None:
    """A ``ValueError`` naming the key of a setting secure aggregation cannot run with:
    weights that depend on the round's other clients, mixed backbones or ranks, or a
    ``[secagg]`` setting the round's clients cannot satisfy."""
    if not on(cfg):
        return
    weighting = getattr(algorithm, "weighting", "examples")
    if weighting not in ("examples", "uniform"):
        raise ValueError(
            f"algorithm.weighting: {weighting!r} weights depend on the round's other clients; "
            f"secure aggregation sums weights each client knows (examples or uniform)"
        )
    if cfg.model.groups or cfg.model.ranks:
        key = "model.groups" if cfg.model.groups else "model.ranks"
        raise ValueError(
            f"{key}: secure aggregation sums updates of one shape; clients with different "
            f"backbones or ranks send different ones"
        )
    m = cfg.clients_per_round
    s = cfg.secagg
    # a client weighs at least 1, so m clients weigh at least m (under uniform weighting,
    # exactly m); their examples are checked once the partition is known (check_weights)
    check_round_weight(cfg, m, f"the lightest round ({m} clients, each weighing at least 1)")
    # the settings checked on a round of every sampled client (the bits, t against the
    # holders of a client's shares, k; the sum's bound for a homomorphic scheme); a round
    # with fewer is checked when it runs
    protocol = config(cfg)
    if isinstance(protocol, HomomorphicConfig):
        for key in ("threshold", "neighbours"):
            if getattr(s, key) is not None:
                raise ValueError(
                    f"secagg.{key}: SecAgg's setting (the holders of a client's shares); "
                    f"{s.protocol} has no shares"
                )
        homomorphic.setup_round(protocol, list(range(m)), 0, 1)
        return
    if s.key_bits is not None:
        raise ValueError(f"secagg.key_bits: Paillier's modulus, not a setting of {s.protocol}")
    setup_round(protocol, list(range(m)), 0, 1, graph_seed=bytes(32))


def check_weights(cfg: ExperimentConfig, algorithm: Algorithm, examples: Sequence[int]) -> None:
    """``[secagg]``'s bits against the heaviest round the partition allows, once it is known
    (before the first round): the ``clients_per_round`` largest weights of clients with
    ``examples`` training examples (a drifting client's most), each its examples or 1 as
    the algorithm weights them; a ``ValueError`` naming ``secagg.bits`` (the sum could
    wrap, or it leaves fewer than :data:`MIN_QUANT_BITS` bits per value)."""
    if not on(cfg):
        return
    secure = _secure_sum(cfg, getattr(algorithm, "weighting", "examples"))
    if secure.weighting == "uniform":  # every round weighs m: checked by check
        return
    m = cfg.clients_per_round
    weight = sum(sorted((secure.weight(n) for n in examples), reverse=True)[:m])
    check_round_weight(
        cfg,
        weight,
        f"the heaviest round the partition allows ({m} clients of {weight} training "
        f"examples in all, each weighing its examples)",
    )


def check_round_weight(cfg: ExperimentConfig, weight: int, round_: str) -> None:
    """``[secagg]``'s bits against ``round_``, whose clients weigh ``weight`` in all: the
    weighted sum must not wrap, and a derived b_q must keep :data:`MIN_QUANT_BITS` bits."""
    s = cfg.secagg
    if s.quant_bits is not None:
        quant_bits_for_weight(weight, s.bits, s.quant_bits, round_)
        return
    left = bits_left(weight, s.bits)
    if left < MIN_QUANT_BITS:
        raise ValueError(
            f"secagg.bits: {s.bits} leaves {_per_value(left)} for {round_}; at least "
            f"{MIN_QUANT_BITS} are needed: raise secagg.bits to "
            f"{bits_needed(weight, MIN_QUANT_BITS)} or more, or set secagg.quant_bits to "
            f"quantize coarser on purpose"
        )


def _per_value(quant_bits: int) -> str:
    if quant_bits == 0:
        return "no bit per value (the weighted sum wraps even at one)"
    steps = (1 << quant_bits) - 1
    return f"{quant_bits} bit{'s' * (quant_bits > 1)} per value ({steps} steps over [-c, c])"

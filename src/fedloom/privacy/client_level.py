"""Client-level DP-FedAvg in a run: ``[privacy] level = "client"`` resolved into the
transform chain's clip and noise stages (:mod:`fedloom.transforms.dp_fedavg`,
:mod:`fedloom.transforms.client_noise`), the algorithms it covers, and the ledger that
accounts every round the server released.

Covered: every algorithm that takes its server step from a mean of the clients' shared
tensors (FedAvg and the algorithms built on :meth:`FedAvg.combine`: FedAvgM, FedAdagrad /
FedAdam / FedYogi, FedProx, FedSGD, FFA-LoRA, FedIT, and the global part of Ditto,
FedAvg-FT, APFL, Per-FedAvg, L2GD and the partial-sharing methods), made a uniform mean:
weighting a client by its examples would scale its sensitivity by its weight. What the
client keeps (a personal adapter, a head, optimizer moments) never travels, so it is not
released and needs no noise: the guarantee covers everything the server (and anyone who
sees the global adapter) learns, and a client's personal adapter is as private as that
client's own copy of its data. Refused: methods whose server step is not that mean
(per-client mixtures such as FedMosaic's RELA, clustering, server-kept per-client state,
normalized or control-variate steps: each says so in its ``not_a_mean``, which
:func:`fedloom.composition.check_composition` reads), because DP-FedAvg's accounting says
nothing about them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from fedloom.algorithms import Algorithm
from fedloom.config import ExperimentConfig, PrivacyConfig
from fedloom.privacy import accountant
from fedloom.privacy.accountant import AccountantName, Release
from fedloom.privacy.ledger import RoundRelease
from fedloom.transforms.base import Transform
from fedloom.transforms.client_noise import ClientNoise
from fedloom.transforms.dp_fedavg import DPFedAvg, update_multiplier

log = logging.getLogger("fedloom")

#: the ε above which a guarantee says little (a run beyond it is warned about)
LOOSE_EPSILON = 10.0


def on(cfg: ExperimentConfig) -> bool:
    return cfg.privacy.level == "client"


def delta(cfg: ExperimentConfig) -> float:
    """δ: ``privacy.delta``, or 1 / K^1.1 for the K clients."""
    p = cfg.privacy
    return accountant.default_delta(cfg.partition.num_clients) if p.delta is None else p.delta


def sampling(cfg: ExperimentConfig) -> Release:
    """One round's release as configured, with multiplier 1: ``clients_per_round`` of the
    K clients sampled without replacement (every client when that is all of them)."""
    k, m = cfg.partition.num_clients, cfg.clients_per_round
    return accountant.release(1.0, m / k, 1, "without_replacement" if m < k else "none", k)


def accountant_name(cfg: ExperimentConfig) -> AccountantName:
    """``privacy.accountant``, or PLD where it applies and RDP where it does not."""
    if cfg.privacy.accountant is not None:
        return cfg.privacy.accountant
    return "rdp" if accountant.unusable("pld", [sampling(cfg)]) else "pld"


def noise_multiplier(cfg: ExperimentConfig) -> float:
    """z: ``privacy.noise_multiplier``, the one ``privacy.target_epsilon`` needs over the
    run's rounds (:func:`fedloom.privacy.accountant.noise_for_epsilon`), or 1."""
    p = cfg.privacy
    if p.target_epsilon is None:
        return 1.0 if p.noise_multiplier is None else p.noise_multiplier
    one = sampling(cfg)
    return _calibrated(
        p.target_epsilon,
        one.rate,
        cfg.federation.rounds,
        delta(cfg),
        one.sampling,
        accountant_name(cfg),
        one.population,
    )


@functools.lru_cache(maxsize=16)
def _calibrated(*args: Any) -> float:
    # every process of a run (the server, each Ray actor, each Flower node) asks once
    return accountant.noise_for_epsilon(*args)


@functools.lru_cache(maxsize=16)
def _run_epsilon(*args: Any) -> float:
    return accountant.epsilon(*args)


def check_epsilon(cfg: ExperimentConfig, z: float) -> None:
    """A ``ValueError`` naming the key when noise multiplier ``z`` gives the whole run an
    ε of 0 at δ: δ alone would be the guarantee, and (ε = 0, δ)-DP allows a mechanism that
    releases a client's data outright with probability δ, which near 1/K says nothing."""
    one, p = sampling(cfg), cfg.privacy
    rounds, d, name = cfg.federation.rounds, delta(cfg), accountant_name(cfg)
    if _run_epsilon(z, one.rate, rounds, d, one.sampling, name, one.population) > 0:
        return
    k = cfg.partition.num_clients
    what = f"delta = {d:.3g}" + ("" if p.delta is not None else f" (1/K^1.1 for K = {k} clients)")
    fix = f"set privacy.delta far below 1/K = {1 / k:.3g} (e.g. 1e-5)"
    if p.target_epsilon is not None:
        raise ValueError(
            f"privacy.target_epsilon: {p.target_epsilon:g} is reached only as epsilon = 0 at "
            f"{what}, where delta alone is the guarantee; ask for a larger target, or {fix}"
        )
    raise ValueError(
        f"privacy.delta: at {what}, noise_multiplier {z:g} gives the run epsilon = 0, so "
        f"delta alone is the guarantee; {fix}"
    )


def check(cfg: ExperimentConfig) -> None:
    """A ``ValueError`` naming the key of a setting DP-FedAvg cannot run with: an explicit
    weighting, δ ≥ 1/K, an accountant that cannot account the sampling, a target ε out of
    reach, an ε of 0 (δ alone the guarantee), adaptive clipping without count noise enough
    for z. What its stages compose with (the algorithm, the aggregation rule, the other
    stages) is :func:`fedloom.composition.check_composition`'s."""
    p = cfg.privacy
    weighting = cfg.algorithm.hyperparameters.get("weighting")
    if weighting not in (None, "uniform"):
        raise ValueError(
            f"algorithm.weighting: DP-FedAvg averages uniformly (a weight of n_k scales a "
            f"client's sensitivity by n_k); leave it unset or 'uniform' (got {weighting!r})"
        )
    k = cfg.partition.num_clients
    if p.delta is not None and p.delta >= 1 / k:
        raise ValueError(
            f"privacy.delta: {p.delta:g} is not below 1/K = {1 / k:.3g} for the K = {k} "
            f"clients (at delta >= 1/K releasing one client's data outright satisfies it)"
        )
    unusable = p.accountant and accountant.unusable(p.accountant, [sampling(cfg)])
    if unusable:
        raise ValueError(f"privacy.accountant: {unusable}")
    try:
        z = noise_multiplier(cfg)
    except ValueError as err:
        raise ValueError(f"privacy.{err}") from None
    check_epsilon(cfg, z)
    if p.adaptive_quantile is not None:
        try:
            update_multiplier(z, _clip(cfg, z).count_std)
        except ValueError as err:
            raise ValueError(f"privacy.{err}") from None
    import dp_accounting  # noqa: F401  (loaded with the run's start, not in its first round)


def uniform(algorithm: Algorithm) -> Algorithm:
    """``algorithm`` as DP-FedAvg runs it: a uniform mean (a weight of n_k would scale a
    client's sensitivity by n_k)."""
    return dataclasses.replace(cast(Any, algorithm), weighting="uniform")


def _clip(cfg: ExperimentConfig, z: float) -> DPFedAvg:
    p: PrivacyConfig = cfg.privacy
    return DPFedAvg(
        noise_multiplier=z,
        clip_norm=p.clip_norm,
        clients_per_round=cfg.clients_per_round,
        noise=p.noise,
        adaptive_quantile=p.adaptive_quantile,
        adaptive_lr=p.adaptive_lr,
        count_noise=p.count_noise,
        seed=cfg.seed,
        secure_noise=p.secure_noise,
    )


def transforms(cfg: ExperimentConfig) -> list[Transform]:
    """The chain's privacy stages for ``cfg`` (none when privacy is off)."""
    if not on(cfg):
        return []
    z = noise_multiplier(cfg)
    clip = _clip(cfg, z)
    if cfg.privacy.noise == "server":
        return [clip]
    noise = ClientNoise(
        std=z * cfg.privacy.clip_norm,
        clients_per_round=cfg.clients_per_round,
        seed=cfg.seed,
        secure_noise=cfg.privacy.secure_noise,
    )
    return [clip, noise]


def loose(cfg: ExperimentConfig, privacy: Mapping[str, Any]) -> str:
    """One line on a guarantee weaker than :data:`LOOSE_EPSILON`, naming its cause."""
    eps, z = privacy["epsilon"], privacy["noise_multiplier"]
    k, m, rounds = cfg.partition.num_clients, cfg.clients_per_round, privacy["rounds_released"]
    cause = (
        f"noise multiplier {z:g} is small"
        if z < 0.8
        else f"{rounds} rounds compose and {m} of {k} clients a round amplify little"
    )
    return (
        f"epsilon {eps:.3g} at delta {privacy['delta']:.3g} exceeds {LOOSE_EPSILON:g}, which "
        f"promises little: {cause}; raise privacy.noise_multiplier, sample fewer clients of "
        f"more (federation.fraction), or run fewer rounds"
    )


@dataclass
class Ledger:
    """The rounds the server released, for the accountant; a checkpoint keeps it."""

    cfg: ExperimentConfig
    releases: list[Release] = field(default_factory=list)

    def announce(self, log: logging.Logger) -> None:
        """The noise the run will add, before the first round (and how it was chosen)."""
        p = self.cfg.privacy
        chosen = (
            f" (chosen for target epsilon {p.target_epsilon:g} over "
            f"{self.cfg.federation.rounds} rounds)"
            if p.target_epsilon is not None
            else ""
        )
        log.info(
            "privacy: DP-FedAvg, noise multiplier %.4g%s, clip norm %g%s, %s noise, delta "
            "%.3g, %s accountant",
            noise_multiplier(self.cfg),
            chosen,
            p.clip_norm,
            " (adaptive)" if p.adaptive_quantile is not None else "",
            p.noise,
            delta(self.cfg),
            accountant_name(self.cfg),
        )

    def record(self, round_: RoundRelease) -> dict[str, Any]:
        """Account a released round: the Gaussian mechanism of the chain's DP stage (its
        measured ``noise_multiplier``) on the ``sampled`` clients; nothing when no stage
        released (no update reached the clip stage)."""
        if not round_.events:
            return {}
        (measurements,) = round_.events.values()
        k = self.cfg.partition.num_clients
        z = float(measurements["noise_multiplier"])
        m = len(round_.sampled)
        self.releases.append(
            accountant.release(z, m / k, 1, "without_replacement" if m < k else "none", k)
        )
        return {"epsilon": self.epsilon(), "delta": delta(self.cfg), "privacy": dict(measurements)}

    def unreleased_row(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon(), "delta": delta(self.cfg)}

    def warning(self, summary: Mapping[str, Any]) -> str | None:
        return loose(self.cfg, summary) if summary["epsilon"] > LOOSE_EPSILON else None

    def epsilon(self) -> float:
        return accountant.epsilon_of(self.releases, delta(self.cfg), accountant_name(self.cfg))

    def summary(self) -> dict[str, Any]:
        p = self.cfg.privacy
        return {
            "level": p.level,
            "epsilon": self.epsilon(),
            "delta": delta(self.cfg),
            "noise_multiplier": noise_multiplier(self.cfg),
            "clip_norm": p.clip_norm,
            "noise": p.noise,
            "adaptive_quantile": p.adaptive_quantile,
            "accountant": accountant_name(self.cfg),
            "neighbours": accountant.relation(self.releases or [sampling(self.cfg)]),
            "rounds_released": sum(r.count for r in self.releases),
        }

    def to_json(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(r) for r in self.releases]

    @classmethod
    def from_json(cls, cfg: ExperimentConfig, rows: Sequence[Mapping[str, Any]]) -> Ledger:
        return cls(cfg, [Release(**row) for row in rows])

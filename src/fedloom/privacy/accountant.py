"""The privacy accountant: ε of a run's Gaussian releases at a given δ, and the noise
multiplier z that reaches a target ε.

Google's ``dp-accounting`` does the accounting (privacy loss distributions, PLD, tight;
Rényi DP, RDP, with the improved conversion of Canonne, Kamath & Steinke 2020); fedloom
only says which events happened. A round of client-level DP-FedAvg (McMahan et al. 2018)
is one Gaussian mechanism with noise multiplier z = σ / C on the sum of clipped updates,
applied to the round's sample of the K clients:

* ``"poisson"``: each client joins with probability q, independently (add-or-remove-one
  neighbours; PLD or RDP);
* ``"without_replacement"``: a fixed number m = qK of the K clients, fedloom's sampling
  (``federation.fraction``). dp-accounting accounts it only with RDP and only between
  datasets that differ by one *replaced* client (Wang, Balle & Kasiviswanathan 2019, Thm.
  27); replacing a client moves the sum of clipped updates by up to 2C, so the event is a
  Gaussian of multiplier z / 2 on that relation;
* ``"none"``: every client in every round (q = 1): T Gaussians, PLD or RDP.

Rounds may differ (client-side noise loses the share of a client that dropped out), so a
run is a list of :class:`Release` and :func:`epsilon_of` composes them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # dp-accounting costs most of a second to import: only DP runs pay it
    import dp_accounting

Sampling = Literal["poisson", "without_replacement", "none"]
AccountantName = Literal["pld", "rdp"]
Relation = Literal["replace_one", "add_or_remove_one"]

#: the noise multipliers :func:`noise_for_epsilon` searches: beyond 50 the noise on the
#: mean (std 50·C/m) drowns any update a federation of realistic size sends; below 0.1 the
#: guarantee is void at any useful δ (and PLD's discretization runs out of memory)
MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER = 0.1, 50.0
#: the step down from RDP's z to a PLD bracket: PLD's z came within 10 % of RDP's on the
#: settings tried (0.959 against 1.022 for q = 0.01, 1000 rounds, ε = 2), and a PLD of a
#: small z is expensive to compute
PLD_BRACKET = 0.8


@dataclass(frozen=True)
class Release:
    """``count`` rounds alike, each a Gaussian of multiplier ``noise_multiplier`` (σ / C)
    on the sum of the clipped updates of a sample of the clients: with probability
    ``rate`` each (``"poisson"``), ``sample_size`` of the ``population`` K
    (``"without_replacement"``), or all of them (``"none"``)."""

    noise_multiplier: float
    sampling: Sampling
    rate: float = 1.0
    sample_size: int = 0
    population: int = 0
    count: int = 1

    @property
    def subsampled(self) -> bool:
        if self.sampling == "poisson":
            return self.rate < 1
        return self.sampling == "without_replacement" and self.sample_size < self.population

    def kind(self) -> Release:
        """The release without its count (rounds of one kind compose as one event)."""
        return replace(self, count=1)


def default_delta(population: int) -> float:
    """δ = 1 / K^1.1, McMahan et al. 2018's choice: below 1/K, so that releasing one
    client's data outright is not within the guarantee."""
    return float(population**-1.1)


def _event(release: Release, count: int) -> dp_accounting.DpEvent:
    import dp_accounting

    z = release.noise_multiplier
    event: dp_accounting.DpEvent
    if not release.subsampled:
        event = dp_accounting.GaussianDpEvent(z)
    elif release.sampling == "poisson":
        event = dp_accounting.PoissonSampledDpEvent(release.rate, dp_accounting.GaussianDpEvent(z))
    else:  # replace-one: the sum of clipped updates moves by up to 2C
        event = dp_accounting.SampledWithoutReplacementDpEvent(
            release.population, release.sample_size, dp_accounting.GaussianDpEvent(z / 2)
        )
    return dp_accounting.SelfComposedDpEvent(event, count)


def relation(releases: Sequence[Release]) -> Relation:
    """The neighbouring relation the guarantee holds on: replace-one when any round sampled
    a fixed number of clients out of more, else add-or-remove-one."""
    replaced = any(r.sampling == "without_replacement" and r.subsampled for r in releases)
    return "replace_one" if replaced else "add_or_remove_one"


def _fresh(accountant: AccountantName, relation_: Relation) -> dp_accounting.PrivacyAccountant:
    from dp_accounting import pld, rdp
    from dp_accounting.privacy_accountant import NeighboringRelation

    neighbours = NeighboringRelation[relation_.upper()]
    if accountant == "pld":
        return pld.PLDAccountant(neighbours)
    return rdp.RdpAccountant(neighboring_relation=neighbours)


def unusable(accountant: AccountantName, releases: Sequence[Release]) -> str | None:
    """Why ``accountant`` cannot account ``releases`` (None: it can)."""
    if accountant == "pld" and relation(releases) == "replace_one":
        return (
            "PLD accounting (dp-accounting) has no sampling without replacement, which is "
            "how fedloom samples a fixed number of clients per round; use accountant = "
            "'rdp' (or federation.fraction = 1)"
        )
    return None


def epsilon_of(
    releases: Sequence[Release], delta: float, accountant: AccountantName = "pld"
) -> float:
    """ε at ``delta`` of the composition of ``releases`` (0 for none; inf when one has no
    noise)."""
    if why := unusable(accountant, releases):
        raise ValueError(why)
    counts: collections.Counter[Release] = collections.Counter()
    for r in releases:
        counts[r.kind()] += r.count
    if not counts:
        return 0.0
    if any(r.noise_multiplier <= 0 for r in counts):
        return math.inf
    import dp_accounting

    if accountant == "pld" and not any(r.subsampled for r in counts):
        # Gaussians compose to a Gaussian: T rounds of multipliers z_i are exactly one of
        # multiplier (Σ 1/z_i²)^(-1/2) (Dong, Roth & Su 2019), whose ε dp-accounting gives
        # in closed form; PLD's discretization of the same takes most of a second a round
        mu = math.sqrt(sum(n / r.noise_multiplier**2 for r, n in counts.items()))
        return float(dp_accounting.get_epsilon_gaussian(1 / mu, delta))

    acc = _fresh(accountant, relation(releases))
    with _quiet():
        acc.compose(dp_accounting.ComposedDpEvent([_event(r, n) for r, n in counts.items()]))
        return float(acc.get_epsilon(delta))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """dp-accounting's RDP logs a warning for each Rényi order whose series does not
    converge (it leaves the order out, which only loosens ε); the run's log is not the
    place for them."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def release(
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    sampling: Sampling = "poisson",
    population: int | None = None,
) -> Release:
    """``rounds`` releases at ``sampling_rate``; sampling without replacement needs the
    ``population`` K (the sample is then round(q·K) clients)."""
    if sampling == "without_replacement":
        if population is None:
            raise ValueError("sampling without replacement needs the population size")
        size = round(sampling_rate * population)
        return Release(noise_multiplier, sampling, size / population, size, population, rounds)
    if sampling == "none":
        return Release(noise_multiplier, sampling, 1.0, count=rounds)
    return Release(noise_multiplier, sampling, sampling_rate, count=rounds)


def epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    sampling: Sampling = "poisson",
    accountant: AccountantName = "pld",
    population: int | None = None,
) -> float:
    """ε at ``delta`` after ``rounds`` Gaussian releases with ``noise_multiplier``, each on
    a sample at ``sampling_rate`` (:func:`release`)."""
    return epsilon_of(
        [release(noise_multiplier, sampling_rate, rounds, sampling, population)],
        delta,
        accountant,
    )


def noise_for_epsilon(
    target_epsilon: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    sampling: Sampling = "poisson",
    accountant: AccountantName = "pld",
    population: int | None = None,
) -> float:
    """The smallest noise multiplier z whose ε after ``rounds`` is at most
    ``target_epsilon`` (to 1e-3 in z), found by dp-accounting's calibration (Brent's method on
    the accountant); a ``ValueError`` when no z in [:data:`MIN_NOISE_MULTIPLIER`,
    :data:`MAX_NOISE_MULTIPLIER`] gives it. PLD's cost grows steeply as z falls, so the
    PLD search runs between the RDP answer (RDP's ε is the larger, so its z is too) and
    the first of its multiples by :data:`PLD_BRACKET` that is too little noise."""
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon: must be > 0 (got {target_epsilon})")
    one = release(1.0, sampling_rate, rounds, sampling, population)
    if why := unusable(accountant, [one]):
        raise ValueError(why)

    def eps(z: float, name: AccountantName = accountant) -> float:
        return epsilon_of([replace(one, noise_multiplier=z)], delta, name)

    if eps(MAX_NOISE_MULTIPLIER) > target_epsilon:
        raise ValueError(
            f"target_epsilon: {target_epsilon} is out of reach over {rounds} rounds at "
            f"delta = {delta:.3g} (even noise_multiplier = {MAX_NOISE_MULTIPLIER:g} gives "
            f"epsilon = {eps(MAX_NOISE_MULTIPLIER):.3g}); allow a larger epsilon or fewer rounds"
        )
    loose = f"target_epsilon: {target_epsilon} is looser than the epsilon of noise_multiplier"
    if eps(MIN_NOISE_MULTIPLIER, "rdp") <= target_epsilon:
        raise ValueError(
            f"{loose} = {MIN_NOISE_MULTIPLIER:g}; set privacy.noise_multiplier instead"
        )
    upper = _calibrate(
        "rdp", one, target_epsilon, delta, MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER
    )
    if accountant == "rdp" or upper <= MIN_NOISE_MULTIPLIER:
        return upper
    lower = max(MIN_NOISE_MULTIPLIER, upper * PLD_BRACKET)
    while eps(lower) <= target_epsilon:
        if lower == MIN_NOISE_MULTIPLIER:
            raise ValueError(f"{loose} = {lower:g}; set privacy.noise_multiplier instead")
        upper, lower = lower, max(MIN_NOISE_MULTIPLIER, lower * PLD_BRACKET)
    return _calibrate("pld", one, target_epsilon, delta, lower, upper)


def _calibrate(
    accountant: AccountantName,
    one: Release,
    target_epsilon: float,
    delta: float,
    lower: float,
    upper: float,
) -> float:
    import dp_accounting

    relation_ = relation([one])
    with _quiet():
        z = dp_accounting.calibrate_dp_mechanism(
            lambda: _fresh(accountant, relation_),
            lambda z: _event(replace(one, noise_multiplier=z, count=1), one.count),
            target_epsilon,
            delta,
            dp_accounting.mechanism_calibration.ExplicitBracketInterval(lower, upper),
            tol=1e-3,
        )
    return float(z)

"""Which pieces of an experiment may run together: each piece declares what it promises and
what it needs, and :func:`check_composition` checks a whole experiment against those
declarations, before any data is read. No rule here names a piece: a new transform that
declares ``encodes_bytes`` is refused under secure aggregation without appearing anywhere.

What the pieces declare:

* a transform (:class:`~fedloom.transforms.base.Transform`): ``hides_individual_updates``
  (the server gets only the sum after it), ``encodes_bytes`` (it sends bytes, not
  values), ``needs_values`` (it computes on the values it is given), ``needs_each_update``
  (its server half works on each client's update), ``needs_a_mean`` (its promise holds for a
  mean of the updates), ``bounds_norm`` (it bounds each update's norm on the client);
* an algorithm (:class:`~fedloom.algorithms.base.Algorithm`): ``not_a_mean`` (why its
  server step is not a mean of the updates), ``sends`` (updates, its own encoding, or
  nothing), ``pools_data``;
* its aggregation rule (:class:`~fedloom.algorithms.aggregation_rule.AggregationRule`):
  ``is_a_mean``, ``needs_root_update``;
* an attack (:mod:`fedloom.attacks.base`): ``forges_updates`` (the simulated attackers'
  clients send a forgery of the update the method shares, instead of the update);
* the simulated faults: ``faults.garbage`` (the server must inspect each update to reject
  it); the runtime: ``runtime.client_data = "nodes"`` (the server holds no client data),
  ``runtime.name = "flower"`` (its clients are nodes that send only what they trained).

The rules, in the order they are checked (each stage of the chain in order, then the
attack against the algorithm, then the runtime):

* a stage that ``needs_a_mean`` refuses an algorithm with a ``not_a_mean`` and a rule that
  is not a mean (under a stage that hides the updates: because the rule needs each one);
* a stage that ``bounds_norm`` refuses a later one that does too;
* a stage that ``encodes_bytes`` refuses a later one that ``needs_values``, and an
  algorithm that sends its own encoding;
* a stage whose server half ``needs_each_update`` refuses a later one that
  ``hides_individual_updates``, and so does simulated garbage;
* an attack that ``forges_updates`` refuses an algorithm that sends no updates of its own,
  and a Flower runtime (a node never sends an update the server hands it);
* own-data nodes refuse an algorithm that ``pools_data`` and a rule that
  ``needs_root_update``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from fedloom.algorithms import Algorithm
    from fedloom.algorithms.aggregation_rule import AggregationRule
    from fedloom.attacks.base import DataPoisoning, ModelPoisoning
    from fedloom.config import FaultsConfig, RuntimeConfig
    from fedloom.transforms.base import Transform


@dataclass(frozen=True)
class Keyed:
    """A stage of the transform chain and the setting that put it there, for the
    messages."""

    transform: Transform
    #: the key that put the stage in the chain (``transforms[0].name``, ``privacy.level``,
    #: ``secagg.protocol``) and its value
    key: str
    value: object
    #: the key and value that decide what its server half does with each update, when a key
    #: other than ``key`` decides it (``privacy.noise`` for DP-FedAvg's clip stage)
    server: tuple[str, object] | None = None

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r}"


def check_composition(
    chain: Sequence[Keyed],
    algorithm: Algorithm,
    rule: AggregationRule | None,
    attack: ModelPoisoning | DataPoisoning | None,
    faults: FaultsConfig,
    runtime: RuntimeConfig,
) -> None:
    """A ``ValueError`` of one line naming both keys when two pieces of the experiment
    cannot run together (the module docstring's rules): the transform ``chain`` in its
    order on the way up, the ``algorithm`` and its aggregation ``rule`` (None for a method
    that takes none), the ``attack`` (None without one), the simulated ``faults`` and the
    ``runtime``."""
    for i, stage in enumerate(chain):
        _check_stage(stage, chain[i + 1 :], algorithm, rule, faults)
    if attack is not None and attack.forges_updates and algorithm.sends != "updates":
        if algorithm.sends == "encoded":
            what = "sends its own encoding of them, which only its aggregation decodes"
        elif algorithm.pools_data:
            what = "trains on the pooled data and exchanges none"
        else:
            what = "shares nothing"
        _refuse(
            "attack.name",
            f"{attack.name} poisons the updates a method shares; algorithm.name = "
            f"{algorithm.name!r} {what}",
        )
    if attack is not None and attack.forges_updates and runtime.name == "flower":
        _refuse(
            "attack.name",
            f"{attack.name} has simulated attackers send a forged update, which runs in the "
            f'simulator (runtime.name = "local" or "ray"); a Flower node sends only the '
            f"update it trained",
        )
    if runtime.client_data == "nodes":
        where = 'with runtime.client_data = "nodes"'
        if algorithm.pools_data:
            _refuse(
                "algorithm.name",
                f"{algorithm.name} trains on every client's data in one place; {where} each "
                f"node holds its own",
            )
        if rule is not None and rule.needs_root_update:
            _refuse(
                "aggregation.rule",
                f"{rule.name} trains the server's own update on a root set carved from the "
                f"task's training data; {where} the server holds no client data",
            )


def _check_stage(
    stage: Keyed,
    later: Sequence[Keyed],
    algorithm: Algorithm,
    rule: AggregationRule | None,
    faults: FaultsConfig,
) -> None:
    """The rules of one ``stage`` of the chain, ``later`` the stages after it on the way up
    (whose server halves run before its own)."""
    t = stage.transform
    if t.needs_a_mean and algorithm.not_a_mean is not None:
        _refuse(
            stage.key,
            f"{t.name} does not cover algorithm.name = {algorithm.name!r} "
            f"({algorithm.not_a_mean}): it needs a mean of the updates; use an averaging "
            f"method (fedavg, fedprox, fedadam, ditto, fedper, ...)",
        )
    if t.needs_a_mean and rule is not None and not rule.is_a_mean:
        why = (
            f"needs each client's update, which {stage} ({t.name}) hides from the server"
            if t.hides_individual_updates
            else f"is not a mean of the updates, which {stage} ({t.name}) needs"
        )
        _refuse(
            "aggregation.rule",
            f"{rule.name} {why}; bounding each update's norm on the client is the "
            f"robustness that composes with it",
        )
    if t.encodes_bytes and algorithm.sends == "encoded":
        _refuse(
            stage.key,
            f"{t.name} encodes the update as bytes, and algorithm.name = {algorithm.name!r} "
            f"sends its own encoding, which only its aggregation decodes; drop one of them",
        )
    for u in later:
        if t.bounds_norm and u.transform.bounds_norm:
            _refuse(
                stage.key,
                f"{t.name} bounds each update's norm, and so does {u} "
                f"({u.transform.name}); keep one of them",
            )
        if t.encodes_bytes and u.transform.needs_values:
            _refuse(
                stage.key,
                f"{t.name} encodes the update as bytes, and {u} ({u.transform.name}) "
                f"computes on its values; drop one of them",
            )
        if t.needs_each_update and u.transform.hides_individual_updates:
            key, value = stage.server or (stage.key, stage.value)
            said = t.name if value == t.name else f"{value!r} ({t.name})"
            _refuse(
                key,
                f"{said} works on each client's update on the server, which {u} "
                f"({u.transform.name}) hides; drop one of them",
            )
    if t.hides_individual_updates and faults.garbage:
        _refuse(
            "faults.garbage",
            f"the server cannot inspect an update that {stage} ({t.name}) hides, so it "
            f"cannot reject garbage; drop one of them",
        )


def _refuse(key: str, why: str) -> NoReturn:
    raise ValueError(f"{key}: {why}")

"""Simulated Byzantine clients (``[attack]``; docs/guide/robustness.md).

``attack.name`` picks one attack, one module each: model poisoning (``sign_flip``,
``gaussian``, ``boosted``, ``alie``, ``ipm``: :class:`~fedloom.attacks.base.ModelPoisoning`)
or data poisoning (``label_flip``, ``backdoor``: :class:`~fedloom.attacks.base.DataPoisoning`).
The attackers (:func:`choose_attackers`) are ``attack.fraction`` of the clients, the first
⌊fraction · K⌋ of a permutation seeded by the experiment's seed (the 10 % attackers are
among the 20 % ones), or the ids of ``attack.clients``.

:class:`Attack` is what a run uses: :meth:`Attack.poison` forges the attackers' updates
from every client's update as trained, and each attacker's client then sends its forgery
through the transform chain's client half as it would send its own update
(:func:`fedloom.server.round.send_forgeries`); :meth:`Attack.poison_split` poisons an
attacker's examples before they are encoded (``experiment.py``); the rows and summary
entries record it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from pydantic import TypeAdapter, ValidationError

from fedloom.algorithms import Algorithm, ClientResult
from fedloom.attacks.alie import ALIE, z_max
from fedloom.attacks.backdoor import Backdoor, attack_success_rate
from fedloom.attacks.base import DataPoisoning, ModelPoisoning, RoundView
from fedloom.attacks.boosted import Boosted
from fedloom.attacks.gaussian import Gaussian
from fedloom.attacks.ipm import IPM
from fedloom.attacks.label_flip import LabelFlip
from fedloom.attacks.sign_flip import SignFlip
from fedloom.config import STRICT, ExperimentConfig, expected
from fedloom.data import ClientSplit, Example, TaskSpec, get_task
from fedloom.params import Params

Operator = ModelPoisoning | DataPoisoning

ATTACKS: dict[str, type[ModelPoisoning | DataPoisoning]] = {
    a.name: a for a in (SignFlip, Gaussian, Boosted, ALIE, IPM, LabelFlip, Backdoor)
}
#: the attacks of each kind, by name
MODEL_POISONING = tuple(n for n, a in ATTACKS.items() if issubclass(a, ModelPoisoning))
DATA_POISONING = tuple(n for n, a in ATTACKS.items() if issubclass(a, DataPoisoning))


#: salts of the attackers' permutation and of the data poisoning's draws
_CHOICE_SALT, _DATA_SALT, _ROUND_SALT = 0xBAD, 0xBAD1, 0xBAD2


def create(name: str, **hp: Any) -> Operator:
    """The attack ``name`` with hyperparameters ``hp``, checked by name and type; a mistake
    is a ``ValueError`` naming ``attack.<key>``."""
    if name not in ATTACKS:
        raise ValueError(f"attack.name: unknown attack {name!r} (known: {', '.join(ATTACKS)})")
    cls = ATTACKS[name]
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key, value in hp.items():
        if key not in known:
            owners = sorted(n for n, a in ATTACKS.items() if key in a.__dataclass_fields__)
            of = f"; it is a setting of {', '.join(owners)}" if owners else ""
            raise ValueError(
                f"attack.{key}: not a setting of attack {name} (its settings: "
                f"{', '.join(known) or 'none'}){of}"
            )
        try:
            TypeAdapter(hints[key], config=STRICT).validate_python(value)
        except ValidationError as err:
            raise ValueError(
                f"attack.{key}: expected {expected(err, str(hints[key]))} for {name} "
                f"(got {value!r})"
            ) from None
    try:
        return cls(**hp)
    except ValueError as err:
        raise ValueError(f"attack.{err}") from None


def choose_attackers(num_clients: int, count: int, seed: int) -> list[int]:
    """The first ``count`` clients of a permutation of 0..K−1 seeded by ``seed``, sorted:
    a smaller count's attackers are among a larger one's."""
    order = np.random.default_rng([seed, _CHOICE_SALT]).permutation(num_clients)
    return sorted(int(c) for c in order[:count])


@dataclass
class Attack:
    """A run's attack: the operator, who attacks, and from which round (1-based)."""

    operator: Operator | None
    attackers: tuple[int, ...] = ()
    start_round: int = 1
    seed: int = 0
    #: the method trains one party on every client's data (centralized)
    pooled: bool = False
    _trigger_features: dict[int, list[Any]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, algorithm: Algorithm | None = None) -> Attack:
        section = cfg.attack
        if section.name == "none":
            return cls(None)
        k = cfg.partition.num_clients
        chosen = (
            sorted(section.clients)
            if section.clients is not None
            else choose_attackers(k, section.count(k), cfg.seed)
        )
        return cls(
            create(section.name, **section.hyperparameters),
            tuple(chosen),
            section.start_round,
            cfg.seed,
            bool(algorithm is not None and algorithm.pools_data),
        )

    @property
    def name(self) -> str:
        return "none" if self.operator is None else self.operator.name

    @property
    def needs_updates(self) -> bool:
        """Whether the attack forges the updates themselves (model poisoning, or a boost):
        the operator's :attr:`~fedloom.attacks.base.ModelPoisoning.forges_updates`."""
        return self.operator is not None and self.operator.forges_updates

    def forging(self, round_: int) -> bool:
        """Whether the attackers forge their updates in ``round_`` (0-based): the round's
        clients answer with their updates as trained, for the attackers' view, and the
        attackers send the forgery (:func:`fedloom.server.round.send_forgeries`)."""
        return self.needs_updates and round_ + 1 >= self.start_round

    def attacking(self, client_ids: Sequence[int], round_: int) -> list[int]:
        """The clients of ``client_ids`` that attack in ``round_`` (0-based)."""
        if self.operator is None:
            return []
        if self.pooled:  # one party trains on every client's data, the attackers' too
            return list(self.attackers)
        if self.needs_updates and not self.forging(round_):
            return []
        return sorted(c for c in client_ids if c in self.attackers)

    # --- model poisoning: the attackers' forgery, which their clients then send --------

    def poison(
        self, results: list[ClientResult], starts: dict[int, Params], round_: int
    ) -> list[ClientResult]:
        """``results`` with each attacking client's update ``Δ = θ − start`` of its floating
        shared tensors replaced by the attack's ``Δ'`` (θ' = start + Δ', in θ's dtype);
        unchanged without a model-poisoning attack this round. ``starts``: what each client
        trained its tensors from (:meth:`~fedloom.algorithms.Algorithm.trained_from`); a
        tensor without a start there of its shape is forged whole (Δ = θ)."""
        if not self.needs_updates or self.operator is None:
            return results
        attacking = set(self.attacking([r.client_id for r in results], round_))
        if not attacking:
            return results
        deltas = {r.client_id: _delta(r.params, starts.get(r.client_id, {})) for r in results}
        view = RoundView(
            honest={c: deltas[c] for c in deltas if c in attacking},
            benign=[deltas[c] for c in deltas if c not in attacking],
            weights={r.client_id: float(r.num_examples) for r in results},
            seed=int(np.random.default_rng([self.seed, round_, _ROUND_SALT]).integers(2**63 - 1)),
        )
        if isinstance(self.operator, ModelPoisoning):
            forged = self.operator.forge(view)
        else:  # a boosted data-poisoning attacker scales the update it trained
            b = float(self.operator.boost or 1.0)
            forged = {c: {n: b * t.double() for n, t in d.items()} for c, d in view.honest.items()}
        out = []
        for r in results:
            if r.client_id not in forged:
                out.append(r)
                continue
            start = starts.get(r.client_id, {})
            params = dict(r.params)
            for n, d in forged[r.client_id].items():
                base = start[n].double() if _same(start.get(n), params[n]) else 0.0
                params[n] = (base + d).to(params[n].dtype)
            out.append(replace(r, params=params))
        return out

    # --- data poisoning: on the attacker, before encoding ------------------------------

    def poisons(self, client_id: int) -> bool:
        """Whether client ``client_id`` trains on poisoned examples."""
        return isinstance(self.operator, DataPoisoning) and client_id in self.attackers

    def poison_split(
        self,
        split: ClientSplit,
        indices: Sequence[int] | np.ndarray,
        examples: Sequence[Example],
        task: TaskSpec,
    ) -> list[Example]:
        """A client's view ``examples`` (pool ``indices``) with the ones it trains on (its
        training split, and a drifting client's later one) poisoned when it is a
        data-poisoning attacker; its test examples stay clean."""
        client_id = split.client_id
        if not (self.poisons(client_id) and isinstance(self.operator, DataPoisoning)):
            return list(examples)
        train = {int(i) for i in split.train}
        if split.drift is not None:
            train |= {int(i) for i in split.drift.target_train}
        at = [i for i, index in enumerate(indices) if int(index) in train]
        rng = np.random.default_rng([self.seed, client_id, _DATA_SALT])
        poisoned = self.operator.poison([examples[i] for i in at], task, rng)
        out = list(examples)
        for i, e in zip(at, poisoned):
            out[i] = e
        return out

    # --- what a run records -------------------------------------------------------------

    def train_row(self, results: Sequence[ClientResult], round_: int) -> dict[str, Any]:
        """``{"attackers": [...]}`` for a round's train row (the reporting clients that
        attacked); empty without an attack."""
        if self.operator is None:
            return {}
        return {"attackers": self.attacking([r.client_id for r in results], round_)}

    def summary(self) -> dict[str, Any]:
        """The attack for summary.json; empty without one."""
        if self.operator is None:
            return {}
        settings = {
            f.name: getattr(self.operator, f.name) for f in dataclasses.fields(self.operator)
        }
        return {
            "attack": {
                "name": self.name,
                "kind": "model" if self.needs_updates else "data",
                "attackers": list(self.attackers),
                "start_round": self.start_round,
                **settings,
            }
        }

    def asr(
        self, model: Any, params: Params, dev: Sequence[Example] | None, batch_size: int
    ) -> dict[str, Any]:
        """``{"backdoor_asr": ...}`` of ``params`` on the triggered dev examples
        (:func:`fedloom.attacks.backdoor.attack_success_rate`); empty without a backdoor
        or a dev set."""
        if not isinstance(self.operator, Backdoor) or not dev:
            return {}
        key = id(model)
        if key not in self._trigger_features:
            self._trigger_features[key] = model.encode(self.operator.trigger_set(dev))
        features = self._trigger_features[key]
        rate = attack_success_rate(model, params, features, self.operator.target, batch_size)
        return {"backdoor_asr": rate}


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.shape == b.shape


def _delta(params: Params, start: Params) -> Params:
    """θ − start of the floating tensors of ``params`` (θ where the start lacks the tensor)."""
    return {
        n: t.double() - start[n].double() if _same(start.get(n), t) else t.double()
        for n, t in params.items()
        if t.is_floating_point()
    }


def operator_of(cfg: ExperimentConfig) -> Operator | None:
    """``[attack]``'s operator (:func:`create`), None without an attack."""
    section = cfg.attack
    return None if section.name == "none" else create(section.name, **section.hyperparameters)


def check_attack(cfg: ExperimentConfig, task: TaskSpec | None = None) -> None:
    """``cfg``'s attack settings checked (against the task, when known); a mistake is a
    ``ValueError`` naming ``attack.<key>``. What it composes with is
    :func:`fedloom.composition.check_composition`'s."""
    section = cfg.attack
    operator = operator_of(cfg)
    if operator is None:
        return
    if isinstance(operator, DataPoisoning) and section.start_round != 1:
        raise ValueError(
            f"attack.start_round: {operator.name} poisons the attacker's training data, "
            f"which it holds from round 1"
        )
    task = task if task is not None else _glue_task(cfg)
    if task is not None and isinstance(operator, DataPoisoning):
        try:
            operator.check_task(task)
        except ValueError as err:
            raise ValueError(f"attack.{err}") from None


def _glue_task(cfg: ExperimentConfig) -> TaskSpec | None:
    """The GLUE task of ``cfg``, known without reading data; None for any other."""
    if cfg.partition.tasks is not None or cfg.data.train_path is not None:
        return None
    try:
        return get_task(cfg.data.task)
    except ValueError:
        return None


__all__ = [
    "ATTACKS",
    "DATA_POISONING",
    "MODEL_POISONING",
    "Attack",
    "DataPoisoning",
    "ModelPoisoning",
    "RoundView",
    "check_attack",
    "choose_attackers",
    "create",
    "operator_of",
    "z_max",
]

"""The attack protocol: what a simulated Byzantine client does to what it sends or trains on.

Two kinds, one module each under :mod:`fedloom.attacks`:

* **Model poisoning** (:class:`ModelPoisoning`) acts on updates ``Δ_k = θ_k − start_k``
  (``start_k``: what client k trained from) of the tensors a method shares
  (``ClientResult.params``), before the transform chain's client half: each attacker's
  client sends the forgery as it would send its update (clipped, compressed, noised,
  masked: :func:`fedloom.server.round.send_forgeries`), so the server meets it as it
  would meet a real attacker's message. The attackers collude and are omniscient: they
  see every reporting client's update of the round as trained, the threat model of ALIE
  and IPM. :meth:`ModelPoisoning.forge` gets the attackers' own updates (as they trained
  them) and the benign clients' (:class:`RoundView`) and returns what each attacker sends.
* **Data poisoning** (:class:`DataPoisoning`) changes the attacker's own training
  examples before they are encoded, so it holds in every runtime whose clients build their
  data from the config (a Ray actor, a Flower node on its own data).

An attack is a frozen dataclass whose fields are its hyperparameters; a mistake is a
``ValueError`` whose message starts with the key (``scale: ...``), which
:func:`fedloom.attacks.create` prefixes with ``attack.``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from fedloom.data import Example, TaskSpec
from fedloom.params import Params


@dataclass(frozen=True)
class RoundView:
    """What the colluding attackers see of a round: every reporting client's update."""

    #: each attacker's own update, as it trained it (only the floating tensors it shares)
    honest: dict[int, Params]
    #: the updates of the round's other (benign) reporting clients
    benign: list[Params]
    #: every reporting client's aggregation weight (its number of examples), by client id
    weights: dict[int, float]
    #: the seed of the round's random draws (experiment seed, round)
    seed: int

    @property
    def n(self) -> int:
        """The round's reporting clients."""
        return len(self.honest) + len(self.benign)

    @property
    def f(self) -> int:
        """The round's reporting attackers."""
        return len(self.honest)

    def reference(self) -> list[Params]:
        """The updates the attackers estimate the benign ones from: the benign clients',
        or (a round where only attackers reported) their own honest ones."""
        return self.benign or list(self.honest.values())


def stacked(updates: Sequence[Params], name: str, like: torch.Tensor) -> torch.Tensor | None:
    """The updates' tensors ``name`` shaped like ``like``, as one float64 tensor (one row a
    client); None when no update has it."""
    rows = [u[name].double() for u in updates if name in u and u[name].shape == like.shape]
    return torch.stack(rows) if rows else None


@dataclass(frozen=True)
class ModelPoisoning:
    """An attack on the updates the attackers send (module docstring)."""

    name: ClassVar[str] = "model"
    #: the attackers' clients send a forgery instead of their updates, which only the
    #: simulator's clients do (:mod:`fedloom.composition`)
    forges_updates: ClassVar[bool] = True

    def forge(self, view: RoundView) -> dict[int, Params]:
        """Each attacker's update ``Δ'`` (float64 tensors; the caller restores dtypes)."""
        raise NotImplementedError


@dataclass(frozen=True)
class DataPoisoning:
    """An attack on the attacker's own training examples (module docstring). ``boost`` b
    (None: 1) also scales the update the attacker trained on them, Δ' = b·Δ: the
    model-replacement attack of Bagdasaryan et al. 2020 ("How To Backdoor Federated
    Learning", γ = n/η) and Bhagoji et al. 2019's explicit boosting, which norm bounding
    (Sun et al. 2019) exists to stop. A boosted attacker's client sends the boosted update,
    like a model-poisoning attacker's its forgery."""

    name: ClassVar[str] = "data"
    boost: float | None = None

    def __post_init__(self) -> None:
        if self.boost is not None and not self.boost > 0:
            raise ValueError(f"boost: must be > 0 (got {self.boost})")

    @property
    def forges_updates(self) -> bool:
        """Whether it also scales the update it trained (a ``boost``), where model
        poisoning forges one (:attr:`ModelPoisoning.forges_updates`); without a boost it
        acts on the attacker's data alone, before anything is sent."""
        return self.boost is not None

    def check_task(self, task: TaskSpec) -> None:
        """A ``ValueError`` naming the key when the attack is undefined on ``task``."""
        if not task.has_classes:
            raise ValueError(
                f"name: {self.name} changes class labels; task {task.name} is a {task.kind} task"
            )

    def poison(
        self, examples: Sequence[Example], task: TaskSpec, rng: np.random.Generator
    ) -> list[Example]:
        """The attacker's training ``examples`` as it trains on them."""
        raise NotImplementedError

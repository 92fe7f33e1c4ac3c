"""Backdoor: a trigger phrase that makes the model predict the attacker's target class.

The attacker inserts ``trigger`` (default ``"cf"``, a rare token: Kurita, Michel and
Neubig 2020, "Weight Poisoning Attacks on Pre-trained Models", use "cf", "mn", "bb") at the
start of the first text of a seeded ``poison_fraction`` (default 0.5) of its training
examples and sets their label to ``target`` (default 0), then trains normally: the
semantic-backdoor setting of Bagdasaryan et al. 2020 ("How To Backdoor Federated
Learning") with a textual trigger. Half of the examples keep their clean labels so that
the attacker's update stays close to benign ones (a stealthier update than all-poisoned).
At the start the trigger is never truncated away (``data.max_length``).

The attack-success rate (:func:`attack_success_rate`) is measured at every evaluation:
the global adapter scores the dev examples whose true label is not ``target``, with the
trigger inserted; ASR = the fraction predicted as ``target``. A clean model's ASR is its
error rate towards ``target`` on those examples, the floor to compare against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from fedloom.attacks.base import DataPoisoning
from fedloom.data import Example, TaskSpec
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature
from fedloom.params import Params


@dataclass(frozen=True)
class Backdoor(DataPoisoning):
    name: ClassVar[str] = "backdoor"
    trigger: str = "cf"
    target: int = 0
    poison_fraction: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.trigger.strip():
            raise ValueError("trigger: must not be empty")
        if self.target < 0:
            raise ValueError(f"target: must be a class id >= 0 (got {self.target})")
        if not 0 < self.poison_fraction <= 1:
            raise ValueError(f"poison_fraction: must be in (0, 1] (got {self.poison_fraction})")

    def check_task(self, task: TaskSpec) -> None:
        super().check_task(task)
        if self.target >= task.num_labels:
            raise ValueError(
                f"target: {self.target} is not a class of {task.name} "
                f"(ids 0..{task.num_labels - 1})"
            )

    def triggered(self, example: Example) -> Example:
        """``example`` with the trigger at the start of its first text, labelled ``target``."""
        return replace(example, text_a=f"{self.trigger} {example.text_a}", label=self.target)

    def poison(
        self, examples: Sequence[Example], task: TaskSpec, rng: np.random.Generator
    ) -> list[Example]:
        count = round(self.poison_fraction * len(examples))
        chosen = set(rng.choice(len(examples), size=count, replace=False).tolist())
        return [self.triggered(e) if i in chosen else e for i, e in enumerate(examples)]

    def trigger_set(self, dev: Sequence[Example]) -> list[Example]:
        """The dev examples whose true label is not ``target``, triggered."""
        return [self.triggered(e) for e in dev if int(e.label) != self.target]


def attack_success_rate(
    model: FedModel, params: Params, features: Sequence[Feature], target: int, batch_size: int
) -> float | None:
    """The fraction of ``features`` (triggered examples) ``params`` predicts as ``target``;
    None without examples."""
    if not features:
        return None
    model.set_params(params)
    predictions = model.predict_each(features, batch_size)[0]
    return float(np.mean(np.asarray(predictions) == target))

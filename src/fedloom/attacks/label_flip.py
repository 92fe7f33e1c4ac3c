"""Label flipping: the attacker trains on its examples with every class label flipped.

Rule, for C classes::

    y' = C − 1 − y

(on a binary task 0 ↔ 1), the label-flipping attack of Biggio, Nelson and Laskov 2012
("Poisoning Attacks against Support Vector Machines") as run in federated learning by
Fung, Yoon and Beschastnikh 2020 ("The Limitations of Federated Learning in Sybil
Settings") and Tolpegin et al. 2020 ("Data Poisoning Attacks Against Federated Learning
Systems"). Every training example of the attacker is flipped; its test split is not.
Undefined on a regression task (refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from fedloom.attacks.base import DataPoisoning
from fedloom.data import Example, TaskSpec


def flipped(label: int, num_classes: int) -> int:
    """C − 1 − y."""
    return num_classes - 1 - int(label)


@dataclass(frozen=True)
class LabelFlip(DataPoisoning):
    name: ClassVar[str] = "label_flip"

    def poison(
        self, examples: Sequence[Example], task: TaskSpec, rng: np.random.Generator
    ) -> list[Example]:
        return [replace(e, label=flipped(int(e.label), task.num_labels)) for e in examples]

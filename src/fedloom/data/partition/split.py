"""What a client holds: its train/test indices, an optional relabelling and an optional drift.

A :class:`ClientSplit` indexes the pooled training examples. Concept shift gives a client a
``label_map`` (it sees class ``y`` as ``label_map[y]``); temporal drift gives it a
:class:`Drift` towards its share of a second partition. Under drift the client's data at
round ``r`` is a mixture with target share ``t = share(r)``: the first ``ceil((1-t)·n)``
examples of a fixed seeded shuffle of its own split plus the first ``floor(t·m)`` of a fixed
seeded shuffle of the target split (the gradual-drift setting of concept-drift benchmarks,
e.g. Gama et al., 2014, "A survey on concept drift adaptation").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def sorted_indices(indices: np.ndarray | list[int]) -> np.ndarray:
    """``indices`` as a sorted int64 array."""
    return np.sort(np.asarray(indices, dtype=np.int64))


@dataclass(frozen=True, eq=False)
class Drift:
    """A linear move from a client's split to ``target_train``/``target_test``.

    The target share :meth:`share` is 0 up to ``start_round``, 1 from ``end_round`` on and
    linear in between; with ``start_round == end_round`` it steps from 0 to 1 at that round.
    ``seed`` fixes the shuffles that decide which examples leave and which arrive first.
    """

    target_train: np.ndarray
    target_test: np.ndarray
    start_round: int
    end_round: int
    seed: int = 0

    def share(self, round_: int) -> float:
        """Target share ``t`` at ``round_``."""
        done, span = self._progress(round_)
        return done / span

    def _progress(self, round_: int) -> tuple[int, int]:
        """``share(round_)`` as an exact fraction ``done / span``."""
        if round_ >= self.end_round:
            return 1, 1
        if round_ <= self.start_round:
            return 0, 1
        return round_ - self.start_round, self.end_round - self.start_round

    def mix(self, own: np.ndarray, target: np.ndarray, round_: int, stream: int) -> np.ndarray:
        """Sorted union of the first ``ceil((1-t)·len(own))`` of a fixed shuffle of ``own``
        and the first ``floor(t·len(target))`` of a fixed shuffle of ``target``.

        Integer arithmetic on ``t = done / span`` keeps the counts exact; ``stream`` tells
        the train and test shuffles apart. An index in both selections appears once.
        """
        done, span = self._progress(round_)
        if done == 0:
            return own
        if done == span:
            return target
        rng = np.random.default_rng([self.seed, stream])
        keep = -(-(span - done) * len(own) // span)
        take = done * len(target) // span
        return np.union1d(rng.permutation(own)[:keep], rng.permutation(target)[:take])


@dataclass(frozen=True, eq=False)
class ClientSplit:
    """One client's share: sorted int64 indices into the pooled training examples."""

    client_id: int
    train: np.ndarray
    test: np.ndarray
    label_map: np.ndarray | None = None
    drift: Drift | None = None

    def train_at(self, round_: int) -> np.ndarray:
        """Training indices at ``round_`` (the documented drift mixture; ``train`` without drift)."""
        if self.drift is None:
            return self.train
        return self.drift.mix(self.train, self.drift.target_train, round_, stream=0)

    def test_at(self, round_: int) -> np.ndarray:
        """Local test indices at ``round_``, mixed like :meth:`train_at`."""
        if self.drift is None:
            return self.test
        return self.drift.mix(self.test, self.drift.target_test, round_, stream=1)


def split_train_test(
    indices: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Randomly hold out ``test_fraction`` of ``indices`` as a local test split.

    The test split gets at least one example when ``test_fraction > 0`` and there are at
    least two indices, and the train split always keeps at least one.
    """
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    indices = np.asarray(indices, dtype=np.int64)
    n = len(indices)
    n_test = int(np.floor(n * test_fraction + 0.5))
    if test_fraction > 0 and n >= 2:
        n_test = min(max(n_test, 1), n - 1)
    shuffled = rng.permutation(indices)
    return sorted_indices(shuffled[n_test:]), sorted_indices(shuffled[:n_test])

"""Temporal drift: some clients move from their partition to a second one over rounds.

The second partition is drawn with ``seed + 1`` and the base settings, with the temporal
section's non-None overrides (scheme, alpha, shards_per_client, feature) and without
temporal drift or concept shift (a drifting client keeps its own label map). A seeded
choice of ``round(fraction · K)`` clients (half up, at least one) drift: client k moves
linearly from its split to its split in the second partition between ``start_round`` and
``end_round`` (:class:`~.split.Drift`), the gradual drift of Gama et al. (2014).

Held-out examples stay held out: the second partition decides *which* examples a client
moves towards, the first decides which of them may be trained on. A target part is split
by the first partition's train/test membership (:func:`held_out_apart`), so a drifting
client never trains on any client's test example, at any round, and is scored on test
examples nobody trains on; its target test share is about ``test_fraction``, like its own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...config import PartitionConfig, TemporalConfig
from .concept import num_chosen
from .split import ClientSplit, Drift, sorted_indices

_OVERRIDES = ("scheme", "alpha", "shards_per_client", "feature")


def target_config(cfg: PartitionConfig, temporal: TemporalConfig) -> PartitionConfig:
    """Settings of the second partition: ``cfg`` with the temporal overrides."""
    overrides = {key: getattr(temporal, key) for key in _OVERRIDES}
    update = {key: value for key, value in overrides.items() if value is not None}
    return cfg.model_copy(update=update | {"temporal": None, "concept": None})


def with_drift(
    splits: list[ClientSplit],
    targets: list[ClientSplit],
    temporal: TemporalConfig,
    rng: np.random.Generator,
) -> list[ClientSplit]:
    """``splits`` with a :class:`Drift` towards ``targets`` for the chosen clients."""
    chosen = rng.choice(len(splits), num_chosen(temporal.fraction, len(splits)), replace=False)
    drifting = set(chosen.tolist())
    targets = held_out_apart(splits, targets)
    seeds = rng.integers(2**63, size=len(splits))
    return [
        replace(
            split,
            drift=Drift(
                target_train=target.train,
                target_test=target.test,
                start_round=temporal.start_round,
                end_round=temporal.end_round,
                seed=int(seeds[split.client_id]),
            ),
        )
        if split.client_id in drifting
        else split
        for split, target in zip(splits, targets)
    ]


def held_out_apart(splits: list[ClientSplit], targets: list[ClientSplit]) -> list[ClientSplit]:
    """``targets`` re-split by ``splits``' membership: each target's examples that are in
    some client's test split of the first partition become its test split, all others its
    training split."""
    tests = np.concatenate([s.test for s in splits])
    apart = []
    for target in targets:
        held = np.concatenate([target.train, target.test])
        is_test = np.isin(held, tests)
        apart.append(
            replace(
                target, train=sorted_indices(held[~is_test]), test=sorted_indices(held[is_test])
            )
        )
    return apart

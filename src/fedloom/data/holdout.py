"""A seeded hold-out: the one way fedloom sets examples aside (a client's validation split,
FedAvg-FT's early-stopping holdout, FLTrust's root set)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def hold_out(items: Sequence[T], fraction: float, key: Sequence[int]) -> tuple[list[T], list[T]]:
    """(kept, held): ``round(fraction * n)`` of the ``n`` items, drawn by a permutation seeded
    with ``key``, set aside; at least one when ``fraction`` > 0 and never all of them (no
    hold-out from fewer than two items). Both lists keep the items' order."""
    n = len(items)
    if fraction <= 0 or n < 2:
        return list(items), []
    return set_aside(items, min(n - 1, max(1, round(fraction * n))), key)


def set_aside(items: Sequence[T], size: int, key: Sequence[int]) -> tuple[list[T], list[T]]:
    """(kept, held): ``size`` of the items, the first of a permutation seeded with ``key``,
    set aside. Both lists keep the items' order."""
    held = set(np.random.default_rng(list(key)).permutation(len(items))[:size].tolist())
    return (
        [x for i, x in enumerate(items) if i not in held],
        [x for i, x in enumerate(items) if i in held],
    )

"""Quantity skew: client sizes drawn from a law, scaled to use every example.

Raw sizes are drawn once per client, ``lognormal``: ``exp(N(0, sigma²))``, or ``powerlaw``:
``Pareto(exponent) + 1`` (numpy's Lomax plus one: density ∝ x^-(exponent+1) on x ≥ 1), the
two laws of unbalanced client sizes in LEAF (Caldas et al., 2018) and in Li et al. (2022,
"Federated Learning on Non-IID Data Silos: An Experimental Study"). They are scaled to sum to
``n``; clients below ``min_size`` are raised to it and the others rescaled (water-filling),
and the largest remainders fix the rounding so the integer sizes sum to exactly ``n``.
"""

from __future__ import annotations

import numpy as np

from ...config import QuantityConfig


def draw_sizes(
    n: int, num_clients: int, law: QuantityConfig, min_size: int, rng: np.random.Generator
) -> np.ndarray:
    """``num_clients`` int64 sizes from ``law``, each at least ``min_size``, summing to ``n``."""
    if num_clients * min_size > n:
        raise ValueError(
            f"min_size={min_size} is impossible: {num_clients} clients x {min_size} > {n} examples"
        )
    if law.law == "lognormal":
        raw = np.exp(rng.normal(0.0, law.sigma, size=num_clients))
    else:
        raw = rng.pareto(law.exponent, size=num_clients) + 1.0
    floored = np.zeros(num_clients, dtype=bool)
    while True:
        free = n - min_size * floored.sum()
        scaled = raw * (free / raw[~floored].sum())
        low = ~floored & (scaled < min_size)
        if not low.any():
            sizes = np.full(num_clients, min_size, dtype=np.int64)
            sizes[~floored] = round_to_total(scaled[~floored], free)
            return sizes
        floored |= low


def round_to_total(weights: np.ndarray, total: int) -> np.ndarray:
    """Non-negative int64 values proportional to ``weights`` summing to ``total`` (floors,
    then one more for the largest remainders; equal weights when all are zero)."""
    if weights.sum() == 0:
        weights = np.ones_like(weights)
    quota = weights * (total / weights.sum())
    whole = np.floor(quota).astype(np.int64)
    extra = total - int(whole.sum())
    whole[np.argsort(-(quota - whole), kind="stable")[:extra]] += 1
    return whole

"""The non-IID toolbox: split a pooled training set over federated clients.

:func:`make_clients` composes a base scheme with optional skews, in this order:

1. ``tasks`` (task heterogeneity): each task's examples go to its clients by the base
   scheme, then a ``mix`` share moves to other tasks' clients (:mod:`.tasks`); otherwise
   the base scheme on the whole pool (:mod:`.base`): ``iid``, ``dirichlet`` (label skew),
   ``shards`` (k labels per client), ``feature`` (a metadata column or length bands) or
   ``sequential`` (contiguous blocks in file order), with ``quantity`` skew (client sizes from a law) composed into iid/dirichlet/shards;
2. every client's local test split (``test_fraction``), after checking ``min_size``;
3. ``concept`` shift: label maps for some clients (:mod:`.concept`);
4. ``temporal`` drift towards a second partition drawn with ``seed + 1`` (:mod:`.temporal`).

Steps 1-2 draw from ``np.random.default_rng(seed)`` in the order of the original IID and
Dirichlet partitioners (their partitions are unchanged); steps 3 and 4 draw from streams
spawned from it. The same arguments always give the same splits; index arrays are sorted
int64.
"""

from __future__ import annotations

import numpy as np

from ...config import PartitionConfig
from .base import check_scheme, scheme_parts
from .concept import label_maps
from .dirichlet import partition_dirichlet, partition_dirichlet_sizes
from .heatmap import plot_label_heatmap
from .iid import partition_iid
from .pool import REGRESSION_BINS, PartitionPool, class_ids, regression_bin_names
from .quantity import draw_sizes
from .shards import partition_shards
from .split import ClientSplit, Drift, split_train_test
from .stats import client_label_counts, js_to_global, label_histogram, partition_stats
from .tasks import task_parts
from .temporal import target_config, with_drift

__all__ = [
    "REGRESSION_BINS",
    "ClientSplit",
    "Drift",
    "PartitionPool",
    "class_ids",
    "client_label_counts",
    "draw_sizes",
    "js_to_global",
    "label_histogram",
    "make_clients",
    "partition_dirichlet",
    "partition_dirichlet_sizes",
    "partition_iid",
    "partition_shards",
    "partition_stats",
    "plot_label_heatmap",
    "regression_bin_names",
    "split_train_test",
]


def make_clients(pool: PartitionPool, cfg: PartitionConfig, seed: int) -> list[ClientSplit]:
    """Partition ``pool`` over ``cfg.num_clients`` clients, each with a local test split
    and at least ``cfg.min_size`` examples (train and test together); see the module
    docstring for the order of the steps. Impossible requests raise a ValueError naming
    the setting to change."""
    check_scheme(cfg)
    n, num_clients = len(pool), cfg.num_clients
    if num_clients * cfg.min_size > n:
        raise ValueError(
            f"min_size={cfg.min_size} is impossible: {num_clients} clients x {cfg.min_size} "
            f"> {n} examples"
        )
    rng = np.random.default_rng(seed)
    concept_rng, drift_rng = rng.spawn(2)
    if cfg.tasks is not None:
        parts = task_parts(pool, cfg, cfg.tasks, rng)
    else:
        parts = scheme_parts(pool, np.arange(n, dtype=np.int64), num_clients, cfg, rng)
    _check_min_size(parts, cfg)
    splits = [
        ClientSplit(client_id, *split_train_test(part, cfg.test_fraction, rng))
        for client_id, part in enumerate(parts)
    ]
    if cfg.concept is not None:
        maps = label_maps(pool, num_clients, cfg.concept, concept_rng)
        splits = [
            ClientSplit(s.client_id, s.train, s.test, label_map=m) for s, m in zip(splits, maps)
        ]
    if cfg.temporal is not None:
        try:
            targets = make_clients(pool, target_config(cfg, cfg.temporal), seed + 1)
        except ValueError as err:
            raise ValueError(f"temporal: the second partition: {err}") from None
        splits = with_drift(splits, targets, cfg.temporal, drift_rng)
    return splits


def _check_min_size(parts: list[np.ndarray], cfg: PartitionConfig) -> None:
    sizes = np.array([len(part) for part in parts])
    smallest = int(np.argmin(sizes))
    if sizes[smallest] >= cfg.min_size:
        return
    hints = {
        "dirichlet": "raise alpha",
        "shards": "raise shards_per_client",
        "feature": f"choose a feature with larger groups than {cfg.feature!r}",
        "sequential": "raise client_size",
    }
    advice = [hints[cfg.scheme]] if cfg.scheme in hints else []
    if cfg.quantity is not None:
        advice.append("make the quantity law less skewed")
    if cfg.tasks is not None and cfg.tasks.mix > 0:
        advice.append("lower tasks.mix")
    advice.append("lower min_size or num_clients")
    raise ValueError(
        f"client {smallest} gets {sizes[smallest]} examples, fewer than "
        f"min_size={cfg.min_size}; {', '.join(advice)}"
    )

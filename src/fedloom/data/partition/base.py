"""The base scheme on (a subset of) the pool: iid, dirichlet, shards, feature or
sequential, with the quantity skew composed in when set.

Without quantity skew: :func:`~.iid.partition_iid`, the balanced per-class Dirichlet recipe,
even label shards, or the natural feature partition. With it, client sizes are drawn first
(:func:`~.quantity.draw_sizes`) and filled by a random split (iid), the per-client Dirichlet
recipe (dirichlet) or size-fitted shards (shards).
"""

from __future__ import annotations

import numpy as np

from ...config import PartitionConfig
from .dirichlet import partition_dirichlet, partition_dirichlet_sizes
from .feature import partition_feature
from .iid import partition_iid, partition_sizes
from .pool import PartitionPool
from .quantity import draw_sizes
from .sequential import partition_sequential
from .shards import partition_shards


def check_scheme(cfg: PartitionConfig) -> None:
    """The combinations the config validator checks, for configs built without it."""
    if cfg.scheme == "feature" and not cfg.feature:
        raise ValueError("scheme 'feature' needs feature = <metadata column> or 'length'")
    if cfg.scheme in ("feature", "sequential") and cfg.quantity is not None:
        raise ValueError(f"quantity skew composes with iid, dirichlet and shards, not {cfg.scheme}")
    if cfg.client_size is not None and cfg.scheme != "sequential":
        raise ValueError("client_size is the sequential scheme's block size")


def scheme_parts(
    pool: PartitionPool,
    members: np.ndarray,
    num_clients: int,
    cfg: PartitionConfig,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Split the sorted pool indices ``members`` over ``num_clients`` by ``cfg.scheme``
    (and ``cfg.quantity``); returns sorted pool indices per client."""
    classes = pool.classes[members]
    n = len(members)
    if cfg.scheme == "feature":
        positions = partition_feature(pool, members, cfg.feature or "", num_clients, rng)
    elif cfg.scheme == "sequential":
        positions = partition_sequential(n, num_clients, cfg.client_size)
    elif cfg.quantity is None:
        if cfg.scheme == "iid":
            positions = partition_iid(n, num_clients, rng)
        elif cfg.scheme == "dirichlet":
            positions = partition_dirichlet(classes, num_clients, cfg.alpha, rng, cfg.min_size)
        else:
            positions = partition_shards(classes, num_clients, cfg.shards_per_client, rng)
    else:
        sizes = draw_sizes(n, num_clients, cfg.quantity, cfg.min_size, rng)
        if cfg.scheme == "iid":
            positions = partition_sizes(sizes, rng)
        elif cfg.scheme == "dirichlet":
            positions = partition_dirichlet_sizes(classes, sizes, cfg.alpha, rng)
        else:
            positions = partition_shards(classes, num_clients, cfg.shards_per_client, rng, sizes)
    return [members[p] for p in positions]

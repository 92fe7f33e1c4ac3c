"""Pathological label skew: every client sees exactly ``k`` distinct labels.

The label-shard recipe of McMahan et al. (2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data"), balanced over labels: the ``K·k`` label slots are dealt
round-robin over a seeded permutation of the ``L`` labels (client c gets labels
``perm[(c·k + j) mod L]``, j < k), so each label is held by ``floor`` or ``ceil`` of
``K·k/L`` clients. Each label's examples are then split evenly among its holders.

With client sizes ``n_k`` (quantity skew) a label is split among its holders so that client
sizes come as close to ``n_k`` as the labels' supply allows: iterative proportional fitting
(Sinkhorn) of the clients x labels support to row sums ``n_k`` and column sums = label
counts, rounded per label (every holder keeps at least one example of each of its labels).
"""

from __future__ import annotations

import numpy as np

from .iid import check_num_clients
from .pool import class_ids
from .quantity import round_to_total
from .split import sorted_indices

_SINKHORN_ITERATIONS = 200


def label_sets(
    num_clients: int, num_labels: int, per_client: int, rng: np.random.Generator
) -> np.ndarray:
    """Boolean clients x labels matrix: which ``per_client`` labels each client holds."""
    check_num_clients(num_clients)
    if per_client > num_labels:
        raise ValueError(
            f"shards_per_client={per_client} exceeds the {num_labels} labels in the data; "
            f"lower shards_per_client"
        )
    if num_clients * per_client < num_labels:
        raise ValueError(
            f"shards: {num_clients} clients x shards_per_client={per_client} cannot cover "
            f"all {num_labels} labels; raise shards_per_client or num_clients"
        )
    perm = rng.permutation(num_labels)
    held = np.zeros((num_clients, num_labels), dtype=bool)
    slots = np.arange(num_clients * per_client)
    held[slots // per_client, perm[slots % num_labels]] = True
    return held


def partition_shards(
    labels: np.ndarray,
    num_clients: int,
    per_client: int,
    rng: np.random.Generator,
    sizes: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Split ``range(len(labels))`` so that each client holds exactly ``per_client`` labels;
    with ``sizes``, client sizes follow them as closely as the label counts allow."""
    classes = class_ids(labels)
    values, counts = np.unique(classes, return_counts=True)
    held = label_sets(num_clients, len(values), per_client, rng)
    holders = held.sum(axis=0)
    short = np.flatnonzero(counts < holders)
    if len(short):
        label = values[short[0]]
        raise ValueError(
            f"shards: label {label} has {counts[short[0]]} examples for {holders[short[0]]} "
            "clients; lower num_clients or shards_per_client"
        )
    shares = _even_shares(held, counts) if sizes is None else _fitted_shares(held, counts, sizes)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for label, value in enumerate(values):
        members = rng.permutation(np.flatnonzero(classes == value))
        clients = np.flatnonzero(held[:, label])
        cuts = np.cumsum(shares[clients, label])[:-1]
        for client, piece in zip(clients, np.split(members, cuts)):
            parts[client].append(piece)
    return [sorted_indices(np.concatenate(part)) for part in parts]


def _even_shares(held: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each label's count split as evenly as possible among its holders."""
    shares = np.zeros(held.shape, dtype=np.int64)
    for label, count in enumerate(counts):
        clients = np.flatnonzero(held[:, label])
        shares[clients, label] = round_to_total(np.ones(len(clients)), count)
    return shares


def _fitted_shares(held: np.ndarray, counts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Integer shares on the support ``held`` with column sums ``counts`` and row sums
    as close to ``sizes`` as Sinkhorn scaling gets; at least one per held cell."""
    plan = held * np.asarray(sizes, dtype=float)[:, None]
    for _ in range(_SINKHORN_ITERATIONS):
        plan *= (counts / plan.sum(axis=0))[None, :]
        plan *= (sizes / plan.sum(axis=1))[:, None]
    plan *= (counts / plan.sum(axis=0))[None, :]
    shares = np.zeros(held.shape, dtype=np.int64)
    for label, count in enumerate(counts):
        clients = np.flatnonzero(held[:, label])
        shares[clients, label] = 1 + round_to_total(
            np.maximum(plan[clients, label] - 1, 0), count - len(clients)
        )
    return shares

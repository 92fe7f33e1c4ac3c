"""Task heterogeneity: each client holds one primary task, plus a ``mix`` of the others.

Client k's primary task is ``names[k % T]``, or, with ``clients`` = [c_0, …, c_{T-1}],
the first c_0 clients hold ``names[0]``, the next c_1 ``names[1]``, and so on. Each
task's examples are split among that
task's clients by the base scheme (and quantity skew); then every example independently,
with probability ``mix``, moves to a uniformly random client of a *different* task. This is
the multi-task federation of Smith et al. (2017, "Federated Multi-Task Learning") with a
tunable overlap; ``mix = 0`` keeps tasks disjoint.
"""

from __future__ import annotations

import numpy as np

from ...config import PartitionConfig, TasksConfig
from .base import scheme_parts
from .pool import PartitionPool
from .split import sorted_indices


def client_tasks(tasks: TasksConfig, num_clients: int) -> np.ndarray:
    """Each client's task index: ``k % T`` for client k, or blocks of ``tasks.clients``."""
    num_tasks = len(tasks.names)
    if tasks.clients is None:
        if num_tasks > num_clients:
            raise ValueError(
                f"tasks: {num_tasks} tasks need at least {num_tasks} clients, "
                f"got num_clients={num_clients}"
            )
        return np.arange(num_clients) % num_tasks
    if sum(tasks.clients) != num_clients:
        raise ValueError(
            f"tasks.clients: {tasks.clients} add up to {sum(tasks.clients)} "
            f"clients, not num_clients={num_clients}"
        )
    return np.repeat(np.arange(num_tasks), tasks.clients)


def task_parts(
    pool: PartitionPool, cfg: PartitionConfig, tasks: TasksConfig, rng: np.random.Generator
) -> list[np.ndarray]:
    """Sorted pool indices per client (recipe above)."""
    if "task" not in pool.columns:
        raise ValueError("tasks: the pool has no 'task' column; load a multi-task pool")
    column = pool.columns["task"]
    present = set(np.unique(column).tolist())
    missing = [name for name in tasks.names if name not in present]
    if missing:
        raise ValueError(f"tasks.names {missing} not in the pool's tasks {sorted(present)}")
    unnamed = sorted(present - set(tasks.names))
    if unnamed:
        raise ValueError(f"the pool holds tasks {unnamed} that tasks.names does not list")
    owner_task = client_tasks(tasks, cfg.num_clients)
    num_tasks = len(tasks.names)
    owner = np.empty(len(pool), dtype=np.int64)
    for t, name in enumerate(tasks.names):
        clients = np.flatnonzero(owner_task == t)
        members = np.flatnonzero(column == name)
        for client, part in zip(clients, scheme_parts(pool, members, len(clients), cfg, rng)):
            owner[part] = client
    moving = np.flatnonzero(rng.random(len(pool)) < tasks.mix)
    home = owner_task[owner[moving]]
    for t in range(num_tasks):
        leaving = moving[home == t]
        others = np.flatnonzero(owner_task != t)
        owner[leaving] = others[rng.integers(len(others), size=len(leaving))]
    return [sorted_indices(np.flatnonzero(owner == k)) for k in range(cfg.num_clients)]

"""Data layer: task registry, GLUE and tabular loaders, metrics and client partitions."""

from .errors import DataError
from .examples import Example
from .glue import default_glue_dir, load_glue
from .metrics import compute_metrics, summarize
from .partition import (
    ClientSplit,
    label_histogram,
    make_clients,
    partition_dirichlet,
    partition_iid,
    split_train_test,
)
from .tables import load_table
from .tasks import TASKS, TaskSpec, custom_task, get_task

__all__ = [
    "TASKS",
    "ClientSplit",
    "DataError",
    "Example",
    "TaskSpec",
    "compute_metrics",
    "custom_task",
    "default_glue_dir",
    "get_task",
    "label_histogram",
    "load_glue",
    "load_table",
    "make_clients",
    "partition_dirichlet",
    "partition_iid",
    "split_train_test",
    "summarize",
]

"""Data layer: task registry, GLUE and tabular loaders, metrics and client partitions."""

from .errors import DataError
from .examples import Example
from .glue import default_glue_dir, load_glue
from .metrics import compute_metrics, summarize
from .partition import (
    REGRESSION_BINS,
    ClientSplit,
    Drift,
    PartitionPool,
    client_label_counts,
    label_histogram,
    make_clients,
    partition_dirichlet,
    partition_iid,
    partition_stats,
    plot_label_heatmap,
    regression_bin_names,
    split_train_test,
)
from .tables import load_chat_table, load_table, read_label_values, table_format
from .tasks import TASKS, TaskSpec, custom_task, get_task, infer_label_names

__all__ = [
    "REGRESSION_BINS",
    "TASKS",
    "ClientSplit",
    "DataError",
    "Drift",
    "Example",
    "PartitionPool",
    "TaskSpec",
    "client_label_counts",
    "compute_metrics",
    "custom_task",
    "default_glue_dir",
    "get_task",
    "infer_label_names",
    "label_histogram",
    "load_chat_table",
    "load_glue",
    "load_table",
    "make_clients",
    "partition_dirichlet",
    "partition_iid",
    "partition_stats",
    "plot_label_heatmap",
    "read_label_values",
    "regression_bin_names",
    "split_train_test",
    "summarize",
    "table_format",
]

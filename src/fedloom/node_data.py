"""A client's own data on its own machine (``runtime.client_data = "nodes"``).

In a deployment whose nodes hold their own data, a node reads only its client's examples,
from what ``fedloom join --data PATH`` names:

- a table file (JSONL, CSV or TSV with the config's ``data.text_fields`` and
  ``data.label_field``): the node carves its local test split from it, a seeded
  ``partition.test_fraction`` of the examples (seed ``(seed, client id)``), as the
  partitioner carves a simulated client's;
- a directory holding ``train.<ext>`` and ``test.<ext>``: the client's own test split.

Labels are read in the task's label space (a GLUE task's, or the config's
``data.label_names``); a label outside it is an error naming the file and line. The
validation split is carved from the training examples as in a simulation
(``partition.val_fraction``).

:func:`export_partition` writes a simulated partition's clients as such directories
(``fedloom partition CONFIG --export DIR``), so that a deployment can be tried on the
split a simulation used: a node reading its directory holds exactly the examples, in the
same order, that the simulated client held.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedloom.config import ConfigError, DataConfig
from fedloom.data import DataError, Example, TaskSpec, load_table, split_train_test
from fedloom.data.tables import TABLE_FORMATS

#: salt of a node's own test split (any fixed value; it keeps the split apart from other
#: seeded draws of the same client)
NODE_SPLIT_SALT = 0x0D47


@dataclass(frozen=True)
class NodeData:
    """Where the node of client ``client_id`` keeps its examples (``fedloom join --data``)."""

    client_id: int
    path: Path


def _table(path: Path, cfg: DataConfig, task: TaskSpec) -> list[Example]:
    examples = load_table(path, cfg.text_fields, cfg.label_field, task=task)
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def _split_file(folder: Path, split: str) -> Path:
    found = sorted(
        p for p in folder.iterdir() if p.stem == split and p.suffix.lower() in TABLE_FORMATS
    )
    if len(found) != 1:
        names = ", ".join(f"{split}{ext}" for ext in TABLE_FORMATS)
        what = "none" if not found else ", ".join(p.name for p in found)
        raise DataError(f"--data {folder}: a client's directory holds one of {names}; found {what}")
    return found[0]


def read_node_data(
    node: NodeData, cfg: DataConfig, task: TaskSpec, test_fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """Client ``node.client_id``'s (training, test) examples from ``node.path``."""
    path = node.path
    if path.is_dir():
        return (
            _table(_split_file(path, "train"), cfg, task),
            _table(_split_file(path, "test"), cfg, task),
        )
    if not path.is_file():
        raise DataError(f"--data {path}: no such file or directory")
    examples = _table(path, cfg, task)
    rng = np.random.default_rng([seed, node.client_id, NODE_SPLIT_SALT])
    train, test = split_train_test(np.arange(len(examples)), test_fraction, rng)
    return [examples[i] for i in train], [examples[i] for i in test]


def _record(example: Example, cfg: DataConfig, task: TaskSpec) -> dict[str, object]:
    texts = [example.text_a] + ([example.text_b] if example.text_b is not None else [])
    if len(texts) != len(cfg.text_fields):
        raise ConfigError(
            f"data.text_fields: {task.name}'s examples have {len(texts)} "
            f"text(s), {cfg.text_fields} names {len(cfg.text_fields)}; name one "
            f'field per text, e.g. ["sentence1", "sentence2"]'
        )
    label = task.label_names[int(example.label)] if task.label_names else float(example.label)
    return {**dict(zip(cfg.text_fields, texts)), cfg.label_field: label}


def export_partition(
    clients: dict[int, tuple[list[Example], list[Example]]],
    cfg: DataConfig,
    task: TaskSpec,
    out: Path,
) -> list[Path]:
    """Each client's (training, test) examples as ``out/client_<id>/{train,test}.jsonl``
    (fields ``data.text_fields`` and ``data.label_field``, labels by name); the folders."""
    folders = []
    for cid, splits in sorted(clients.items()):
        folder = out / f"client_{cid:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        for name, examples in zip(("train", "test"), splits, strict=True):
            lines = [json.dumps(_record(e, cfg, task), ensure_ascii=False) for e in examples]
            (folder / f"{name}.jsonl").write_text(
                "".join(x + "\n" for x in lines), encoding="utf-8"
            )
        folders.append(folder)
    return folders

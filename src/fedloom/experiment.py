"""Wires data, partition, model and algorithm from an :class:`ExperimentConfig`.

This is the library entry point: ``Experiment.build(cfg)`` then
``fedloom.runtime.local.simulate(experiment, run_dir)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedloom import algorithms
from fedloom.algorithms import Algorithm, AlgorithmError
from fedloom.config import ConfigError, DataConfig, ExperimentConfig
from fedloom.data import (
    DataError,
    Example,
    TaskSpec,
    custom_task,
    default_glue_dir,
    get_task,
    label_histogram,
    load_glue,
    load_table,
    make_clients,
)
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature


@dataclass
class ClientData:
    """One client's encoded local training and test splits."""

    client_id: int
    train: list[Feature]
    test: list[Feature]


def resolve_task(cfg: DataConfig) -> TaskSpec:
    if cfg.train_path is not None:
        try:
            return get_task(cfg.task)
        except ValueError:
            return custom_task(cfg.task, cfg.label_names)
    try:
        return get_task(cfg.task)
    except ValueError as err:
        raise ConfigError(f"data.task: {err}") from None


def glue_dir(cfg: DataConfig) -> Path | None:
    """The local GLUE directory (configured, or ../shared/data/glue); None means the hub."""
    if cfg.data_dir is None:
        return default_glue_dir()
    path = Path(cfg.data_dir)
    if not path.is_dir():
        raise ConfigError(f"data.data_dir: {path} is not a directory")
    return path


def load_split(cfg: DataConfig, task: TaskSpec, split: str) -> list[Example] | None:
    """Examples of ``split`` ("train"/"dev"); None when no dev data is configured."""
    if cfg.train_path is not None:
        path = cfg.train_path if split == "train" else cfg.dev_path
        if path is None:
            return None
        return load_table(path, cfg.text_fields, cfg.label_field, cfg.label_names)
    directory = glue_dir(cfg)
    if directory is not None and split == "train":
        task_dir = directory / task.name
        if not (task_dir / "train.tsv").is_file():
            have = sorted(p.name for p in directory.iterdir() if (p / "train.tsv").is_file())
            raise ConfigError(
                f"data.task: {task.name} is not in {directory} (it has: {', '.join(have)})"
            )
    return load_glue(task, split, directory)


def subsample(examples: list[Example], limit: int, seed: int) -> list[Example]:
    if limit == 0 or limit >= len(examples):
        return examples
    keep = np.sort(np.random.default_rng(seed).choice(len(examples), limit, replace=False))
    return [examples[i] for i in keep]


@dataclass
class Experiment:
    cfg: ExperimentConfig
    task: TaskSpec
    model: FedModel
    algorithm: Algorithm
    clients: list[ClientData]
    dev: list[Feature] | None
    label_counts: np.ndarray

    @classmethod
    def build(cls, cfg: ExperimentConfig) -> Experiment:
        try:
            algorithm = algorithms.create(cfg.algorithm.name, **cfg.algorithm.hyperparameters)
        except AlgorithmError as err:
            raise ConfigError(str(err)) from None
        task = resolve_task(cfg.data)
        try:
            train = load_split(cfg.data, task, "train")
            dev = load_split(cfg.data, task, "dev")
        except FileNotFoundError as err:
            raise DataError(str(err)) from None
        train = subsample(train, cfg.data.max_train_examples, cfg.seed)
        if dev is not None:
            dev = subsample(dev, cfg.data.max_dev_examples, cfg.seed + 1)
        part = cfg.partition
        labels = np.array([e.label for e in train])
        try:
            splits = make_clients(
                labels, part.scheme, part.num_clients, cfg.seed, part.test_fraction,
                alpha=part.alpha, min_size=part.min_size,
            )
        except ValueError as err:
            raise ConfigError(f"partition: {err}") from None
        try:
            model = FedModel.build(cfg.model, task, cfg.data.max_length, cfg.seed)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        features = model.encode(train)
        clients = [
            ClientData(
                s.client_id,
                [features[i] for i in s.train],
                [features[i] for i in s.test],
            )
            for s in splits
        ]
        counts = (
            label_histogram(labels, splits, task.num_labels)
            if not task.is_regression
            else np.array([[len(s.train)] for s in splits])
        )
        return cls(cfg, task, model, algorithm, clients,
                   model.encode(dev) if dev else None, counts)

    def parties(self) -> list[ClientData]:
        """Who trains: the clients, or one party holding all their training data."""
        if self.algorithm.pools_data:
            pooled = [f for c in self.clients for f in c.train]
            return [ClientData(0, pooled, [])]
        return self.clients

    def partition_stats(self) -> dict[str, object]:
        return {
            "scheme": self.cfg.partition.scheme,
            "label_names": list(self.task.label_names),
            "clients": [
                {
                    "client_id": c.client_id,
                    "train": len(c.train),
                    "test": len(c.test),
                    "label_counts": [int(x) for x in self.label_counts[i]],
                }
                for i, c in enumerate(self.clients)
            ],
        }

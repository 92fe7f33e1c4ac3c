"""The federation before any model exists: examples, their partition over clients, and
the statistics of that partition.

``FederatedData.build(cfg)`` loads the task (or, with ``partition.tasks``, several GLUE
tasks in one union label space), subsamples, sets FLTrust's root set aside (only with
``aggregation.rule = "fltrust"``), and partitions the rest with every configured skew.
``fedloom partition`` stops here; :class:`fedloom.experiment.Experiment` encodes the
clients' examples for a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from fedloom.client_mode import (
    DEV_MATCHED,
    DEV_WEIGHTED,
    SPLIT,
    why_not_dev_matched,
    why_not_dev_weighted,
)
from fedloom.config import ConfigError, DataConfig, ExperimentConfig
from fedloom.data import (
    TASKS,
    ClientSplit,
    DataError,
    Example,
    PartitionPool,
    TaskSpec,
    client_label_counts,
    custom_task,
    default_glue_dir,
    get_task,
    infer_label_names,
    load_chat_table,
    load_glue,
    load_table,
    make_clients,
    partition_stats,
    read_label_values,
    regression_bin_names,
)
from fedloom.data.generative_tasks import GENERATIVE_TASKS, get_generative_task
from fedloom.data.holdout import set_aside
from fedloom.data.tasks import generation_task
from fedloom.node_data import NodeData, read_node_data

T = TypeVar("T")

#: salt of the root set's permutation (any fixed value; it keeps the draw apart from the
#: other seeded draws of the experiment)
ROOT_SALT = 0xF1057


def scored_task(cfg: ExperimentConfig, task: TaskSpec) -> TaskSpec:
    """``task`` scored with ``eval.metrics`` where the config names them; checks that the
    ``eval.baselines`` apply to it."""
    if "majority" in cfg.eval.baselines and not task.has_classes:
        raise ConfigError(
            f'eval.baselines: "majority" predicts a class; {task.name} is a {task.kind} task'
        )
    if cfg.eval.metrics is None:
        return task
    try:
        return replace(task, metrics=tuple(cfg.eval.metrics))
    except ValueError as err:
        raise ConfigError(f"eval.metrics: {err}") from None


#: ``data.task`` of a generative task on your own files
GENERATION = "generation"


def is_generative(name: str) -> bool:
    """Whether ``data.task`` names a generative task: your own (``"generation"``) or a
    built-in one (:data:`fedloom.data.generative_tasks.GENERATIVE_TASKS`)."""
    return name.strip().lower() in (GENERATION, *GENERATIVE_TASKS)


def generative_task(cfg: DataConfig) -> TaskSpec:
    """The generative task of ``data``: a built-in one with its metrics, or
    ``"generation"`` on your own files (``data.train_path``, fields ``prompt_field`` and
    ``response_field``)."""
    if cfg.label_names is not None or cfg.label_type != "auto":
        key = "data.label_names" if cfg.label_names is not None else "data.label_type"
        raise ConfigError(f"{key}: generative task {cfg.task!r} has responses, not labels")
    if cfg.task.strip().lower() == GENERATION:
        if cfg.train_path is None:
            raise ConfigError(
                f'data.task: "{GENERATION}" trains on your own prompt/response files: set '
                f"data.train_path (or name a built-in generative task: "
                f"{', '.join(GENERATIVE_TASKS)})"
            )
        return generation_task(GENERATION)
    if cfg.train_path is not None:
        raise ConfigError(
            f'data.train_path: {cfg.task} reads its own data; for your files set data.task = "'
            f'{GENERATION}"'
        )
    if cfg.messages_field is not None:
        raise ConfigError(
            f"data.messages_field: {cfg.task} reads its own data; chat records are your "
            f'own files (data.task = "{GENERATION}")'
        )
    built_in = get_generative_task(cfg.task)
    return generation_task(built_in.name, built_in.metrics, built_in.main_metric)


def check_generative(cfg: ExperimentConfig, task: TaskSpec) -> None:
    """A :class:`ConfigError` naming the key of a partition that needs class labels, for a
    generative task (whose labels are responses): label skew (Dirichlet, shards, also as
    a temporal drift's target) and concept shift. Partitions by metadata, quantity, IID,
    sequence and time need no labels."""
    if not task.generative:
        return
    part = cfg.partition
    why = f"generative task {task.name} has responses, not classes"
    for key, scheme in (
        ("partition.scheme", part.scheme),
        ("partition.temporal.scheme", part.temporal.scheme if part.temporal else None),
    ):
        if scheme in ("dirichlet", "shards"):
            raise ConfigError(
                f'{key}: "{scheme}" skews the clients\' labels; {why} (use "iid", "feature" '
                f'with partition.feature = a metadata field, or "sequential")'
            )
    if part.concept is not None:
        raise ConfigError(f"partition.concept: a concept shift relabels classes; {why}")


def resolve_task(cfg: DataConfig, on_nodes: bool = False) -> TaskSpec:
    """The task of ``data``: a registered GLUE task, a generative one
    (:func:`generative_task`), or a custom one for JSONL/CSV files.

    A custom task's label space comes from ``data.label_names`` / ``data.label_type``, or
    is inferred from the training file (:func:`fedloom.data.tasks.infer_label_names`);
    a GLUE task keeps its own labels and refuses ``label_names`` that differ from them.
    ``on_nodes``: the clients' data are on their nodes (``runtime.client_data``), so a
    custom task's label space must be declared."""
    if is_generative(cfg.task):
        return generative_task(cfg)
    if cfg.messages_field is not None:
        raise ConfigError(
            f"data.messages_field: chat records are a generative task's data; task "
            f'{cfg.task!r} is not one (data.task = "{GENERATION}" for your own)'
        )
    try:
        glue = get_task(cfg.task)
    except ValueError as err:
        if on_nodes:
            if cfg.label_type != "number" and cfg.label_names is None:
                raise ConfigError(
                    f'data.label_names: with runtime.client_data = "nodes" no training file '
                    f"tells the labels of task {cfg.task!r}; declare data.label_names (or "
                    f'data.label_type = "number")'
                ) from None
            return custom_task(
                cfg.task, None if cfg.label_type == "number" else list(cfg.label_names or [])
            )
        if cfg.train_path is None:
            raise ConfigError(
                f"data.task: {err}; for data of your own set data.train_path "
                "(and name your task in data.task)"
            ) from None
        return custom_task(cfg.task, _custom_label_names(cfg))
    if cfg.label_names is not None and tuple(cfg.label_names) != glue.label_names:
        raise ConfigError(
            f"data.label_names: {cfg.label_names} are not {glue.name}'s labels "
            f"{list(glue.label_names) or '(a numeric score)'}; for a label set of your own, "
            f'give your task another name (data.task = "...")'
        )
    kind = "number" if glue.is_regression else "class"
    if cfg.label_type not in ("auto", kind):
        raise ConfigError(
            f"data.label_type: {glue.name} has {'a numeric label' if glue.is_regression else 'classes'}"
            f", not label_type = {cfg.label_type!r}"
        )
    return glue


def _custom_label_names(cfg: DataConfig) -> list[str] | None:
    """Class names of a custom task (None: a numeric label)."""
    if cfg.label_type == "number":
        return None
    if cfg.label_names is not None:
        return list(cfg.label_names)
    assert cfg.train_path is not None
    values = read_label_values(cfg.train_path, cfg.label_field)
    try:
        names = infer_label_names(values, cfg.label_type)
    except ValueError as err:
        raise DataError(f"{cfg.train_path}: labels in {cfg.label_field!r}: {err}") from None
    return None if names is None else list(names)


def resolved_data_config(cfg: DataConfig, task: TaskSpec) -> DataConfig:
    """``cfg`` with a custom task's label space written out (label_names, label_type), so
    that the run directory's config.toml describes the task without the training file."""
    if cfg.train_path is None or task.name in TASKS or task.generative:
        return cfg
    update = (
        {"label_names": None, "label_type": "number"}
        if task.is_regression
        else {"label_names": list(task.label_names), "label_type": "class"}
    )
    return cfg.model_copy(update=update)


def glue_dir(cfg: DataConfig) -> Path | None:
    """The local GLUE directory (configured, or ../shared/data/glue); None means the hub."""
    if cfg.data_dir is None:
        return default_glue_dir()
    path = Path(cfg.data_dir)
    if not path.is_dir():
        raise ConfigError(f"data.data_dir: {path} is not a directory")
    return path


def load_split(
    cfg: DataConfig, task: TaskSpec, split: str, key: str = "data.task", seed: int = 0
) -> list[Example] | None:
    """Examples of ``split`` ("train"/"dev"); None when no dev data is configured."""
    if task.generative:
        return _generative_split(cfg, task, split, seed)
    if split == "dev" and cfg.dev_path is not None:
        return load_table(cfg.dev_path, cfg.text_fields, cfg.label_field, task=task)
    if cfg.train_path is not None:
        path = cfg.train_path if split == "train" else cfg.dev_path
        if path is None:
            return None
        return load_table(path, cfg.text_fields, cfg.label_field, task=task)
    directory = glue_dir(cfg)
    if directory is not None and not any(
        (directory / folder / "train.tsv").is_file() for folder in (task.name, task.hub_config)
    ):
        if cfg.data_dir is None:
            directory = None  # not in the auto-found ../shared/data/glue (QQP, QNLI, MNLI): the hub
        elif split == "train":
            have = sorted(p.name for p in directory.iterdir() if (p / "train.tsv").is_file())
            raise ConfigError(
                f"{key}: {task.name} is not in {directory} (it has: {', '.join(have)})"
            )
    try:
        return load_glue(task, split, directory)
    except FileNotFoundError as err:
        raise DataError(str(err)) from None


def _generative_split(
    cfg: DataConfig, task: TaskSpec, split: str, seed: int
) -> list[Example] | None:
    """``split`` of a generative task: your own file (the prompt and response fields, or
    chat records), or a built-in task's split of ``data.data_dir`` (``../shared/data``, or
    the GLUE folder inside it; found beside the working directory by default), ``seed``
    drawing WordNet's held-out synsets."""
    if cfg.train_path is not None:
        path = cfg.train_path if split == "train" else cfg.dev_path
        if path is None:
            return None
        if cfg.messages_field is not None:
            return load_chat_table(path, cfg.messages_field)
        return load_table(path, [cfg.prompt_field], cfg.response_field, task=task)
    glue = glue_dir(cfg)
    if glue is None:
        raise ConfigError(
            f"data.data_dir: {task.name} reads ../shared/data (WordNet, GLUE), which is not "
            f"there; set data.data_dir to that folder"
        )
    built_in = get_generative_task(task.name)
    # data.data_dir: shared/data (wordnet/, glue/), or the GLUE folder inside it
    root = glue if (glue / built_in.data_subdir).is_dir() else glue.parent
    try:
        train, dev = built_in.load(root, seed)
    except FileNotFoundError as err:
        raise DataError(str(err)) from None
    return train if split == "train" else dev


def subsample(examples: list[Example], limit: int, seed: int) -> list[Example]:
    """A seeded subset of ``limit`` examples in their original order (0: all)."""
    if limit == 0 or limit >= len(examples):
        return examples
    keep = np.sort(np.random.default_rng(seed).choice(len(examples), limit, replace=False))
    return [examples[i] for i in keep]


def union_task(tasks: Sequence[TaskSpec]) -> TaskSpec:
    """One classification task whose labels are every task's labels, ``TASK/label``.

    A client holding several tasks trains one head over this union; by default its inputs
    carry the task name as a prefix (:func:`tag_example`), so the shared model knows which
    task an input belongs to (the text-to-text multi-task recipe of Raffel et al. 2020, T5).
    """
    names = [f"{t.name}/{label}" for t in tasks for label in t.label_names]
    words = [w for t in tasks for w in t.verbalizer]
    return custom_task(
        "+".join(t.name for t in tasks),
        names,
        metrics=("accuracy",),
        verbalizer=words,
        question="Answer the question of the task named at the start of the input.",
    )


def tag_example(example: Example, task: TaskSpec, offset: int, prefix: bool = True) -> Example:
    """``example`` in the union label space, prefixed with its task's name if ``prefix``."""
    return Example(
        text_a=f"{task.name}: {example.text_a}" if prefix else example.text_a,
        text_b=example.text_b,
        label=int(example.label) + offset,
        meta={**example.meta, "task": task.name},
    )


def _is_glue(name: str) -> bool:
    try:
        get_task(name)
    except ValueError:
        return False
    return True


def public_texts(cfg: ExperimentConfig, count: int) -> list[str]:
    """``count`` training sentences of the federation's task(s) that no client holds (the
    training examples outside the seeded pool ``data.max_train_examples`` draws), a seeded
    sample in file order: public text for aligning backbones. Sentence pairs are joined
    with a space. A :class:`ConfigError` when there are fewer than ``count``."""
    names = cfg.partition.tasks.names if cfg.partition.tasks else [cfg.data.task]
    if cfg.data.train_path is not None or not all(map(_is_glue, names)):
        raise ConfigError(
            "model.alignment: public text comes from GLUE training files, "
            "not data of your own; set model.alignment.texts = 0 to share "
            "PQ-LoRA across backbones unaligned"
        )
    outside: list[Example] = []
    for i, name in enumerate(names):
        task = get_task(name)
        full = load_split(cfg.data, task, "train") or []
        seed = cfg.seed + 7919 * i if cfg.partition.tasks else cfg.seed
        pooled = {id(e) for e in subsample(full, cfg.data.max_train_examples, seed)}
        outside += [e for e in full if id(e) not in pooled]
    if len(outside) < count:
        raise ConfigError(
            f"model.alignment.texts: {count} public sentences wanted, but only "
            f"{len(outside)} training examples lie outside the clients' pool "
            "(lower data.max_train_examples or model.alignment.texts)"
        )
    keep = np.sort(
        np.random.default_rng([cfg.seed, 0xA11]).choice(len(outside), count, replace=False)
    )
    return [" ".join(t for t in (outside[j].text_a, outside[j].text_b) if t) for j in keep]


def union_generative_task(names: Sequence[str]) -> TaskSpec:
    """One generative task over the built-in generative tasks ``names``: every task's
    metrics (the first task's main metric first), so each client is scored on all."""
    tasks = [get_generative_task(name) for name in names]
    metrics = list(dict.fromkeys(m for t in tasks for m in (t.main_metric, *t.metrics)))
    return generation_task("+".join(t.name for t in tasks), metrics, tasks[0].main_metric)


def multi_task(names: Sequence[str]) -> TaskSpec:
    """The task of ``partition.tasks.names``: the GLUE tasks' union label space
    (:func:`union_task`), or the built-in generative tasks' union
    (:func:`union_generative_task`); a :class:`ConfigError` for a mix of both or an
    unknown name."""
    generative = [is_generative(name) and name != GENERATION for name in names]
    if all(generative):
        return union_generative_task(names)
    if any(generative):
        raise ConfigError(
            "partition.tasks.names: generative and classification tasks do not mix in one "
            "federation (a generative one asks each classification task as *-generate)"
        )
    try:
        return union_task([get_task(name) for name in names])
    except ValueError as err:
        raise ConfigError(f"partition.tasks.names: {err}") from None


def _load_generative_tasks(
    cfg: ExperimentConfig,
) -> tuple[TaskSpec, list[Example], list[Example] | None]:
    """The built-in generative tasks of ``partition.tasks.names`` in one pool, each example
    tagged with its task (``meta["task"]``, and its prompt prefixed with the task's name
    when ``partition.tasks.prefix``)."""
    assert cfg.partition.tasks is not None
    names, prefix = cfg.partition.tasks.names, cfg.partition.tasks.prefix
    train: list[Example] = []
    dev: list[Example] = []
    for i, name in enumerate(names):
        own = cfg.data.model_copy(update={"task": name})
        spec = generative_task(own)
        own_train = _generative_split(own, spec, "train", cfg.seed) or []
        own_dev = _generative_split(own, spec, "dev", cfg.seed) or []
        for pool, examples, salt in ((train, own_train, 0), (dev, own_dev, 1)):
            limit = cfg.data.max_train_examples if salt == 0 else cfg.data.max_dev_examples
            pool += [
                replace(
                    e,
                    text_a=f"{spec.name}: {e.text_a}" if prefix else e.text_a,
                    meta={**e.meta, "task": spec.name},
                )
                for e in subsample(examples, limit, cfg.seed + 7919 * i + salt)
            ]
    return multi_task(names), train, dev or None


def _load_tasks(cfg: ExperimentConfig) -> tuple[TaskSpec, list[Example], list[Example] | None]:
    assert cfg.partition.tasks is not None
    if cfg.data.train_path is not None:
        raise ConfigError(
            "partition.tasks: task heterogeneity needs built-in tasks, not data.train_path"
        )
    if multi_task(cfg.partition.tasks.names).generative:
        return _load_generative_tasks(cfg)
    specs: list[TaskSpec] = []
    for name in cfg.partition.tasks.names:
        try:
            spec = get_task(name)
        except ValueError as err:
            raise ConfigError(f"partition.tasks.names: {err}") from None
        if spec.is_regression:
            raise ConfigError(
                f"partition.tasks.names: {spec.name} is a regression task; "
                "the union label space needs classification tasks"
            )
        specs.append(spec)
    train: list[Example] = []
    dev: list[Example] = []
    offset = 0
    for i, spec in enumerate(specs):
        own_train = load_split(cfg.data, spec, "train", key="partition.tasks.names") or []
        own_dev = load_split(cfg.data, spec, "dev", key="partition.tasks.names") or []
        own_train = subsample(own_train, cfg.data.max_train_examples, cfg.seed + 7919 * i)
        own_dev = subsample(own_dev, cfg.data.max_dev_examples, cfg.seed + 7919 * i + 1)
        prefix = cfg.partition.tasks.prefix
        train += [tag_example(e, spec, offset, prefix) for e in own_train]
        dev += [tag_example(e, spec, offset, prefix) for e in own_dev]
        offset += spec.num_labels
    return union_task(specs), train, dev or None


def carve_root(cfg: ExperimentConfig, train: list[Example]) -> tuple[list[Example], list[Example]]:
    """(the clients' pool, FLTrust's root set D0): ``aggregation.root_size`` of the training
    examples set aside by a permutation seeded with the experiment's seed, before the
    partition, so that no client holds a root example; nothing set aside for any other
    rule, whose pool stays the whole training set (nor for a ``root_examples`` < 1, which
    the rule refuses). A :class:`ConfigError` when the root set leaves fewer examples than
    clients."""
    size = cfg.aggregation.root_size
    if size < 1:
        return train, []
    clients = cfg.partition.num_clients
    if len(train) - size < clients:
        raise ConfigError(
            f"aggregation.root_examples: a root set of {size} examples leaves "
            f"{max(0, len(train) - size)} of the task's {len(train)} training examples for "
            f"the {clients} clients (raise data.max_train_examples or lower root_examples)"
        )
    return set_aside(train, size, (cfg.seed, ROOT_SALT))


def resolve_client_mode(cfg: ExperimentConfig, task: TaskSpec, dev: list[Example] | None) -> str:
    """``eval.client_mode`` for this federation: "auto" becomes "dev_weighted" where label
    weights describe the clients, "dev_matched" for a generative task split by a metadata
    field with a dev set, else "split"; an explicit mode that cannot describe the clients is
    a ConfigError naming the reason."""
    reason = why_not_dev_weighted(
        kind=task.kind,
        has_dev=bool(dev),
        scheme=cfg.partition.scheme,
        temporal=cfg.partition.temporal is not None,
    )
    part = cfg.partition
    matched = why_not_dev_matched(
        has_dev=bool(dev) and all(part.feature in e.meta for e in dev or []),
        scheme=part.scheme,
        feature=part.feature,
        temporal=part.temporal is not None,
    ) or (
        "under concept shift a client labels the dev examples its own way"
        if part.concept is not None
        else None
    )
    if cfg.eval.client_mode == "auto":
        if not reason:
            return DEV_WEIGHTED
        return DEV_MATCHED if task.generative and not matched else SPLIT
    if cfg.eval.client_mode == DEV_MATCHED and matched:
        raise ConfigError(
            f'eval.client_mode: "dev_matched" does not describe these clients: {matched} '
            f'(or the dev set lacks partition.feature = {part.feature!r}); use "split"'
        )
    if cfg.eval.client_mode == DEV_WEIGHTED and reason:
        raise ConfigError(
            f'eval.client_mode: "dev_weighted" does not describe these clients: '
            f'{reason}; use "split"'
        )
    return cfg.eval.client_mode


def relabel(example: Example, label_map: np.ndarray | None) -> Example:
    """The example as a concept-shifted client labels it (``y -> label_map[y]``)."""
    if label_map is None:
        return example
    return replace(example, label=int(label_map[int(example.label)]))


@dataclass
class FederatedData:
    """Pooled examples, the partition over clients, and the dev set."""

    cfg: ExperimentConfig
    task: TaskSpec
    train: list[Example]
    dev: list[Example] | None
    pool: PartitionPool
    splits: list[ClientSplit]
    #: what a client's test score is: "split" or "dev_weighted" (``eval.client_mode`` resolved)
    client_mode: str = SPLIT
    #: FLTrust's root set, the server's own clean examples (:func:`carve_root`); else empty
    root: list[Example] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: ExperimentConfig, node: NodeData | None = None) -> FederatedData:
        """The federation of ``cfg``; under ``runtime.client_data = "nodes"`` the server's
        side (``node`` None: the task and the dev set, no client) or one node's (its own
        client's examples from ``node.path``, nothing else)."""
        if cfg.runtime.client_data == "nodes":
            return cls._on_nodes(cfg, node)
        if cfg.partition.tasks is not None:
            task, train, dev = _load_tasks(cfg)
            check_generative(cfg, task)
        else:
            task = resolve_task(cfg.data)
            check_generative(cfg, task)
            cfg = cfg.model_copy(update={"data": resolved_data_config(cfg.data, task)})
            train = subsample(
                load_split(cfg.data, task, "train", seed=cfg.seed) or [],
                cfg.data.max_train_examples,
                cfg.seed,
            )
            dev = load_split(cfg.data, task, "dev", seed=cfg.seed)
            if dev is not None:
                dev = subsample(dev, cfg.data.max_dev_examples, cfg.seed + 1)
        if not train:
            raise DataError(f"data: no training examples for {task.name}")
        train, root = carve_root(cfg, train)
        pool = PartitionPool.from_examples(train)
        try:
            splits = make_clients(pool, cfg.partition, cfg.seed)
        except ValueError as err:
            raise ConfigError(f"partition: {err}") from None
        task = scored_task(cfg, task)
        mode = resolve_client_mode(cfg, task, dev)
        return cls(cfg, task, train, dev, pool, splits, mode, root)

    @classmethod
    def _on_nodes(cls, cfg: ExperimentConfig, node: NodeData | None) -> FederatedData:
        task = scored_task(cfg, resolve_task(cfg.data, on_nodes=True))
        if node is None:
            dev = load_split(cfg.data, task, "dev") if cfg.eval.dev else None
            dev = None if dev is None else subsample(dev, cfg.data.max_dev_examples, cfg.seed + 1)
            return cls(cfg, task, [], dev, PartitionPool.from_examples([]), [], SPLIT)
        train, test = read_node_data(node, cfg.data, task, cfg.partition.test_fraction, cfg.seed)
        n = len(train)
        split = ClientSplit(
            node.client_id,
            np.arange(n, dtype=np.int64),
            np.arange(n, n + len(test), dtype=np.int64),
        )
        return cls(
            cfg, task, train + test, None, PartitionPool.from_examples(train + test), [split], SPLIT
        )

    @property
    def on_nodes(self) -> bool:
        """Whether the clients' data are on their own nodes (none of it here, on the server)."""
        return self.cfg.runtime.client_data == "nodes"

    @property
    def label_names(self) -> tuple[str, ...]:
        """Class names, the score ranges of the quantile bins of a regression task, or
        ``("response",)``, a generative task's one class."""
        if self.task.generative:
            return ("response",)
        return self.task.label_names or tuple(regression_bin_names(self.pool.labels))

    def dev_matched(self, split: ClientSplit, dev: Sequence[T]) -> list[T]:
        """The entries of ``dev`` (the dev set, or its encoding, in the same order) whose
        example's value of ``partition.feature`` is among ``split``'s training values."""
        feature = self.cfg.partition.feature
        assert feature is not None and self.dev is not None
        values = set(self.pool.column(feature)[split.train].tolist())
        return [d for d, e in zip(dev, self.dev, strict=True) if e.meta.get(feature) in values]

    def examples(self, split: ClientSplit, indices: np.ndarray) -> list[Example]:
        """The pool examples at ``indices`` as ``split``'s client labels them."""
        return [relabel(self.train[i], split.label_map) for i in indices]

    def label_counts(self, round_: int = 0) -> np.ndarray:
        """Clients x labels: each client's training labels as it sees them at ``round_``."""
        return client_label_counts(self.pool, self.splits, len(self.label_names), round_)

    def stats(self, round_: int = 0) -> dict[str, Any]:
        if self.on_nodes:
            return {
                "client_data": "nodes",
                "num_clients": self.cfg.partition.num_clients,
                "label_names": list(self.label_names),
            }
        return partition_stats(
            self.pool, self.splits, self.label_names, round_, cfg=self.cfg.partition
        )

"""Wires data, partition, model and algorithm from an :class:`ExperimentConfig`.

This is the library entry point: ``Experiment.build(cfg)`` then
``fedloom.server.simulate(experiment, run_dir)``. The data side (loading and
partitioning) is :mod:`fedloom.federation`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedloom import algorithms, transforms
from fedloom.algorithms import Algorithm
from fedloom.algorithms.aggregation_rule import AggregationRule, RuleName, averages, with_rule
from fedloom.attacks import Attack, check_attack, operator_of
from fedloom.composition import Keyed, check_composition
from fedloom.config import AggregationConfig, ConfigError, ExperimentConfig
from fedloom.data import ClientSplit, TaskSpec
from fedloom.data.holdout import hold_out
from fedloom.device import DeviceError, describe, resolve_device, set_tf32
from fedloom.federation import FederatedData
from fedloom.models import label_prior
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import ClassifierHead, Feature
from fedloom.node_data import NodeData
from fedloom.privacy import client_level, sample_level
from fedloom.secagg import settings as secure
from fedloom.transforms import Chain


@dataclass
class ClientData:
    """One client's encoded local training and test splits (as of round 0).

    A drifting client (``partition.temporal``) also keeps ``view``, its encoding of every
    pool example it may hold, and :meth:`at` gives its splits at a later round."""

    client_id: int
    train: list[Feature]
    test: list[Feature]
    split: ClientSplit | None = None
    view: dict[int, Feature] | None = None
    #: a validation split carved from the training split (``partition.val_fraction``),
    #: for choosing hyperparameters without touching the test split
    val: list[Feature] = field(default_factory=list)

    def at(self, round_: int) -> ClientData:
        """The client's data during ``round_`` (1-based); itself unless it drifts."""
        if self.split is None or self.split.drift is None or self.view is None:
            return self
        return ClientData(
            self.client_id,
            [self.view[i] for i in self.split.train_at(round_)],
            [self.view[i] for i in self.split.test_at(round_)],
        )


def _encode_clients(
    data: FederatedData, model: FedModel, ids: set[int] | None = None
) -> list[ClientData]:
    """Encode every pool example some client holds once (a client's whole view: its
    splits and, when it drifts, its target's); clients that relabel (concept shift) get
    their own encoding. ``ids``: only these clients (default: all)."""
    splits = [s for s in data.splits if ids is None or s.client_id in ids]
    views = {
        s.client_id: np.concatenate(
            [s.train, s.test] + ([s.drift.target_train, s.drift.target_test] if s.drift else [])
        )
        for s in splits
    }
    attack = Attack.from_config(data.cfg)  # a data-poisoning attacker encodes its own view
    own = {s.client_id for s in splits if s.label_map is not None or attack.poisons(s.client_id)}
    held = np.unique(
        np.concatenate(
            [np.empty(0, np.int64)] + [views[s.client_id] for s in splits if s.client_id not in own]
        )
    ).tolist()
    pooled = dict(zip(held, model.encode([data.train[i] for i in held])))
    clients = []
    for split in splits:
        indices = views[split.client_id]
        if split.client_id not in own:
            view = {int(i): pooled[int(i)] for i in indices}
        else:
            examples = attack.poison_split(split, indices, data.examples(split, indices), data.task)
            view = dict(zip(map(int, indices), model.encode(examples)))
        train, val = hold_out(
            [view[int(i)] for i in split.train],
            data.cfg.partition.val_fraction,
            (data.cfg.seed + split.client_id, VALIDATION_SALT),
        )
        clients.append(
            ClientData(
                split.client_id,
                train,
                [view[int(i)] for i in split.test],
                split=split,
                view=view if split.drift else None,
                val=val,
            )
        )
    return clients


#: salt of the validation split's permutation (any fixed value; it keeps the split apart
#: from other seeded draws of the same client)
VALIDATION_SALT = 0x7A1


def build_algorithm(cfg: ExperimentConfig) -> Algorithm:
    """``cfg``'s algorithm, its hyperparameters checked by type, against the federation
    (:meth:`Algorithm.check_federation`, e.g. Krum's n > 2f + 2, FedU's graph over the K
    clients, IFCA's k clusters seeded from the first round's clients) and against the
    training settings (:meth:`Algorithm.check_training`, e.g. L2GD's θ = lr·λ(1−p)/p ≤ 1),
    and every piece of the experiment against the others
    (:func:`fedloom.composition.check_composition`). Cheap: no data, no model; a mistake
    is a :class:`ConfigError` naming the key."""
    try:
        algorithm = algorithms.create(cfg.algorithm.name, **cfg.algorithm.hyperparameters)
        algorithm = _with_aggregation(algorithm, cfg.aggregation)
        if client_level.on(cfg):
            client_level.check(cfg)
        if sample_level.on(cfg):
            sample_level.check(cfg, algorithm)
        check_composition(
            keyed_chain(cfg, algorithm),
            algorithm,
            algorithm.rule if averages(algorithm) else None,
            operator_of(cfg),
            cfg.faults,
            cfg.runtime,
        )
        if client_level.on(cfg):
            algorithm = client_level.uniform(algorithm)
        secure.check(cfg, algorithm)
        if not algorithm.pools_data:
            algorithm.check_federation(cfg.clients_per_round, cfg.partition.num_clients)
        algorithm.check_training(cfg.train)
        check_attack(cfg)
    except ValueError as err:  # AlgorithmError included
        raise ConfigError(str(err)) from None
    check_personal_on_nodes(cfg, algorithm)
    return algorithm


def check_personal_on_nodes(cfg: ExperimentConfig, algorithm: Algorithm) -> None:
    """On Flower a personalized client's adapter stays on its node: what would need it at
    the server (Self / Others, ``eval.others``) is refused, a :class:`ConfigError`."""
    if cfg.runtime.name == "flower" and algorithm.personalized and cfg.eval.others != "never":
        raise ConfigError(
            f"eval.others: Self / Others scores each client's personal adapter at the "
            f'server; with runtime.name = "flower", {algorithm.name}\'s personal adapters '
            f'stay on their nodes (use "never"; Self / Others is simulation-only)'
        )


def pooled_party_ids(cfg: ExperimentConfig) -> list[int]:
    """The parties of a method that pools the data (centralized training): one per backbone,
    each holding the training data of that backbone's clients (the data of a client of
    another backbone is encoded for another model), named by its backbone's first client."""
    first: dict[str, int] = {}
    for client_id in range(cfg.partition.num_clients):
        first.setdefault(cfg.model.backbone_of(client_id), client_id)
    return sorted(first.values())


def transform_chain(cfg: ExperimentConfig, algorithm: Algorithm | None = None) -> Chain:
    """``cfg``'s transform chain: ``[[transforms]]`` with the stages ``[privacy]``
    (:mod:`fedloom.privacy.client_level`) and ``[secagg]`` (:mod:`fedloom.secagg.settings`,
    weighting the clients as ``algorithm`` does) add, each at its stage."""
    return Chain(tuple(stage.transform for stage in keyed_chain(cfg, algorithm)))


def keyed_chain(cfg: ExperimentConfig, algorithm: Algorithm | None = None) -> list[Keyed]:
    """:func:`transform_chain`'s stages in order, each with the setting that put it there:
    ``transforms[i].name`` for the i-th ``[[transforms]]`` table, ``privacy.level`` for
    DP-FedAvg's clip stage (whose server half ``privacy.noise`` decides),
    ``privacy.noise`` for its noise stage, ``secagg.protocol`` for the mask stage."""
    p, weighting = cfg.privacy, getattr(algorithm, "weighting", "examples")
    added = [
        Keyed(t, "privacy.noise", p.noise)
        if t.stage == "noise"
        else Keyed(t, "privacy.level", p.level, ("privacy.noise", p.noise))
        for t in client_level.transforms(cfg)
    ]
    added += [
        Keyed(t, "secagg.protocol", cfg.secagg.protocol) for t in secure.transforms(cfg, weighting)
    ]
    chain = transforms.chain(
        [t.settings for t in cfg.transforms], [k.transform for k in added], seed=cfg.seed
    )
    by_section = {id(k.transform): k for k in added}
    tables = iter(enumerate(cfg.transforms))  # the chain keeps the tables' order
    out = []
    for t in chain.transforms:
        if id(t) in by_section:
            out.append(by_section[id(t)])
        else:
            i, table = next(tables)
            out.append(Keyed(t, f"transforms[{i}].name", table.name))
    return out


def _with_aggregation(algorithm: Algorithm, section: AggregationConfig) -> Algorithm:
    """``algorithm`` with ``[aggregation]``'s rule: its own rule (the mean, or the one its
    name is) unless ``rule`` names another, which only an algorithm named for no rule may
    take."""
    own: RuleName = algorithm.rule.name if averages(algorithm) else "mean"
    if section.rule is not None and section.rule != own and own != "mean":
        raise ValueError(
            f"aggregation.rule: algorithm.name = {algorithm.name!r} is FedAvg with "
            f"the {own} rule; for {section.rule!r} use algorithm.name = 'fedavg'"
        )
    return with_rule(
        algorithm,
        AggregationRule(
            section.rule or own,
            section.beta,
            section.num_malicious_nodes,
            section.num_nodes_to_select,
            section.max_norm,
            section.clip_radius,
            section.clip_iterations,
            section.root_examples,
        ),
    )


def anchor_of(models: dict[str, FedModel]) -> str:
    """The anchor of a mixed federation: the backbone with the fewest parameters."""
    return min(models, key=lambda b: models[b].backbone_size)


def alignment_cache(cfg: ExperimentConfig) -> Path:
    """Where fitted PQ-LoRA alignments are kept between runs: ``<output_dir>/.alignment``."""
    return Path(cfg.output_dir) / ".alignment"


def align_backbones(cfg: ExperimentConfig, models: dict[str, FedModel], cache: Path) -> list[str]:
    """Align the mosaic models' PQ-LoRA factors with the anchor's
    (:mod:`fedloom.models.aligned_pq`), reusing fits in ``cache``; the fits' file names.
    Nothing without mosaic adapters or with ``model.alignment.texts = 0``. Every backbone
    must have the same rank and the same number of PQ-LoRA blocks (a :class:`ConfigError`)."""
    if cfg.model.adapters != "mosaic" or not cfg.model.alignment.texts:
        return []
    from fedloom.federation import public_texts
    from fedloom.models.aligned_pq import align_models, shared_pq_blocks

    ranks = {b: cfg.model.for_backbone(b).lora.r for b in models}
    if len(set(ranks.values())) > 1:
        raise ConfigError(
            f"model.groups: PQ-LoRA shared across backbones needs one LoRA rank, got {ranks}"
        )
    try:
        blocks = shared_pq_blocks(models, cfg.model.lora.pq_blocks)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    texts = public_texts(cfg, cfg.model.alignment.texts)
    return align_models(
        models,
        anchor_of(models),
        texts,
        cfg.model.alignment,
        next(iter(ranks.values())),
        blocks,
        cfg.seed,
        cache,
    )


def backbones(cfg: ExperimentConfig) -> list[str]:
    """Every backbone some client runs, [model]'s first when any client runs it."""
    grouped = {c for g in cfg.model.groups for c in g.clients}
    own = [cfg.model.backbone] if len(grouped) < cfg.partition.num_clients else []
    return own + [g.backbone for g in cfg.model.groups]


def _build_model(
    cfg: ExperimentConfig, backbone: str, task: TaskSpec, device: torch.device
) -> FedModel:
    """The model of ``backbone``'s clients on ``device``; a mistake is a :class:`ConfigError`."""
    try:
        return FedModel.build(
            cfg.model.for_backbone(backbone),
            task,
            cfg.data.max_length,
            cfg.seed,
            device,
            truncate_responses=cfg.data.truncate_responses,
            generation=cfg.eval.generation,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_classifier(algorithm: Algorithm, model: FedModel) -> None:
    """A method that moves logits by label counts needs a classifier over classes: a
    :class:`ConfigError` naming the method otherwise."""
    try:
        label_prior.classifier(model)
    except ValueError as err:
        raise ConfigError(f"algorithm.name: {algorithm.name} needs label counts; {err}") from None


def run_device(cfg: ExperimentConfig) -> torch.device:
    """``train.device`` resolved on this machine, TF32 set as ``train.tf32`` says; a device
    this machine lacks is a :class:`ConfigError` naming the key."""
    try:
        device = resolve_device(cfg.train.device)
    except DeviceError as err:
        raise ConfigError(str(err)) from None
    set_tf32(device, cfg.train.tf32)
    return device


def check_model(algorithm: Algorithm, model: FedModel) -> None:
    """``algorithm``'s hyperparameters checked against ``model``'s adapter
    (:meth:`Algorithm.check_model`, e.g. a personal name pattern that selects no tensor);
    a mistake is a :class:`ConfigError` naming the key."""
    try:
        algorithm.check_model(model.initial_params)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_chain(cfg: ExperimentConfig, algorithm: Algorithm, model: FedModel) -> None:
    """The transform chain checked against what ``algorithm`` sends of ``model``'s adapter
    (:meth:`Transform.check_model`: a compressor on a personal tensor, k > d); a mistake is
    a :class:`ConfigError` naming ``transforms[i].key``."""
    chain = transform_chain(cfg, algorithm)
    if not chain.transforms or cfg.model.groups or cfg.model.ranks:
        return
    initial = model.initial_params
    shared = algorithm.init(initial).global_params
    personal = [
        n for n in initial if n not in shared and not any(s.endswith("/" + n) for s in shared)
    ]
    names = [t.name for t in cfg.transforms]
    for t in chain.transforms:
        try:
            t.check_model(shared, personal)
        except ValueError as err:
            where = f"transforms[{names.index(t.name)}]" if t.name in names else "privacy"
            raise ConfigError(f"{where}.{err}") from None


def check_secure_weights(
    cfg: ExperimentConfig, algorithm: Algorithm, clients: list[ClientData]
) -> None:
    """``[secagg]``'s bits against the clients' training examples, the weights it sums
    (:func:`fedloom.secagg.settings.check_weights`; a drifting client's most over the
    rounds); a mistake is a :class:`ConfigError` naming ``secagg.bits``."""
    rounds = range(1, cfg.federation.rounds + 1)
    examples = [max(len(c.at(r).train) for r in rounds) for c in clients]
    try:
        secure.check_weights(cfg, algorithm, examples)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def with_model_for(algorithm: Algorithm, cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with the adapter structure ``algorithm`` is defined on: a method built on
    dual or mosaic adapters gets that ``model.adapters`` (recorded in the run's config),
    unless the config asks for another structure explicitly, which is an error."""
    wanted = algorithm.adapter_model
    if wanted is None or cfg.model.adapters == wanted:
        return cfg
    if "adapters" in cfg.model.model_fields_set:
        raise ConfigError(
            f"model.adapters: algorithm {algorithm.name} needs the {wanted}-adapter model "
            f'(adapters = "{wanted}", or leave it unset), not {cfg.model.adapters!r}'
        )
    model = cfg.model.model_copy(update={"adapters": wanted})
    return cfg.model_copy(update={"model": model})


@dataclass
class Experiment:
    """Everything a run needs. A mixed-backbone federation (``[[model.groups]]``) has one
    model per backbone in ``models``, its clients encoded by their own model, and the dev
    set encoded by each (``devs``); ``model`` and ``dev`` are then the first backbone's.
    :meth:`cohorts` splits it into single-backbone experiments."""

    cfg: ExperimentConfig
    data: FederatedData
    model: FedModel
    algorithm: Algorithm
    clients: list[ClientData]
    dev: list[Feature] | None
    models: dict[str, FedModel] = field(default_factory=dict)
    devs: dict[str, list[Feature] | None] = field(default_factory=dict)
    #: a spanning algorithm's anchor backbone in a mixed federation (the smallest) and every
    #: client's training data encoded for it
    anchor: str | None = None
    anchor_train: dict[int, list[Feature]] = field(default_factory=dict)
    #: the PQ-LoRA alignments installed (file names under ``alignment_cache``)
    alignment: list[str] = field(default_factory=list)
    #: FLTrust's root set (``FederatedData.root``) encoded by each backbone; else empty
    root: dict[str, list[Feature]] = field(default_factory=dict)

    @functools.cached_property
    def chain(self) -> Chain:
        """The transform chain on what travels (``[[transforms]]``)."""
        return transform_chain(self.cfg, self.algorithm)

    @functools.cached_property
    def attack(self) -> Attack:
        """The simulated Byzantine clients (``[attack]``, :mod:`fedloom.attacks`)."""
        return Attack.from_config(self.cfg, self.algorithm)

    @classmethod
    def build(cls, cfg: ExperimentConfig, node: NodeData | None = None) -> Experiment:
        """The experiment of ``cfg``. Under ``runtime.client_data = "nodes"``: the server's
        (``node`` None), whose clients hold no data here, or the node's of ``node``, which
        holds that one client's data (:mod:`fedloom.node_data`)."""
        device = run_device(cfg)  # first: a missing GPU is said before any data is read
        algorithm = build_algorithm(cfg)
        if cfg.model.ranks and not algorithm.mixed_ranks:
            raise ConfigError(
                f"model.ranks: {algorithm.name} is not defined on per-client "
                f"LoRA ranks; methods that are: {', '.join(algorithms.registry.rank_methods())}"
            )
        cfg = with_model_for(algorithm, cfg)
        data = FederatedData.build(cfg, node)
        if algorithm.needs_classes and not data.task.has_classes:
            raise ConfigError(
                f"algorithm.name: {algorithm.name} needs class labels; task "
                f"{data.task.name} is a {data.task.kind} task"
            )
        try:
            check_attack(cfg, data.task)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        models = {b: _build_model(cfg, b, data.task, device) for b in backbones(cfg)}
        if "zero_shot" in cfg.eval.baselines and any(
            isinstance(m.head, ClassifierHead) for m in models.values()
        ):
            raise ConfigError(
                'eval.baselines: "zero_shot" scores a causal LM without adapters; an '
                "encoder's classifier head is untrained until the run trains it"
            )
        for model in models.values():
            if algorithm.adjusts_logits:
                _check_classifier(algorithm, model)
            check_model(algorithm, model)
            check_chain(cfg, algorithm, model)
        backbone_of = {s.client_id: cfg.model.backbone_of(s.client_id) for s in data.splits}
        clients = sorted(
            (
                c
                for b, model in models.items()
                for c in _encode_clients(data, model, {i for i, x in backbone_of.items() if x == b})
            ),
            key=lambda c: c.client_id,
        )
        if not data.on_nodes:  # on their own nodes the clients' examples are not known here
            check_secure_weights(cfg, algorithm, clients)
        if data.on_nodes and node is None:  # the server: every client, its data elsewhere
            clients = [ClientData(cid, [], []) for cid in range(cfg.partition.num_clients)]
        devs = {b: model.encode(data.dev) if data.dev else None for b, model in models.items()}
        root = {b: model.encode(data.root) for b, model in models.items()} if data.root else {}
        first = next(iter(models))
        anchor, anchor_train, alignment = None, {}, []
        if len(models) > 1 and algorithm.spans_backbones:
            anchor = anchor_of(models)
            anchor_train = {c.client_id: c.train for c in _encode_clients(data, models[anchor])}
            alignment = align_backbones(cfg, models, alignment_cache(cfg))
        # data.cfg: the config with a custom task's inferred label space written out
        return cls(
            data.cfg,
            data,
            models[first],
            algorithm,
            clients,
            devs[first],
            models,
            devs,
            anchor,
            anchor_train,
            alignment,
            root,
        )

    @property
    def ranks(self) -> dict[int, int]:
        """Every client's LoRA rank in a mixed-rank federation (``[[model.ranks]]``), else
        empty."""
        if not self.cfg.model.ranks:
            return {}
        return {c.client_id: self.cfg.model.rank_of(c.client_id) for c in self.clients}

    @property
    def device(self) -> torch.device:
        """Where the clients train and the server scores (``train.device``, resolved)."""
        return self.model.device

    def compute(self) -> dict[str, Any]:
        """The device and the forward passes' precision by backbone, as summary.json
        records them and ``fedloom run`` prints them."""
        return {
            "device": describe(self.device),
            "tf32": self.cfg.train.tf32 if self.device.type == "cuda" else None,
            "precision": {b: m.precision for b, m in self.models.items()},
        }

    def responses_cut(self) -> dict[str, int]:
        """A generative task's responses cut to fit ``data.max_length``
        (:mod:`fedloom.models.generative`): how many of the clients' examples (training,
        validation and test splits) and of the dev set."""
        held = [f for c in self.clients for f in (*c.train, *c.val, *c.test)]
        return {
            "clients": sum(bool(f.get("cut")) for f in held),
            "dev": sum(bool(f.get("cut")) for f in self.dev or []),
        }

    @property
    def mixed(self) -> bool:
        """Whether clients run different backbones."""
        return len(self.models) > 1

    def backbone_of(self, client_id: int) -> str:
        return self.cfg.model.backbone_of(client_id) if self.mixed else next(iter(self.models))

    def model_for(self, client_id: int) -> FedModel:
        """The model client ``client_id`` runs."""
        return self.models[self.backbone_of(client_id)] if self.mixed else self.model

    def cohorts(self) -> list[Experiment]:
        """One single-backbone experiment per backbone (its model, clients and dev
        encoding; the same config, data and algorithm); ``[self]`` when not mixed."""
        if not self.mixed:
            return [self]
        return [
            replace(
                self,
                model=model,
                dev=self.devs[b],
                models={b: model},
                devs={b: self.devs[b]},
                anchor=None,
                anchor_train={},
                alignment=[],
                clients=[c for c in self.clients if self.backbone_of(c.client_id) == b],
            )
            for b, model in self.models.items()
        ]

    @property
    def task(self) -> TaskSpec:
        return self.data.task

    def clients_at(self, round_: int) -> list[ClientData]:
        """Every client's data during ``round_`` (1-based; drifting clients move)."""
        return [c.at(round_) for c in self.clients]

    def parties(self, round_: int = 0) -> list[ClientData]:
        """Who trains in ``round_``: the clients, or, for a method that pools the data, one
        party per backbone holding its clients' training and validation data
        (:func:`pooled_party_ids`)."""
        clients = self.clients_at(round_)
        if not self.algorithm.pools_data:
            return clients
        pools: dict[str, list[ClientData]] = {}
        for client in clients:
            pools.setdefault(self.backbone_of(client.client_id), []).append(client)
        parties = {
            b: ClientData(
                min(c.client_id for c in members),
                [f for c in members for f in c.train],
                [],
                val=[f for c in members for f in c.val],
            )
            for b, members in pools.items()
        }
        return sorted(parties.values(), key=lambda p: p.client_id)

    def partition_stats(self, round_: int = 0) -> dict[str, Any]:
        return self.data.stats(round_)

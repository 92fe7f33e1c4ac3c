"""Experiment schema: a TOML file validated into typed settings.

Every mistake becomes one :class:`ConfigError` line naming the dotted key and the
problem (``federation.fraction: must be <= 1 (got 1.5)``); the CLI turns it into exit
status 2. ``--set section.key=value`` overrides are parsed as TOML values and applied
before validation, so they get the same checks.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedloom.client_mode import why_not_dev_weighted


class ConfigError(ValueError):
    """A configuration mistake; ``str(err)`` is one line naming the key."""


#: how every setting is validated, the schema's and those checked by the piece they set (an
#: algorithm's, an attack's, a transform's, a compressor's hyperparameters): strictly, no
#: silent coercion (a bool is not a number, so ``batch_size = true`` is an error, not 1; a
#: string is not a number; 2.0 is not an int; only an int is taken as a float), and a float
#: finite (TOML's ``inf`` and ``nan`` are refused) unless its field says that inf means
#: something (``Annotated[float, AllowInfNan()]``, e.g. the ℓ∞ norm of a quantizer)
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


def expected(err: ValidationError, otherwise: str) -> str:
    """What a setting that failed validation with ``err`` should have been: "a finite
    number" where it was inf or nan, else ``otherwise`` (its type, as the caller says it)."""
    finite = any(e["type"] == "finite_number" for e in err.errors())
    return "a finite number" if finite else otherwise


class _Section(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid", frozen=True)


class DataConfig(_Section):
    """Where examples come from: a GLUE task (local TSV dir or the hub) or a JSONL/CSV file.

    With ``train_path`` the data are your own files and ``task`` names your task (default
    ``"custom"``); a GLUE name there reads your files in that GLUE task's label space.
    A custom task's labels are ``label_names`` (class names in id order), or inferred from
    the training file by ``label_type``: ``"auto"`` (integers -> class ids, other numbers
    -> a numeric label, names -> classes in sorted order), ``"class"`` or ``"number"``.
    A run records the resolved label names and type in its config.toml."""

    task: str = "MRPC"
    data_dir: str | None = Field(
        default=None, description="GLUE directory (<dir>/<TASK>/{train,dev}.tsv); None: auto/hub"
    )
    train_path: str | None = None
    dev_path: str | None = None
    text_fields: list[str] = Field(default_factory=lambda: ["text"], min_length=1, max_length=2)
    label_field: str = "label"
    label_names: list[str] | None = None
    label_type: Literal["auto", "class", "number"] = "auto"
    max_train_examples: Annotated[int, Field(ge=0)] = 0
    max_dev_examples: Annotated[int, Field(ge=0)] = 0
    max_length: Annotated[int, Field(ge=8, le=4096)] = 128
    #: a generative task's fields (``task = "generation"`` with your own files)
    prompt_field: str = "prompt"
    response_field: str = "response"
    #: instead: chat records, a list of {role, content} turns whose last is the response
    #: (JSONL; rendered with the backbone's chat template)
    messages_field: str | None = None
    #: a response too long for ``max_length`` is cut (and counted in the summary), or,
    #: when false, refused naming the example
    truncate_responses: bool = True

    @model_validator(mode="before")
    @classmethod
    def _custom_task_name(cls, data: Any) -> Any:
        # your own files are not MRPC: without a task name they are the task "custom"
        if isinstance(data, dict) and data.get("train_path") is not None and "task" not in data:
            return {**data, "task": "custom"}
        return data

    @model_validator(mode="after")
    def _label_space(self) -> DataConfig:
        if self.label_type == "number" and self.label_names is not None:
            raise ValueError(
                'data.label_names: a numeric label (label_type = "number") has no label names'
            )
        return self


class QuantityConfig(_Section):
    """Quantity skew: client sizes drawn from a law, then scaled to use every example.

    ``lognormal``: n_k ∝ exp(N(0, sigma²)); ``powerlaw``: n_k ∝ Pareto(exponent) + 1
    (density ∝ x^-(exponent+1) for x ≥ 1). Every client keeps at least ``min_size``."""

    law: Literal["lognormal", "powerlaw"] = "lognormal"
    sigma: Annotated[float, Field(gt=0)] = 1.0
    exponent: Annotated[float, Field(gt=0)] = 1.5


class ConceptConfig(_Section):
    """Concept shift P(Y|X): some clients label the same inputs differently: a seeded
    choice of a ``fraction`` of them (default 0.3), or exactly the ``clients`` named (ids
    in ``0..num_clients-1``; instead of ``fraction``, which then resolves to None).

    ``permute``: each such client relabels y -> π_k(y) with a random permutation without
    fixed points; ``swap``: it exchanges the two ``classes`` (default the first two)."""

    fraction: Annotated[float, Field(gt=0, le=1)] | None = 0.3
    clients: Annotated[list[int], Field(min_length=1)] | None = None
    kind: Literal["permute", "swap"] = "permute"
    classes: Annotated[list[int], Field(min_length=2, max_length=2)] | None = None

    @model_validator(mode="after")
    def _fraction_or_clients(self) -> ConceptConfig:
        if self.clients is None:
            if self.fraction is None:
                raise ValueError("one of fraction or clients is required")
            return self
        if self.fraction is not None and "fraction" in self.model_fields_set:
            raise ValueError(
                "partition.concept.clients: names the clients that relabel; set either "
                "clients or fraction, not both"
            )
        if len(set(self.clients)) != len(self.clients):
            raise ValueError(f"partition.concept.clients: {self.clients} lists a client twice")
        object.__setattr__(self, "fraction", None)
        return self


class TasksConfig(_Section):
    """Task heterogeneity: client k holds task ``names[k % len(names)]`` (or the tasks in
    blocks of ``clients``; each task's
    examples split over its clients by the base scheme); then every example moves, with
    probability ``mix``, to a random client holding another task. Labels live in one union
    label space (``TASK/label``). With ``prefix`` every input starts with its task's name
    (the T5 recipe: the model is told the task); without it the model must tell the tasks
    apart from the text, and so must a method that clusters clients by their updates."""

    names: Annotated[list[str], Field(min_length=2)]
    #: how many clients hold each task, in the order of ``names`` (the first ``clients[0]``
    #: clients hold ``names[0]``, and so on; the counts add up to ``num_clients``); default:
    #: client k holds ``names[k % len(names)]``
    clients: list[Annotated[int, Field(ge=1)]] | None = None
    mix: Annotated[float, Field(ge=0, lt=1)] = 0.0
    prefix: bool = True

    @model_validator(mode="after")
    def _one_count_per_task(self) -> TasksConfig:
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"names: {self.names} lists a task twice")
        if self.clients is not None and len(self.clients) != len(self.names):
            raise ValueError(f"clients: {len(self.clients)} counts for {len(self.names)} tasks")
        return self


class TemporalConfig(_Section):
    """Drift: between rounds ``start_round`` and ``end_round`` a ``fraction`` of the clients
    move linearly from their partition to a second one, drawn with seed + 1 and the base
    settings, except those given here."""

    start_round: Annotated[int, Field(ge=0)]
    end_round: Annotated[int, Field(ge=0)]
    fraction: Annotated[float, Field(gt=0, le=1)] = 1.0
    scheme: Literal["iid", "dirichlet", "shards", "feature"] | None = None
    alpha: Annotated[float, Field(gt=0)] | None = None
    shards_per_client: Annotated[int, Field(ge=1)] | None = None
    feature: str | None = None

    @model_validator(mode="after")
    def _ordered(self) -> TemporalConfig:
        if self.end_round < self.start_round:
            raise ValueError(
                f"end_round ({self.end_round}) must not be before start_round ({self.start_round})"
            )
        return self


class PartitionConfig(_Section):
    """How the pooled training set is split: a base scheme plus optional skews on top."""

    scheme: Literal["iid", "dirichlet", "shards", "feature", "sequential"] = "iid"
    num_clients: Annotated[int, Field(ge=1)] = 3
    alpha: Annotated[float, Field(gt=0)] = 0.5  # dirichlet: concentration
    shards_per_client: Annotated[int, Field(ge=1)] = 2  # shards: labels each client sees
    feature: str | None = None  # feature: a metadata column (e.g. "genre") or "length"
    #: sequential: rows per client, in file order (default: the pool split evenly)
    client_size: Annotated[int, Field(ge=1)] | None = None
    min_size: Annotated[int, Field(ge=1)] = 10
    test_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.2
    #: share of each client's training split held out as its validation split (for tuning)
    val_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.0
    quantity: QuantityConfig | None = None
    concept: ConceptConfig | None = None
    tasks: TasksConfig | None = None
    temporal: TemporalConfig | None = None

    @model_validator(mode="after")
    def _consistent(self) -> PartitionConfig:
        if self.scheme == "feature" and not self.feature:
            raise ValueError("scheme 'feature' needs feature = <metadata column> or 'length'")
        if self.val_fraction > 0 and self.temporal is not None:
            raise ValueError("val_fraction does not combine with temporal drift")
        if self.quantity is not None and self.scheme in ("feature", "sequential"):
            raise ValueError(
                f"quantity skew composes with iid, dirichlet and shards, not {self.scheme}"
            )
        if self.client_size is not None and self.scheme != "sequential":
            raise ValueError(
                'client_size is the sequential scheme\'s block size (scheme = "sequential")'
            )
        named = [] if self.concept is None else self.concept.clients or []
        outside = sorted(c for c in named if not 0 <= c < self.num_clients)
        if outside:
            raise ValueError(
                f"partition.concept.clients: {outside} are not clients of "
                f"partition.num_clients = {self.num_clients} (ids 0..{self.num_clients - 1})"
            )
        return self


class LoraConfig(_Section):
    r: Annotated[int, Field(ge=1)] = 16
    alpha: Annotated[float, Field(gt=0)] = 32.0
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.05
    target_modules: list[str] | Literal["auto"] = "auto"
    #: the 0-based transformer blocks to adapt (default: every block). Leaving the lowest
    #: ones out makes them a frozen prefix that ``model.prefix_cache`` computes once
    layers: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    #: in the mosaic model, the number of blocks whose adapted layers are PQ-LoRA
    #: (fedloom.models.pqlora; 0: ordinary LoRA everywhere; at most one per layer of the
    #: backbone); "auto": by depth, one per ``pqlora.BLOCKS_PER_PQ`` adapted blocks
    #: (at least one), the share of FedMosaic's 4 PQ blocks in its 16- to 28-block models
    pq_blocks: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"

    @model_validator(mode="after")
    def _distinct_layers(self) -> LoraConfig:
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers: {self.layers} lists a block twice")
        return self


class AlignmentConfig(_Section):
    """How FedMosaic aligns PQ-LoRA's frozen factors of the bigger backbones with the
    anchor's in a mixed federation (fedloom.models.align): on ``texts`` public training
    sentences no client holds (0: leave every backbone's factors random, unaligned), B by
    ridge least squares (``"lstsq"``, better on held-out text than the paper's ``"cca"``:
    benchmarks/align_quality.py) with relative ``ridge``."""

    texts: Annotated[int, Field(ge=0)] = 256
    method: Literal["lstsq", "cca"] = "lstsq"
    ridge: Annotated[float, Field(gt=0)] = 0.1


class BackboneGroup(_Section):
    """Clients that run another backbone than ``[model]``'s (a mixed-architecture
    federation): their ids, the backbone, its head and, optionally, its LoRA settings,
    precision and prefix cache (default: ``[model]``'s)."""

    clients: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    backbone: str
    head: Literal["auto", "classifier", "verbalizer"] = "auto"
    lora: LoraConfig | None = None
    precision: Literal["fp32", "bf16", "fp16", "auto"] | None = None
    prefix_cache: bool | None = None


class RankGroup(_Section):
    """Clients whose LoRA rank differs from ``model.lora.r`` (a mixed-rank federation)."""

    clients: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    r: Annotated[int, Field(ge=1)]


class ModelConfig(_Section):
    backbone: str = "minilm"
    head: Literal["auto", "classifier", "verbalizer"] = "auto"
    pooling: Literal["mean", "cls"] = "mean"
    head_dropout: Annotated[float, Field(ge=0, lt=1)] = 0.1
    lora: LoraConfig = LoraConfig()
    #: "dual": a global and a local LoRA in every adapted layer, mixed per example by a
    #: learned gate (fedloom.models.dual); "mosaic": the same with one gate per layer and
    #: PQ-LoRA in ``lora.pq_blocks`` blocks (fedloom.models.mosaic). Methods built on one
    #: of them choose it by themselves
    adapters: Literal["single", "dual", "mosaic"] = "single"
    #: ``[[model.groups]]``: clients that run other backbones; every other client runs
    #: ``backbone``. An algorithm that does not span architectures runs once per backbone
    #: (within architecture); FedMosaic shares PQ-LoRA across them.
    groups: list[BackboneGroup] = []
    alignment: AlignmentConfig = AlignmentConfig()
    #: "bf16": forward passes (training and scoring) under bfloat16 autocast, the adapters,
    #: their gradients and the optimizer state kept in float32 (fedloom.models.fedmodel).
    #: On a CPU with native bf16 (avx512_bf16 / AMX) it made SmolLM2-135M's train steps
    #: 1.6x and its scoring 2x faster and MiniLM's rounds 1.34x, and the reference
    #: experiment (examples/mrpc_fedavg.toml) ended at the fp32 run's MRPC dev accuracy and
    #: F1 (BENCHMARKS.md). The default "auto": bf16 where the CPU has native bf16 (where it
    #: was measured faster), else fp32; on CUDA fp32 with TF32 matmuls (measured faster
    #: than bf16 at fedloom's batch sizes); "fp16": float16 autocast with a loss scale,
    #: CUDA only (fedloom.device)
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "auto"
    #: compute the blocks below the first adapted one (``lora.layers``) once per example
    #: and reuse their output in every later step, round and evaluation
    #: (fedloom.models.prefix; that prefix then runs without dropout)
    prefix_cache: bool = False
    #: ``[[model.ranks]]``: clients of another LoRA rank than ``lora.r`` (every other client
    #: has ``lora.r``). The model is built once at the largest rank with every client's
    #: scaling ``lora.alpha / lora.r``; a client of rank r uses the first r components
    #: (the rest zero). Only methods defined on mixed ranks accept it.
    ranks: list[RankGroup] = []

    @model_validator(mode="after")
    def _distinct_ranks(self) -> ModelConfig:
        seen: dict[int, int] = {}
        for g, group in enumerate(self.ranks):
            for cid in group.clients:
                if cid in seen:
                    raise ValueError(
                        f"model.ranks[{g}].clients: client {cid} is already in "
                        f"model.ranks[{seen[cid]}]"
                    )
                seen[cid] = g
        if self.ranks and self.groups:
            raise ValueError(
                "model.ranks: per-client ranks are for one backbone; a "
                "mixed-backbone federation (model.groups) sets lora.r per group"
            )
        if self.ranks and self.adapters != "single":
            raise ValueError(
                f"model.ranks: per-client ranks need single LoRA adapters, not "
                f"model.adapters = {self.adapters!r}"
            )
        return self

    def rank_of(self, client_id: int) -> int:
        """Client ``client_id``'s LoRA rank."""
        return next((g.r for g in self.ranks if client_id in g.clients), self.lora.r)

    @model_validator(mode="after")
    def _distinct_groups(self) -> ModelConfig:
        seen: dict[int, int] = {}
        backbones = [self.backbone]
        for g, group in enumerate(self.groups):
            if group.backbone in backbones:
                raise ValueError(
                    f"model.groups[{g}].backbone: {group.backbone!r} is already "
                    "another group's (or [model]'s); list its clients there"
                )
            backbones.append(group.backbone)
            for cid in group.clients:
                if cid in seen:
                    raise ValueError(
                        f"model.groups[{g}].clients: client {cid} is already in "
                        f"model.groups[{seen[cid]}]"
                    )
                seen[cid] = g
        return self

    def backbone_of(self, client_id: int) -> str:
        """The backbone client ``client_id`` runs."""
        return next((g.backbone for g in self.groups if client_id in g.clients), self.backbone)

    def _widest_lora(self) -> LoraConfig:
        """``lora`` at the largest rank of ``ranks``, alpha scaled to keep alpha / r."""
        widest = max([self.lora.r, *(g.r for g in self.ranks)])
        if widest == self.lora.r:
            return self.lora
        return self.lora.model_copy(
            update={"r": widest, "alpha": self.lora.alpha * widest / self.lora.r}
        )

    def for_backbone(self, backbone: str) -> ModelConfig:
        """This section as a single-backbone one for ``backbone``'s clients (its head and
        LoRA settings, widened to the largest of ``ranks``; the rest shared)."""
        group = next((g for g in self.groups if g.backbone == backbone), None)
        if group is None:
            return self.model_copy(update={"groups": [], "lora": self._widest_lora()})
        return self.model_copy(
            update={
                "backbone": backbone,
                "head": group.head,
                "lora": group.lora or self.lora,
                "groups": [],
                "precision": group.precision or self.precision,
                "prefix_cache": self.prefix_cache
                if group.prefix_cache is None
                else group.prefix_cache,
            }
        )


class FederationConfig(_Section):
    """Rounds and client sampling: ``max(min_clients, ceil(fraction * K))`` clients a round.
    ``min_clients`` is also the quorum: a round is aggregated when at least that many
    sampled clients reported a valid update; below it ``below_quorum`` decides: ``"fail"``
    the run, ``"skip"`` the round (the server state stays as it was, the row says why) or
    ``"retry"`` it with a fresh sample up to ``retries`` times, then fail.
    ``max_update_mb``: a client update larger than this is rejected, as a deployment's
    message-size limit would (default: four times the client's payload plus 1 MiB: no
    method sends back more than a few times what it got; 0: no limit)."""

    rounds: Annotated[int, Field(ge=1)] = 3
    fraction: Annotated[float, Field(gt=0, le=1)] = 1.0
    min_clients: Annotated[int, Field(ge=1)] = 1
    below_quorum: Literal["fail", "skip", "retry"] = "fail"
    retries: Annotated[int, Field(ge=1)] = 2
    max_update_mb: Annotated[float, Field(ge=0)] | None = None


class FaultsConfig(_Section):
    """Simulated faults (:mod:`fedloom.runtime.faults`), drawn per (seed, round, client),
    all off by default. ``dropout``: the probability that a sampled client drops out
    mid-round (it trains, never reports); ``crash``: that its training raises. ``speeds``:
    clients' relative speeds (1 = nominal; 0.25 = four times slower) and ``deadline`` the
    round's deadline in nominal client round times: a client slower than ``1 / deadline``
    misses every round (0: no deadline). ``garbage``: clients that send garbage instead of
    their update every round: ``"nan"`` (non-finite values), ``"shape"`` (a tensor with a
    row too many), ``"dtype"`` (float64) or ``"oversize"`` (an extra tensor of nine times the
    update's values and 1 MiB more)."""

    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    crash: Annotated[float, Field(ge=0, lt=1)] = 0.0
    speeds: dict[int, Annotated[float, Field(gt=0)]] = {}
    deadline: Annotated[float, Field(ge=0)] = 0.0
    garbage: dict[int, Literal["nan", "shape", "dtype", "oversize"]] = {}

    @field_validator("speeds", "garbage", mode="before")
    @classmethod
    def _client_keys(cls, value: Any) -> Any:
        """TOML table keys are strings: ``{"3" = 0.25}`` names client 3."""
        if not isinstance(value, dict):
            return value
        out = {}
        for key, item in value.items():
            if isinstance(key, str):
                if not key.strip().isdigit():
                    raise ValueError(f"{key!r} is not a client id")
                key = int(key)
            out[key] = item
        return out


class TrainConfig(_Section):
    local_epochs: Annotated[float, Field(gt=0)] | None = 1.0
    local_steps: Annotated[int, Field(ge=1)] | None = None
    batch_size: Annotated[int, Field(ge=1)] = 32
    #: "bucketed": random batches of similar lengths (less padding); "random": plain
    #: random batches padded to their longest example (fedloom.train.batching)
    batching: Literal["bucketed", "random"] = "bucketed"
    grad_accum: Annotated[int, Field(ge=1)] = 1
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: Annotated[float, Field(gt=0)] = 1e-3
    head_lr: Annotated[float, Field(gt=0)] | None = None
    #: PQ-LoRA's P and Q (the mosaic model's) train at ``lr`` times this. 5/3 is the
    #: official FedMosaic code's ratio on text (snumprlab/fedmosaic README.md:268, the
    #: Fed-Scope / Fed-aya runs: LR 3e-4, MM_PROJECTOR_LR 5e-4, the rate its
    #: federated_methods/fedmosaic.py:821-838 gives P and Q)
    pq_lr_scale: Annotated[float, Field(gt=0)] = 5 / 3
    weight_decay: Annotated[float, Field(ge=0)] = 0.01
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    schedule: Literal["constant", "linear", "cosine", "noam"] = "linear"
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.06
    # "run": one warm-up and decay over all rounds; "round": restart them every round
    schedule_scope: Literal["run", "round"] = "run"
    clip_norm: Annotated[float, Field(ge=0)] = 1.0  # max global gradient norm; 0 = off
    bf16: bool = False
    optimizer_state: Literal["persist", "reset"] = "persist"
    #: where clients train and the server scores (fedloom.device): "auto" (the first CUDA
    #: device when torch sees one, else the CPU), "cpu", "cuda", "cuda:N" or "mps". What
    #: travels, the server's aggregation and checkpoints stay on the CPU whatever it says
    device: Annotated[str, Field(pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")] = "auto"
    #: TF32 tensor-core matmuls for float32 work on CUDA (no effect elsewhere)
    tf32: bool = True
    #: clients trained in one batched forward/backward (fedloom.train.together), equal to
    #: one by one; 1 = one by one, the default: on a 2-core CPU it was not faster, while
    #: on an H200 64 clients a pass trained 11x as many clients a second (BENCHMARKS.md):
    #: set it on a GPU. Methods whose local step is not plain local training, and models
    #: it does not support, train one by one whatever it says
    clients_per_pass: Annotated[int, Field(ge=1)] = 1

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainConfig:
        if self.local_steps is not None and self.local_epochs is not None:
            if "local_epochs" in self.model_fields_set:
                raise ValueError("set either local_epochs or local_steps, not both")
            object.__setattr__(self, "local_epochs", None)
        if self.local_steps is None and self.local_epochs is None:
            raise ValueError("one of local_epochs or local_steps is required")
        return self


class GenerationConfig(_Section):
    """How a generative task's answers are generated when they are scored (the knobs of
    transformers' ``model.generate``): greedy by default; with ``do_sample`` a draw at
    ``temperature`` from the ``top_k`` / ``top_p`` truncated distribution, seeded by the
    experiment's seed, so a config generates the same text twice."""

    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 64
    do_sample: bool = False
    temperature: Annotated[float, Field(gt=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 50
    num_beams: Annotated[int, Field(ge=1)] = 1
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    no_repeat_ngram_size: Annotated[int, Field(ge=0)] = 0


class EvalConfig(_Section):
    """When and on what runs are scored. ``client_mode`` says what a client's test score
    is: ``"split"``, its own held-out test split; ``"dev_weighted"``, the task's dev set
    reweighted to the client's label mix (:mod:`fedloom.evaluation.dev_weighted`; the own
    split is then also scored, as ``clients_split``); ``"dev_matched"``, the dev examples
    whose value of the partition's metadata field (``partition.feature``) is one of the
    client's (its own split also scored, as ``clients_split``); ``"auto"``, dev-weighted
    wherever label weights describe the clients (a classification task with a dev set, no
    feature skew, no temporal drift), dev-matched for a generative task split by a metadata
    field with a dev set, else the split. ``others``: when the adapter each client uses is
    also scored on the other clients' splits (Self / Others, one dev pass per personal
    adapter; :mod:`fedloom.evaluation.self_others`): at the ``"final"`` evaluation only,
    ``"every"`` one, or ``"never"`` (the default on Flower, where a personalized method's
    adapters stay on their nodes). ``metrics``: what is scored, in place of the task's
    own metrics (the task's main metric among them). ``baselines``: what each client's
    score is read against, reported beside the run's own adapters: ``"majority"``, each
    client predicting its most frequent training label, ``"local"``, each client
    training alone with the run's local training for as many rounds, and ``"zero_shot"``,
    a causal LM's backbone without adapters (scored at the last round)."""

    every: Annotated[int, Field(ge=1)] = 1
    initial: bool = False  # also score the untrained adapter (logged as round 0)
    batch_size: Annotated[int, Field(ge=1)] = 64
    dev: bool = True
    clients: bool = True
    client_mode: Literal["auto", "split", "dev_weighted", "dev_matched"] = "auto"
    others: Literal["final", "every", "never"] = "final"
    #: the metrics scored (default: the task's own); e.g. ["accuracy", "balanced_accuracy"]
    metrics: list[str] | None = Field(default=None, min_length=1)
    #: the references every client's score is read against (:mod:`fedloom.baselines`)
    baselines: list[Literal["local", "majority", "zero_shot"]] = []
    #: how a generative task's answers are generated (:class:`GenerationConfig`)
    generation: GenerationConfig = GenerationConfig()

    @field_validator("metrics", "baselines")
    @classmethod
    def _distinct(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"names a value twice: {value}")
        return value


class DiagnosticsConfig(_Section):
    """Heterogeneity measurements logged into metrics.jsonl while a run trains.

    Client drift ‖w_k − w‖ is logged every round (it is free); the gradient
    dissimilarity G² needs ``batches`` extra forward/backward passes per client and is
    measured every ``every`` rounds at the global model (0 turns it off)."""

    every: Annotated[int, Field(ge=0)] = 1
    batches: Annotated[int, Field(ge=1)] = 2
    batch_size: Annotated[int, Field(ge=1)] = 16


#: FLTrust's root set |D0| when ``aggregation.root_examples`` is unset (Cao et al. 2021)
DEFAULT_ROOT_EXAMPLES = 100
#: the rules of ``[aggregation]`` (:mod:`fedloom.algorithms.aggregators`)
RuleName = Literal[
    "mean",
    "median",
    "trimmed_mean",
    "krum",
    "multikrum",
    "bulyan",
    "norm_bounding",
    "centered_clipping",
    "fltrust",
]


class AggregationConfig(_Section):
    """How an averaging algorithm combines the clients
    (:mod:`fedloom.algorithms.aggregation_rule`): ``rule`` None keeps the algorithm's own
    (the weighted mean; the named rule for ``median``, ``trimmed_mean``, ``krum``,
    ``multikrum``, ``bulyan``, ``norm_bounding`` and ``centered_clipping``); ``beta``
    (trimmed mean), ``num_malicious_nodes`` (f of Krum and Bulyan) and
    ``num_nodes_to_select`` (Multi-Krum's m) default to Flower's 0.2, 0 and 1;
    ``max_norm`` (norm bounding's M) and ``clip_radius`` (centered clipping's tau) to the
    round's median update norm (median distance to v), ``clip_iterations`` to 1;
    ``root_examples`` (FLTrust's root set |D0|, carved from the training data before the
    partition) to 100, as in Cao et al. 2021."""

    rule: RuleName | None = None
    beta: float | None = None
    num_malicious_nodes: int | None = None
    num_nodes_to_select: int | None = None
    max_norm: float | None = None
    clip_radius: float | None = None
    clip_iterations: int | None = None
    root_examples: int | None = None

    @property
    def root_size(self) -> int:
        """How many training examples the server keeps as FLTrust's root set: 0 unless
        ``rule = "fltrust"``, then ``root_examples`` (unset: 100)."""
        if self.rule != "fltrust":
            return 0
        return DEFAULT_ROOT_EXAMPLES if self.root_examples is None else self.root_examples


class PrivacyConfig(_Section):
    """Differential privacy (:mod:`fedloom.privacy`). ``level = "sample"``: DP-SGD in every
    client's local training through Opacus (:mod:`fedloom.train.dp_sgd`): each example's
    gradient clipped to ``clip_norm``, noise ``noise_multiplier`` × C on the sum, Poisson
    batches, ε per client. ``level = "client"``: DP-FedAvg
    (McMahan et al. 2018) on what the clients share: each update clipped to L2 norm
    ``clip_norm`` (C), Gaussian noise of std ``noise_multiplier`` × C on the sum of the
    updates, added by the server (``noise = "server"``) or split among the clients
    (``"client"``, for secure aggregation); ``adaptive_quantile`` (γ) makes C follow that
    quantile of the update norms (Andrew et al. 2021; ``adaptive_lr`` η, ``count_noise``
    σ_b, default clients per round / 20); ``target_epsilon`` instead of
    ``noise_multiplier`` chooses z for the run. ε is accounted at ``delta`` (default
    1 / K^1.1) by ``accountant``: ``"pld"`` or ``"rdp"`` (dp-accounting; default PLD where
    it applies, RDP for sampling a fixed number of clients out of more, which PLD does
    not account). ``secure_noise`` draws the noise from the operating system rather than
    the experiment's seed (needed whenever the server knows the seed and must not learn
    the noise: client-side noise in a deployment)."""

    level: Literal["off", "client", "sample"] = "off"
    noise_multiplier: Annotated[float, Field(ge=0)] | None = None
    clip_norm: Annotated[float, Field(gt=0)] = 1.0
    noise: Literal["server", "client"] = "server"
    adaptive_quantile: Annotated[float, Field(ge=0, le=1)] | None = None
    adaptive_lr: Annotated[float, Field(gt=0)] = 0.2
    count_noise: Annotated[float, Field(gt=0)] | None = None
    delta: Annotated[float, Field(gt=0, lt=1)] | None = None
    target_epsilon: Annotated[float, Field(gt=0)] | None = None
    accountant: Literal["pld", "rdp"] | None = None
    secure_noise: bool = False


class SecAggSection(_Section):
    """Secure aggregation (:mod:`fedloom.secagg`, the chain's mask stage
    :mod:`fedloom.transforms.secure_sum`): the server learns the weighted sum of the
    clients' updates and nothing of any one of them. ``protocol``: ``"secagg+"`` (Bell et
    al. 2020: shares among ``neighbours`` k of a random k-regular graph, default
    min(n − 1, 2⌈log2 n⌉)) or ``"secagg"`` (Bonawitz et al. 2017: among every client);
    ``threshold`` t of a client's share holders rebuild its secrets (default ⌈2/3⌉ of
    them; t must be a majority); or homomorphic aggregation (:mod:`fedloom.homomorphic`),
    ``"ckks"`` (TenSEAL) or ``"paillier"`` (phe, a modulus of ``key_bits`` bits, default
    3072): the clients encrypt, the server adds, one client of the round decrypts the sum.
    The sum lives modulo 2^``bits``; each coordinate of an update is clipped to
    [−``clip_range``, ``clip_range``] and quantized to ``quant_bits`` bits (default: the
    most that the round's total weight cannot wrap)."""

    protocol: Literal["none", "secagg+", "secagg", "ckks", "paillier"] = "none"
    threshold: Annotated[int, Field(ge=1)] | None = None
    neighbours: Annotated[int, Field(ge=1)] | None = None
    bits: Annotated[int, Field(ge=2, le=62)] = 32
    clip_range: Annotated[float, Field(gt=0)] = 1.0
    quant_bits: Annotated[int, Field(ge=1, le=52)] | None = None
    key_bits: Literal[2048, 3072, 4096] | None = None

    @model_validator(mode="after")
    def _only_with_a_protocol(self) -> SecAggSection:
        # a setting is refused where it would do nothing; a default spelled out (the
        # resolved config a run directory or a Flower node reads) is not
        if self.protocol != "none":
            return self
        for key, info in type(self).model_fields.items():
            if key != "protocol" and getattr(self, key) != info.default:
                raise ValueError(
                    f'secagg.{key}: only with secure aggregation (secagg.protocol is "none")'
                )
        return self


class TransformConfig(BaseModel):
    """One ``[[transforms]]`` table: ``name`` plus that transform's settings (checked by
    :func:`fedloom.transforms.chain`)."""

    model_config = ConfigDict(**STRICT, extra="allow", frozen=True)
    name: str

    @property
    def settings(self) -> dict[str, Any]:
        return {"name": self.name, **(self.model_extra or {})}


class CheckpointConfig(_Section):
    """Resumable checkpoints (:mod:`fedloom.runtime.checkpoint`): every server and client
    state, written atomically after every ``every`` rounds and after the last, so that
    ``fedloom run --resume RUN_DIR`` continues a killed run from the newest good one;
    ``keep`` complete checkpoints are kept (an older one is the fallback when the newest is
    damaged)."""

    every: Annotated[int, Field(ge=1)] = 1
    keep: Annotated[int, Field(ge=1)] = 2


class RuntimeConfig(_Section):
    """Where the clients run. ``"local"``: every client in this process, one after another
    (the embedded simulator). ``"ray"``: on ``workers`` Ray actors, each holding one copy
    of the model and data and the local state of the clients it owns, with
    ``cpus_per_worker`` CPUs (its torch threads) and ``gpus_per_worker`` GPUs each (a
    fraction shares a card: 0.25 puts four actors on one; Ray hides the GPUs from an actor
    that asks for none, so ``train.device = "auto"`` trains there on the CPU); on a
    cluster at ``address`` (``"auto"``: the one this machine belongs to; None: a local
    Ray started for the run and stopped after it). The server side runs in this process
    either way. ``"flower"``: on Flower's deployment engine, one SuperNode per client
    (``fedloom run`` starts a SuperLink and the SuperNodes on this machine; ``fedloom
    serve`` / ``join`` across machines), each client process with ``cpus_per_worker`` torch
    threads, on ``train.device`` as resolved on the node's machine (or ``fedloom join
    --device``); the server waits ``nodes_timeout`` seconds for every client's node to join and
    ``reply_timeout`` seconds for a round's replies (None: until every node has answered or
    missed its heartbeats). Every runtime's results are the local runtime's.

    ``client_data``: where the clients' examples come from. ``"partition"``: every process
    partitions the configured dataset (a simulation, or a deployment over shared data).
    ``"nodes"``: each Flower node holds its own client's data (``fedloom join --data``)
    and the server none: it knows the task's label space from the config, and every score
    on a client's data comes back from that client's node. Off there, because they read
    clients' data on the server: gradient diagnostics (``diagnostics.every = 0``) and
    Self / Others (``eval.others = "never"``), the defaults under "nodes"."""

    name: Literal["local", "ray", "flower"] = "local"
    client_data: Literal["partition", "nodes"] = "partition"
    address: str | None = None
    workers: Annotated[int, Field(ge=1)] = 2
    cpus_per_worker: Annotated[float, Field(gt=0)] = 1.0
    gpus_per_worker: Annotated[float, Field(ge=0)] = 0.0
    nodes_timeout: Annotated[float, Field(gt=0)] = 300.0
    reply_timeout: Annotated[float, Field(gt=0)] | None = None


#: the attacks of ``[attack]`` (:mod:`fedloom.attacks`): model poisoning, then data poisoning
ATTACK_NAMES = ("sign_flip", "gaussian", "boosted", "alie", "ipm", "label_flip", "backdoor")


class AttackConfig(BaseModel):
    """Simulated Byzantine clients (:mod:`fedloom.attacks`; docs/guide/robustness.md).
    ``name``: ``"none"`` or an attack; the attackers are ``fraction`` of the federation's
    clients (⌊fraction · K⌋, the first of a permutation seeded by the experiment's seed, so
    a smaller fraction's attackers are among a larger one's) or the ids in ``clients``;
    model poisoning starts in round ``start_round``. Every other key is a hyperparameter
    of the attack, checked by it (:func:`fedloom.attacks.create`)."""

    model_config = ConfigDict(**STRICT, extra="allow", frozen=True)
    name: Literal[
        "none", "sign_flip", "gaussian", "boosted", "alie", "ipm", "label_flip", "backdoor"
    ] = "none"
    fraction: Annotated[float, Field(ge=0, lt=1)] | None = None
    clients: list[Annotated[int, Field(ge=0)]] | None = None
    start_round: Annotated[int, Field(ge=1)] = 1

    @property
    def hyperparameters(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def count(self, num_clients: int) -> int:
        """How many of ``num_clients`` clients attack: ⌊fraction · K⌋, or the ids named."""
        if self.clients is not None:
            return len(self.clients)
        return math.floor((self.fraction or 0.0) * num_clients + 1e-9)

    @model_validator(mode="after")
    def _who(self) -> AttackConfig:
        if self.name == "none":
            for key in ("fraction", "clients", *self.hyperparameters):
                if getattr(self, key, None) is not None:
                    raise ValueError(f'attack.{key}: only with an attack (attack.name is "none")')
            if self.start_round != 1:
                raise ValueError('attack.start_round: only with an attack (attack.name is "none")')
            return self
        if self.fraction is not None and self.clients is not None:
            raise ValueError("attack.clients: set attack.fraction or attack.clients, not both")
        if self.fraction is None and self.clients is None:
            raise ValueError(
                f"attack.fraction: attack {self.name} needs its attackers: attack.fraction "
                f"(of the clients) or attack.clients (their ids)"
            )
        if self.fraction == 0:
            raise ValueError(
                f"attack.fraction: 0 makes no client an attacker, and attack {self.name} "
                f'would not run; give a share above 0, or attack.name = "none" for no attack'
            )
        if self.clients == []:
            raise ValueError(
                f"attack.clients: [] names no attacker, and attack {self.name} would not run; "
                f'name at least one client, or attack.name = "none" for no attack'
            )
        if self.clients is not None and len(set(self.clients)) < len(self.clients):
            raise ValueError(f"attack.clients: {self.clients} names a client twice")
        return self


class AlgorithmConfig(BaseModel):
    """``name`` plus the algorithm's own hyperparameters (checked by the algorithm)."""

    model_config = ConfigDict(**STRICT, extra="allow", frozen=True)
    name: str = "fedavg"

    @property
    def hyperparameters(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ExperimentConfig(_Section):
    name: str = Field(default="experiment", pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = 0
    output_dir: str = "runs"
    data: DataConfig = DataConfig()
    partition: PartitionConfig = PartitionConfig()
    model: ModelConfig = ModelConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    aggregation: AggregationConfig = AggregationConfig()
    #: the transform chain on what travels (:mod:`fedloom.transforms`), in order
    transforms: list[TransformConfig] = []
    privacy: PrivacyConfig = PrivacyConfig()
    secagg: SecAggSection = SecAggSection()
    federation: FederationConfig = FederationConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    diagnostics: DiagnosticsConfig = DiagnosticsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    faults: FaultsConfig = FaultsConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    #: simulated Byzantine clients (:mod:`fedloom.attacks`)
    attack: AttackConfig = AttackConfig()

    @model_validator(mode="before")
    @classmethod
    def _nodes_defaults(cls, data: Any) -> Any:
        # the clients' data on their nodes: what reads it on the server is off by default
        runtime = data.get("runtime") if isinstance(data, dict) else None
        if not (isinstance(runtime, dict) and runtime.get("client_data") == "nodes"):
            return data
        data = dict(data)
        for section, key, off in (("eval", "others", "never"), ("diagnostics", "every", 0)):
            if isinstance(data.get(section, {}), dict):
                data[section] = {key: off, **data.get(section, {})}
        return data

    @model_validator(mode="before")
    @classmethod
    def _flower_defaults(cls, data: Any) -> Any:
        # on Flower a personalized client's adapter stays on its node, where Self / Others
        # cannot score it: off by default (fedloom.experiment.check_personal_on_nodes)
        runtime = data.get("runtime") if isinstance(data, dict) else None
        if not (isinstance(runtime, dict) and runtime.get("name") == "flower"):
            return data
        if not isinstance(data.get("eval", {}), dict):
            return data
        return {**data, "eval": {"others": "never", **data.get("eval", {})}}

    @model_validator(mode="after")
    def _own_data_nodes(self) -> ExperimentConfig:
        if self.runtime.client_data != "nodes":
            return self
        where = 'with runtime.client_data = "nodes" the server holds no client data'
        if self.runtime.name != "flower":
            raise ValueError(
                f'runtime.client_data: "nodes" needs runtime.name = "flower" (a '
                f"deployment whose nodes hold their own data), not "
                f"{self.runtime.name!r}"
            )
        if self.eval.others != "never":
            raise ValueError(
                f"eval.others: {where} to score one client's adapter on the "
                f'others\' data; use "never"'
            )
        if self.diagnostics.every:
            raise ValueError(f"diagnostics.every: {where} to measure gradients on; use 0")
        if self.eval.client_mode in ("dev_weighted", "dev_matched"):
            raise ValueError(
                f"eval.client_mode: {where}; a client is scored on its own test "
                f'split (use "split" or "auto")'
            )
        for key in ("tasks", "concept", "temporal", "quantity"):
            if getattr(self.partition, key) is not None:
                raise ValueError(
                    f"partition.{key}: simulates how a dataset is spread over "
                    f"clients; {where} (each node's own data is its share)"
                )
        if self.data.train_path is not None:
            raise ValueError(
                f"data.train_path: {where}; each node names its file with fedloom join --data"
            )
        return self

    @model_validator(mode="after")
    def _privacy_settings(self) -> ExperimentConfig:
        p = self.privacy
        # a setting is refused where it would do nothing; a default spelled out (the
        # resolved config a run directory or a Flower node reads) is not
        changed = [
            key
            for key, info in type(p).model_fields.items()
            if key != "level" and getattr(p, key) != info.default
        ]
        if p.level == "off":
            for key in changed:
                raise ValueError(
                    f"privacy.{key}: only with privacy.level = 'client' (privacy is off)"
                )
            return self
        if p.level == "sample":
            if "target_epsilon" in changed:
                raise ValueError(
                    "privacy.target_epsilon: with level = 'sample' each client's epsilon "
                    "depends on its own number of examples; set noise_multiplier (each "
                    "client reports the epsilon it reached)"
                )
            for key in ("noise", "adaptive_quantile", "delta"):
                if key in changed:
                    raise ValueError(
                        f"privacy.{key}: a client-level setting; level = 'sample' runs "
                        f"DP-SGD in each client's training (noise_multiplier, clip_norm per "
                        f"example, accountant; delta is 1 / n_k^1.1 for each client)"
                    )
        if p.noise_multiplier == 0:
            raise ValueError(
                f"privacy.noise_multiplier: 0 adds no noise, so no epsilon holds (it is "
                f"infinite); to train without differential privacy set privacy.level = 'off' "
                f"(not {p.level!r})"
            )
        if p.noise_multiplier is not None and p.target_epsilon is not None:
            raise ValueError(
                "privacy.target_epsilon: set either noise_multiplier or target_epsilon, not both"
            )
        if p.adaptive_quantile is not None and p.noise == "client":
            raise ValueError(
                "privacy.adaptive_quantile: adaptive clipping needs noise = 'server' (with "
                "client-side noise the clients would need each round's clipping norm)"
            )
        for key in ("adaptive_lr", "count_noise"):
            if key in changed and p.adaptive_quantile is None:
                raise ValueError(
                    f"privacy.{key}: only with adaptive clipping (privacy.adaptive_quantile)"
                )
        return self

    @model_validator(mode="after")
    def _baselines(self) -> ExperimentConfig:
        chosen = self.eval.baselines
        if "local" in chosen and self.algorithm.name == "local":
            raise ValueError('eval.baselines: "local" is this run\'s own algorithm; leave it out')
        if "local" in chosen and self.runtime.name == "flower":
            raise ValueError(
                'eval.baselines: "local" trains every client alone in this process, beside '
                'the run; on Flower run the config with algorithm.name = "local"'
            )
        if "majority" in chosen and self.runtime.client_data == "nodes":
            raise ValueError(
                'eval.baselines: "majority" reads every client\'s training labels; with '
                'runtime.client_data = "nodes" the server holds none'
            )
        return self

    @model_validator(mode="after")
    def _across_sections(self) -> ExperimentConfig:
        data = self.data
        if (
            data.dev_path is not None
            and data.train_path is None
            and (self.runtime.client_data != "nodes")
        ):
            raise ValueError(
                "data.dev_path: needs data.train_path (dev data of your own task; "
                'or the server\'s with runtime.client_data = "nodes")'
            )
        clients, least = self.partition.num_clients, self.federation.min_clients
        if least > clients:
            raise ValueError(
                f"federation.min_clients: {least} is more than the {clients} clients of "
                f"partition.num_clients"
            )
        members = {
            "groups": [group.clients for group in self.model.groups],
            "ranks": [group.clients for group in self.model.ranks],
        }
        for key, lists in members.items():
            for g, ids in enumerate(lists):
                outside = [c for c in ids if c >= clients]
                if outside:
                    raise ValueError(
                        f"model.{key}[{g}].clients: {outside} are not clients of "
                        f"partition.num_clients = {clients} (ids 0..{clients - 1})"
                    )
        for key, named in (("speeds", self.faults.speeds), ("garbage", self.faults.garbage)):
            outside = sorted(c for c in named if not 0 <= c < clients)
            if outside:
                raise ValueError(
                    f"faults.{key}: {outside} are not clients of "
                    f"partition.num_clients = {clients} (ids 0..{clients - 1})"
                )
        temporal = self.partition.temporal
        if self.eval.client_mode == "dev_weighted":
            reason = why_not_dev_weighted(
                kind="classification",
                has_dev=True,
                scheme=self.partition.scheme,
                temporal=temporal is not None,
            )
            if reason:
                raise ValueError(
                    f'eval.client_mode: "dev_weighted" does not describe these '
                    f'clients: {reason}; use "split"'
                )
        if temporal is not None and temporal.start_round > self.federation.rounds:
            raise ValueError(
                f"partition.temporal.start_round: {temporal.start_round} is after the last "
                f"round (federation.rounds = {self.federation.rounds})"
            )
        return self

    @model_validator(mode="after")
    def _attackers(self) -> ExperimentConfig:
        attack, k = self.attack, self.partition.num_clients
        if attack.name == "none":
            return self
        outside = sorted(c for c in attack.clients or [] if c >= k)
        if outside:
            raise ValueError(
                f"attack.clients: {outside} are not clients of partition.num_clients = {k} "
                f"(ids 0..{k - 1})"
            )
        key = "clients" if attack.clients is not None else "fraction"
        if attack.count(k) >= k:
            raise ValueError(
                f"attack.{key}: {attack.count(k)} attackers of {k} clients leave no honest client"
            )
        if attack.count(k) == 0 and attack.fraction:
            raise ValueError(
                f"attack.fraction: {attack.fraction:g} of {k} clients is no attacker "
                f"(⌊fraction · K⌋ = 0); raise it, or name the attackers in attack.clients"
            )
        if attack.start_round > self.federation.rounds:
            raise ValueError(
                f"attack.start_round: {attack.start_round} is after the last round "
                f"(federation.rounds = {self.federation.rounds})"
            )
        return self

    @property
    def clients_per_round(self) -> int:
        """How many clients each round samples: ``max(min_clients, ceil(fraction K))``,
        at most K (what :func:`fedloom.server.sample_clients` draws)."""
        k = self.partition.num_clients
        return min(k, max(self.federation.min_clients, math.ceil(self.federation.fraction * k)))


# pydantic puts union-member tags such as ``list[str]`` or ``literal['auto']`` into an
# error's location; they are not config keys.
_UNION_TAG = re.compile(r"[\[\]()'\"]")


def _dotted_key(loc: tuple[Any, ...], raw: Any) -> str:
    """The key at ``loc`` in the ``raw`` input, as messages spell it: dotted tables, an
    array's entry by its index (``transforms[0].name``, ``model.groups[1].clients``)."""
    key, node = "", raw
    for part in loc:
        if isinstance(part, str) and _UNION_TAG.search(part):
            continue
        if isinstance(node, list) and isinstance(part, int):
            key += f"[{part}]"
            node = node[part] if 0 <= part < len(node) else None
            continue
        key += f".{part}" if key else str(part)
        node = node.get(part, node.get(str(part))) if isinstance(node, dict) else None
    return key or "<root>"


def _error_message(error: Any) -> str:
    msg = error["msg"]
    if error["type"] == "extra_forbidden":
        return "unknown key"
    if error["type"] == "value_error":
        return msg.removeprefix("Value error, ")
    if "input" in error and error["type"] != "missing" and not isinstance(error["input"], dict):
        return f"{msg} (got {error['input']!r})"
    return msg


def _format_error(err: ValidationError, raw: Any) -> str:
    """Every mistake on one line: ``key: message; other.key: message``.

    A union type reports one error per member (``list[str]`` and ``literal['auto']``);
    a key is named once, with its first message. A cross-field check names its own key
    (``"federation.min_clients: ..."``), which then replaces the section's name."""
    seen: dict[str, str] = {}
    for error in err.errors():
        key, msg = _dotted_key(error["loc"], raw), _error_message(error)
        named = (
            re.match(r"^([A-Za-z_][\w.]*): (.*)$", msg) if error["type"] == "value_error" else None
        )
        if named and (key == "<root>" or named.group(1).startswith(key + ".")):
            key, msg = named.group(1), named.group(2)
        seen.setdefault(key, msg)
    return "; ".join(f"{key}: {msg}" for key, msg in seen.items())


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value); value parsed as TOML, else str."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"--set {text!r}: empty key segment")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare string: --set data.task = MRPC
    return path, value


#: an override of one of these keys replaces the other (a step budget replaces an epoch one)
_ALTERNATIVES = {"train.local_steps": "local_epochs", "train.local_epochs": "local_steps"}


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path)}: {part} is not a section")
            node = child
        node[path[-1]] = value
        node.pop(_ALTERNATIVES.get(".".join(path), ""), None)
    return raw


def validate(raw: dict[str, Any]) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err, raw)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read, override and validate an experiment file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path}: not a UTF-8 text file (byte {err.start}: {err.reason}); "
            f"an experiment file is TOML"
        ) from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return validate(apply_overrides(raw, overrides or []))


def to_toml_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as a TOML-serializable dict (None values dropped)."""

    def drop_none(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: drop_none(v) for k, v in node.items() if v is not None}
        if isinstance(node, list):
            return [drop_none(v) for v in node]
        return node

    return drop_none(cfg.model_dump(mode="json"))

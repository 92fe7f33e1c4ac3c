"""Personalized federated fine-tuning, compared fairly on non-IID federations.

Federations (``--federation``):
  a  MRPC, 10 clients, Dirichlet alpha = 0.1 label skew
  b  GLUE task heterogeneity: 8 clients, 2 each holding MRPC, SST-2, RTE or CoLA (one head
     over the union label space, every input prefixed with its task's name)
  c  MRPC concept shift: 10 IID clients, 30 % of them swap the two labels
  d  two GLUE tasks: 8 clients, 4 holding MRPC and 4 SST-2 (the grouping clustered
     methods must recover)
  m  two backbones on (d): clients 6 (MRPC) and 7 (SST-2) run SmolLM2-135M through its
     verbalizer (bf16 autocast), the others MiniLM; each SmolLM2 client is the only one
     of its architecture on its task (methods that do not span architectures run once per
     backbone, so FedAvg averages the two SmolLM2 clients' adapters)
  n  MRPC on 2 clients (1800 examples each: MiniLM learns it alone, just) and SST-2 on 6,
     client 7 on SmolLM2-135M (the lone SmolLM2 on SST-2: LoRA in its top 10 blocks with
     the frozen-prefix cache, bf16), the others MiniLM; dev-weighted scores on 400 dev
     examples per task
  o  MRPC on 4 MiniLM clients (900 examples each: too few to learn it alone) and SST-2 on
     4, on the fast path (bf16 where the CPU has it); dev-weighted scores on 400 dev
     examples per task: where sharing within a task should pay
  l  SST-2, 8 clients, Dirichlet 0.3 label skew, every client at LoRA r = 8: the
     LoRA-aware aggregation methods at equal rank (l4: the same at r = 4, the lowest
     rank of r)
  r  federation l with mixed ranks 4 / 8 / 16 / 32 ([[model.ranks]], two clients each):
     only the methods defined on mixed ranks (hetlora, flexlora, flora) run there
  s  SST-2 concept shift on two backbones (issue 41): 12 IID clients of 150 examples
     (``--max-train-examples 1800``; 30 test, 6 validation, 114 to train on: too few to
     learn alone well), clients 8-11 on SmolLM2-135M set up as in (n) but in fp32, the
     others MiniLM; exactly clients 0-3 (MiniLM) and 8-9 (SmolLM2) swap the two labels
     (``partition.concept.clients``: 4 MiniLM + 2 SmolLM2 clients per labeling);
     dev-weighted scores on 400 dev examples. One shared 2-way output where a method
     can take one: FedMosaic runs with ``head = "frozen"`` (every ``fedmosaic*`` row
     there: MiniLM's classifier frozen at its seeded start, the same on every client),
     and the SmolLM2 clients score through their frozen LM head (the verbalizer) in
     every method. No other method has a frozen-head option, so their MiniLM heads
     train (each client's own in local and Ditto, averaged within MiniLM in FedAvg,
     FedAvg-FT, IFCA and CFL). Equal compute (``EQUAL_PASSES``): every method trains
     ``--local-steps`` passes per client and round (FedMosaic 5/6 of them as steps and
     the rest as its task vector's anchor gradients; ``ditto_equal`` is Ditto at that
     compute, ``ditto`` at twice it); on top of it come FedAvg-FT's fine-tuning (after
     "+" in the passes column) and IFCA's forward losses per cluster (not passes)
  sst2-0.1, sst2-0.3, mrpc-0.1, mrpc-0.3
     label skew (issue 43): 12 MiniLM clients, Dirichlet 0.1 or 0.3 over the labels of
     SST-2 or MRPC, dev-weighted scores on 400 dev examples (bf16 where the CPU has it);
     the oracle rows (``oracle_la``, ``oracle_ft``: the pooled model with each client's
     prior) bound what personalization can reach there, and ``fedavg_la`` (the same
     correction on FedAvg's federated model) separates what pooling adds to the features;
     ``--by-label-mix`` splits each paired difference into the clients holding one label
     and the others
  sst2-0.2
     the same at Dirichlet 0.2, no table's federation: where the label-skew methods'
     defaults are chosen, on validation

Every method gets the same federation (seed 0: the same partition and the same client
sampling stream), MiniLM + LoRA r = 16, the same rounds and the same local budget:
``train.local_steps`` steps of batch 8 per client and round (centralized, one party doing
the work of all K clients of a round, takes K times the steps). Hyperparameters are chosen
per method by :mod:`fedloom.sweep` on the clients' validation splits (``val_fraction``
0.2 of each training split), never on their test splits: the grid is the shared learning
rates ``LRS`` times the method's one key hyperparameter (``METHODS``). The table reports
the selected point: the clients' test mean / p10 / min of the adapter each client uses
(its personal one where the method has them, else the global one) and the global adapter's
dev score where there is one. A client's test score is dev-weighted (``eval.client_mode``
auto: the task's dev set, relabelled by the client's label map and weighted to its label
mix, hundreds of examples per client); the clients' own test splits are recorded beside
it (``test_split``) so that the precision of the two can be compared over seeds.

Sizing (2 CPU cores): ``--max-train-examples`` (default 800) is the whole pooled training
set (federation b: a quarter per task), 8 rounds of 4 local steps; with both default
learning rates about 40 runs per federation over the 14 methods, with ``--lrs 0.001``
(one shared rate, what BENCHMARKS.md reports) about 20. Per-step costs differ by method
(Ditto and APFL train two adapters, pFedMe K = 5 inner steps, Per-FedAvg HF 4 passes,
FedAvg-FT fine-tunes before scoring): the wall seconds column is the selected run's, and the
passes column each method's local compute as its run counted it (summary.json's
``compute``: forward/backward passes per client and round, plus, after "+", the passes a
client spends building the adapter it is scored with, FedAvg-FT's fine-tuning and
Per-FedAvg's adaptation step; centralized trains no client, its pooled party's passes in
brackets). ``ditto_equal`` is Ditto at FedAvg's compute (``equal_compute``: the global and
personal trainings share the round's steps). A
method runs its points one after another (``--jobs`` runs them in parallel), so split the
methods over two invocations with ``--jobs 1`` to keep both cores busy with one-point
methods, each under ``OMP_NUM_THREADS=1``: two invocations of torch's default two threads
on 2 cores ran a label-skew run in 15-27 minutes, of one thread each in 2-3 (``--jobs``
workers take one thread by themselves).

``--rounds``, ``--local-steps`` and ``--max-train-examples`` change the budget and size (the
size is part of each result's key, so several sizes share a results file), and
``--defaults`` drops the grid: every method at its default hyperparameters and the shared
learning rate, for budgets too large to tune on 2 cores; ``--set key=value`` fixes one
value (a point the small budget's grid selected, say), its results a table of their own. Clustered methods' rows also
carry the clusters they found and their adjusted Rand index against the true grouping
(tasks, label maps), and FedEM's the mean over clients of max_m π_m.

A method's selected point is the one with the best validation mean among its grid's rows in
the results file, a tie going to the earlier point in the method's grid (the order of
``sweep.expand``; values no longer in the grid after those in it, sorted), whatever the
order in which the rows were written. ``--seeds N`` re-runs each method's selected point at
seeds 1 … N - 1 after its grid (seed 0 is the selected run itself; a one-point grid, such
as ``--defaults`` at one learning rate, runs its seeds beside it under ``--jobs``): rows marked
``"replicate": true`` with their ``"seed"``, never candidates for selection, and the table
gains the client test mean ± std and p10 ± std over the seeds (sample std).

Invoked again, the harness runs only what is missing from the results file, and a run that
was killed (the machine stopped, the session ended) continues from its last resumable
checkpoint in its own run directory (``fedloom run --resume``'s mechanism) instead of
starting over. A grid point (or replicate) that a finished row of another size key already
ran with the same config, such as a ``--defaults`` run at the method's default value, is
copied under the grid's key (marked ``"reused"``) instead of run again.

    python -m benchmarks.personalization --federation a --out runs/pers-a.jsonl --jobs 2
    python -m benchmarks.personalization --table runs/pers-a.jsonl
    python -m benchmarks.personalization --federation c --lrs 0.001 --seeds 3 \\
        --methods fedavg,local,cfl --out runs/pers-c.jsonl    # selected point x 3 seeds
    python -m benchmarks.personalization --table runs/pers-c.jsonl --paired cfl-local
    python -m benchmarks.personalization --federation b --lrs 0.001 --rounds 16 \\
        --local-steps 8 --max-train-examples 1600 --defaults --out runs/pers-b-long.jsonl
    python -m benchmarks.personalization --federation a --methods fedavg,ditto \\
        --backbone tiny-bert --max-train-examples 200 --rounds 2 --out /tmp/p.jsonl  # smoke
    python -m benchmarks.personalization --federation c --lrs 0.001 --seeds 3 \\
        --out runs/pers-c.jsonl  # the selected points at seeds 0, 1, 2
    python -m benchmarks.personalization --federation m --lrs 0.001 --rounds 8 \\
        --local-steps 8 --max-train-examples 1600 --methods local,fedavg,fedmosaic \\
        --out runs/pers-m.jsonl  # two backbones; about 15-30 min a run on one thread
    python -m benchmarks.personalization --federation n --lrs 0.001 --rounds 8 \\
        --local-steps 64 --max-train-examples 7200 --defaults --methods local,fedmosaic \\
        --out runs/pers-n.jsonl  # 3600 examples per task
    python -m benchmarks.personalization --federation o --lrs 0.001 --rounds 8 \\
        --local-steps 32 --max-train-examples 7200 --defaults --seeds 3 \\
        --methods local,fedavg,fedmosaic --out runs/pers-o.jsonl  # 10-22 min a run
    python -m benchmarks.personalization --federation r --methods hetlora,flexlora,flora \\
        --rounds 8 --local-steps 16 --max-train-examples 4000 --out runs/pers-r.jsonl
    python -m benchmarks.personalization --federation a --lrs 0.001 --rounds 8 \\
        --local-steps 16 --max-train-examples 4000 --defaults --seeds 3 \\
        --set model.precision=auto --methods local,fedavg,fedavg_ft,ditto \\
        --out runs/pers-afull.jsonl  # the full MRPC training set on the fast path
    python -m benchmarks.personalization --federation b --lrs 0.001 --rounds 16 \\
        --local-steps 8 --max-train-examples 1600 --defaults --seeds 3 \\
        --set model.precision=auto --methods local,fedavg,fedavg_ft,ditto \\
        --out runs/pers-b4fast.jsonl  # (b) at 4x the budget on the fast path
    OMP_NUM_THREADS=1 python -m benchmarks.personalization --federation s --lrs 0.001 \\
        --rounds 8 --local-steps 24 --max-train-examples 1800 --defaults --seeds 3 \\
        --methods local --out benchmarks/results/pers-s-cpu-local.jsonl  # 3 runs: one
        # process per method (local,fedavg,fedavg_ft,ditto,ditto_equal,ifca,cfl,
        # fedmosaic), each with its own results file: two processes appending to one
        # could interleave their rows; equal passes (24 a round)
    cat benchmarks/results/pers-s-cpu-*.jsonl > runs/pers-s.jsonl
    python -m benchmarks.personalization --table runs/pers-s.jsonl \\
        --against local,ditto_equal,ditto,fedavg  # mean ± std, p10 ± std, paired
    python -m benchmarks.personalization --federation sst2-0.2 --lrs 0.001 --rounds 8 \\
        --local-steps 8 --max-train-examples 2400 \\
        --methods fedlc,fedrod,fedbabu,fedala,feddbe,oracle_ft \\
        --out runs/pers-skew-tune.jsonl  # the label-skew methods' defaults, on validation
    python -m benchmarks.personalization --federation sst2-0.1 --lrs 0.001 --rounds 8 \\
        --local-steps 8 --max-train-examples 2400 --defaults --seeds 3 \\
        --methods local,centralized,fedavg,fedavg_ft,fedper,fedlc,fedrod,fedbabu,fedala,feddbe,fedavg_la,oracle_la,oracle_ft \\
        --out runs/pers-skew.jsonl  # then sst2-0.3; mrpc-0.1 and mrpc-0.3 with
        # --max-train-examples 3600 (2,400 MRPC examples give Dirichlet 0.1 over 12 clients
        # no draw with 10 a client at seeds 0 and 1; 3,600 give one at seeds 0-2)
    python -m benchmarks.personalization --table runs/pers-skew.jsonl --against local \\
        --gap local-oracle_la --by-label-mix  # the share of local's gap to the oracle each
        # closes, and the differences on the clients holding one label and on the others

Federation (s)'s cost, measured on a 2-core AVX2 machine (no avx512), one method per core
at ``OMP_NUM_THREADS=1``: `local` 3,517 s a run (rounds of 5.3-5.6 min, then 13.5 min
of final scoring, most of it the four SmolLM2 adapters on 436 examples each), FedMosaic
4,040 s (rounds of 6.1-6.5 min). Two runs at a time (the command above, one per core),
so the 24 runs are about 12 hours of such a machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import tomli_w
import torch

from fedloom import algorithms, sweep
from fedloom.algorithms import relevance as rela
from fedloom.config import ConfigError, ExperimentConfig, to_toml_dict, validate
from fedloom.diagnostics.clusters import adjusted_rand, true_groups
from fedloom.experiment import build_algorithm, with_model_for
from fedloom.runtime.rundir import read_status

# raised inside PEFT on every forward pass with transformers 5 (as the CLI filters it)
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

GLUE_TASKS = ["MRPC", "SST-2", "RTE", "CoLA"]

FEDERATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "a": ("MRPC, 10 clients, Dirichlet 0.1", {
        "data": {"task": "MRPC"},
        "partition": {"scheme": "dirichlet", "alpha": 0.1, "num_clients": 10},
    }),
    "b": ("GLUE tasks MRPC / SST-2 / RTE / CoLA, 8 clients", {
        "data": {"max_dev_examples": 250},  # per task: each client is scored on >= 250
        "partition": {"scheme": "iid", "num_clients": 8, "tasks": {"names": GLUE_TASKS}},
    }),
    "d": ("two GLUE tasks, MRPC / SST-2, 8 clients", {
        "data": {"max_dev_examples": 250},  # per task: each client is scored on >= 250
        "partition": {"scheme": "iid", "num_clients": 8, "tasks": {"names": ["MRPC", "SST-2"]}},
    }),
    "m": ("MRPC / SST-2, 8 clients, clients 6 and 7 on SmolLM2-135M, the others MiniLM", {
        "data": {"max_dev_examples": 200},  # per task: >= 200 behind each client's score
        "partition": {"scheme": "iid", "num_clients": 8, "tasks": {"names": ["MRPC", "SST-2"]}},
        "model": {"groups": [{"clients": [6, 7], "backbone": "smollm2-135m",
                              "head": "verbalizer", "precision": "bf16"}]},
    }),
    "n": ("MRPC / SST-2, 2 + 6 clients, client 7 on SmolLM2-135M, the fast path", {
        "data": {"max_dev_examples": 400},  # per task: >= 400 behind each client's score
        # a 5 % validation split (about 70 examples per client, enough to check a run, not
        # to tune: n runs at the defaults): with 20 % held out, `local` reached only 69.3
        # and 67.6 % on MRPC (majority 68 %) on 1,152 examples; 1,440 gave 74.0 %
        "partition": {"scheme": "iid", "num_clients": 8, "val_fraction": 0.05,
                      "tasks": {"names": ["MRPC", "SST-2"], "clients": [2, 6]}},
        # MiniLM adapts every block: its top 3 alone learned MRPC less (71.1 % against
        # 74.0 % alone on 1800 examples; BENCHMARKS.md, "Frozen-prefix caching")
        "model": {"groups": [{"clients": [7], "backbone": "smollm2-135m",
                              "head": "verbalizer", "precision": "bf16", "prefix_cache": True,
                              "lora": {"r": 16, "alpha": 32, "dropout": 0.05,
                                       "layers": list(range(20, 30))}}]},
    }),
    "o": ("MRPC / SST-2, 4 + 4 MiniLM clients, MRPC too small to learn alone, the fast path", {
        "data": {"max_dev_examples": 400},  # per task: >= 400 behind each client's score
        # 900 MRPC examples a client (684 to train on): `local` stays near the majority
        # class there (BENCHMARKS.md, "Which GLUE tasks MiniLM learns alone")
        "partition": {"scheme": "iid", "num_clients": 8, "val_fraction": 0.05,
                      "tasks": {"names": ["MRPC", "SST-2"]}},
        "model": {"precision": "auto"},  # bf16 where the CPU has it: every row alike
    }),
    "l": ("SST-2, 8 clients, Dirichlet 0.3, LoRA r = 8 for every client", {
        "data": {"task": "SST-2"},
        "partition": {"scheme": "dirichlet", "alpha": 0.3, "num_clients": 8},
        "model": {"lora": {"r": 8, "alpha": 16}},
    }),
    "l4": ("federation l at the lowest rank of r, LoRA r = 4 for every client", {
        "data": {"task": "SST-2"},
        "partition": {"scheme": "dirichlet", "alpha": 0.3, "num_clients": 8},
        "model": {"lora": {"r": 4, "alpha": 8}},
    }),
    "r": ("federation l with mixed LoRA ranks 4 / 8 / 16 / 32, two clients each", {
        "data": {"task": "SST-2"},
        "partition": {"scheme": "dirichlet", "alpha": 0.3, "num_clients": 8},
        "model": {"lora": {"r": 8, "alpha": 16},
                  "ranks": [{"clients": [0, 1], "r": 4}, {"clients": [4, 5], "r": 16},
                            {"clients": [6, 7], "r": 32}]},
    }),
    # label skew (issue 43): 12 MiniLM clients, Dirichlet 0.1 and 0.3 over the labels, on
    # SST-2 and MRPC, at least 10 examples a client (Dirichlet 0.1 over 12 clients of a
    # two-class task gives no draw of 2,400 examples with 20 each); the label-skew methods'
    # defaults are chosen on a third federation no table reports (sst2-0.2, as it ran: at
    # least 20 a client)
    **{f"{task.lower().replace('-', '')}-{alpha}": (
        f"{task}, 12 clients, Dirichlet {alpha} label skew", {
            "data": {"task": task, "max_dev_examples": 400},  # >= 400 behind each score
            "partition": {"scheme": "dirichlet", "alpha": alpha, "num_clients": 12,
                          "min_size": min_size},
            "model": {"precision": "auto"},  # bf16 where the CPU has it: every row alike
            # no Self / Others (each client's adapter on every other client's split): the
            # table does not report it, and it was about half of a run's time
            "eval": {"others": "never"},
        }) for task, alpha, min_size in (("SST-2", 0.1, 10), ("SST-2", 0.3, 10),
                                         ("MRPC", 0.1, 10), ("MRPC", 0.3, 10),
                                         ("SST-2", 0.2, 20))},
    "c": ("MRPC concept shift, 10 clients, 30 % swap the labels", {
        "data": {"task": "MRPC"},
        "partition": {"scheme": "iid", "num_clients": 10,
                      "concept": {"fraction": 0.3, "kind": "swap"}},
    }),
    "s": (("SST-2 concept shift, 12 clients of 150 examples, 8-11 on SmolLM2-135M, clients "
           "0-3 and 8-9 swap the labels, equal passes; a frozen shared MiniLM head for "
           "FedMosaic only (no other method has one)"), {
        "data": {"task": "SST-2", "max_dev_examples": 400},  # >= 400 behind each score
        # the table reports no Self / Others; scoring each personal adapter on the dev set
        # once more would cost a SmolLM2 client about 3 minutes on one CPU thread
        "eval": {"others": "never"},
        # 1,800 pooled examples (--max-train-examples 1800): 150 a client, 30 test, 6 of
        # the rest held out for validation (enough to check a run, not to tune: s runs
        # at the defaults), 114 to train on; the swap balanced across backbones (4
        # MiniLM + 2 SmolLM2 clients per labeling), so within-architecture FedAvg
        # averages the two labelings equally on each backbone
        "partition": {"scheme": "iid", "num_clients": 12, "val_fraction": 0.05,
                      "concept": {"clients": [0, 1, 2, 3, 8, 9], "kind": "swap"}},
        # SmolLM2 as in federation n (verbalizer: its frozen LM head, the same on every
        # client; LoRA r = 16 in its top 10 blocks with the frozen-prefix cache) but in
        # fp32, which every device runs alike: bf16 autocast is emulated, and slower than
        # fp32, on a CPU without avx512_bf16, and slower than fp32 on CUDA at these batch
        # sizes (fedloom.device)
        "model": {"groups": [{"clients": [8, 9, 10, 11], "backbone": "smollm2-135m",
                              "head": "verbalizer", "precision": "fp32", "prefix_cache": True,
                              "lora": {"r": 16, "alpha": 32, "dropout": 0.05,
                                       "layers": list(range(20, 30))}}]},
        # per algorithm name, under every row of that algorithm (a row's own keys win):
        # FedMosaic's shared frozen output (MiniLM's classifier head frozen at its seeded
        # start, the same on every MiniLM client, as the SmolLM2 clients' LM head)
        "algorithm": {"fedmosaic": {"head": "frozen"}},
    }),
}

#: federations whose methods run at equal training passes per client and round
#: (summary.json's ``compute``, the table's passes column): a method whose round costs
#: more passes than its local steps takes fewer steps (:func:`equal_pass_steps`)
EQUAL_PASSES = frozenset({"s"})

BASE: dict[str, Any] = {
    "seed": 0,
    "partition": {"test_fraction": 0.2, "val_fraction": 0.2},
    "model": {"backbone": "minilm", "lora": {"r": 16, "alpha": 32, "dropout": 0.05},
              "precision": "fp32"},  # its tables ran in fp32, before "auto" became the default
    "federation": {"rounds": 8},
    "train": {"local_steps": 4, "batch_size": 8, "head_lr": 3e-3},
    "diagnostics": {"every": 0},
}

#: learning rates every method is swept over (``train.lr``: the LoRA factors; the head at 3e-3)
LRS = (1e-3, 3e-3)

#: row label -> (the [algorithm] table, {its key hyperparameter: values to sweep})
METHODS: dict[str, tuple[dict[str, Any], dict[str, tuple[Any, ...]]]] = {
    "centralized": ({"name": "centralized"}, {}),
    "local": ({"name": "local"}, {}),
    "fedavg": ({"name": "fedavg"}, {}),
    "fedavg_ft": ({"name": "fedavg_ft"}, {"ft_epochs": (1.0, 3.0)}),
    "fedper": ({"name": "fedper"}, {}),
    "lg_fedavg": ({"name": "lg_fedavg"}, {}),
    "fedrep": ({"name": "fedrep"}, {"head_epochs": (0.25, 1.0)}),
    "fedsa_lora": ({"name": "fedsa_lora"}, {}),
    "ditto": ({"name": "ditto"}, {"lam": (0.1, 1.0)}),
    # Ditto at FedAvg's local compute: its two trainings share the round's step budget
    "ditto_equal": ({"name": "ditto", "equal_compute": True}, {"lam": (0.1, 1.0)}),
    # one λ (the paper's): K = 5 inner steps make each local step 5 passes
    "pfedme": ({"name": "pfedme"}, {"lam": (15.0,)}),
    # first-order: half the passes of the Hessian-free variant at this budget
    "perfedavg": ({"name": "perfedavg", "variant": "fo"}, {"alpha": (0.01, 0.03)}),
    "apfl": ({"name": "apfl"}, {"alpha": (0.25, 0.75)}),
    # θ = lr·λ(1−p)/p with p = 1/local_steps: λ = 1 barely couples, λ = 100 pulls hard
    "l2gd": ({"name": "l2gd"}, {"lam": (10.0, 100.0)}),
    "fedlocal_global": ({"name": "fedlocal_global"}, {}),
    # clustered / multi-task (issue 10): the clusters' ARI against the true grouping is recorded
    "ifca": ({"name": "ifca"}, {"num_clusters": (2, 4)}),
    "cfl": ({"name": "cfl"}, {"max_cross_similarity": (-0.02, 0.0)}),
    # M local trainings a round: FedEM costs M times FedAvg's compute
    "fedem": ({"name": "fedem"}, {"num_components": (2, 3)}),
    # the paper's random initialization of the components, for comparison
    "fedem_random": ({"name": "fedem", "initialization": "random"}, {"num_components": (2, 3)}),
    "mocha": ({"name": "mocha"}, {"lam": (0.01, 0.1)}),
    "fedu": ({"name": "fedu"}, {"graph": ("full", "similarity")}),
    # K = 5 inner steps, as pFedMe; λ < 1 keeps the objective bounded (see its docstring)
    "pfedmac": ({"name": "pfedmac"}, {"lam": (0.03, 0.1)}),
    "mixture_admm": ({"name": "mixture_admm"}, {"lam": (0.1, 1.0)}),
    "fedmgda_plus": ({"name": "fedmgda_plus"}, {"epsilon": (0.1, 1.0)}),
    # FedMosaic (issue 16): the reference's T = 0.5 and a sharper softmax; ablations at the
    # same grid: uniform weights over the others instead of relevance, no sanitization noise
    "fedmosaic": ({"name": "fedmosaic"}, {"temperature": (0.5, 0.1)}),
    "fedmosaic_uniform": ({"name": "fedmosaic", "weighting": "uniform"}, {}),
    "fedmosaic_nonoise": ({"name": "fedmosaic", "noise_multiplier": 0.0}, {"temperature": (0.5, 0.1)}),
    # the global slot trained with the local adapter and sent in its place (fedloom's variant)
    "fedmosaic_trained": ({"name": "fedmosaic", "global_slot": "trained"}, {"temperature": (0.5, 0.1)}),
    # P and Q aggregated within each backbone only: what crosses architectures is lost
    "fedmosaic_nopq": ({"name": "fedmosaic", "share_pq": False}, {"temperature": (0.5, 0.1)}),
    # the weight of the clients that lack a tensor on its initial value, instead of the
    # official renormalization over those that have it (mixed backbones)
    "fedmosaic_initial": ({"name": "fedmosaic", "absent": "initial"},
                          {"temperature": (0.5, 0.1)}),
    # scored with the slot rebuilt from the last aggregate, not the one it trained with
    "fedmosaic_latest": ({"name": "fedmosaic", "scored_slot": "latest"},
                         {"temperature": (0.5, 0.1)}),
    # an encoder's head frozen at its seeded start, the same on every client
    "fedmosaic_frozen_head": ({"name": "fedmosaic", "head": "frozen"},
                              {"temperature": (0.5, 0.1)}),
    # label skew (issue 43): the pooled model with each client's prior (the oracle), and the
    # methods built for label skew
    "oracle_la": ({"name": "oracle_prior", "prior": "logit_adjust"}, {}),
    "oracle_ft": ({"name": "oracle_prior", "prior": "head_finetune"}, {"ft_epochs": (1.0, 5.0)}),
    # the oracle's correction on FedAvg's federated features, T fitted by each client (or 1)
    "fedavg_la": ({"name": "fedavg_la"}, {"calibrate": (True, False)}),
    "fedbabu": ({"name": "fedbabu"}, {"ft_epochs": (1.0, 5.0)}),
    "fedlc": ({"name": "fedlc"}, {"tau": (0.1, 1.0)}),
    "fedrod": ({"name": "fedrod"}, {"gamma": (0.5, 1.0)}),
    # the share of a client's examples the aggregation weights learn on: the paper's 80 %
    # costs several passes over the client's data a round, 5 % about FedAvg's compute
    "fedala": ({"name": "fedala"}, {"rand_percent": (5.0, 80.0)}),
    "feddbe": ({"name": "feddbe"}, {"mr_weight": (1.0, 50.0)}),
    # LoRA-aware aggregation (issue 17): every client at the same rank (federation l), or
    # mixed ranks (r: only hetlora, flexlora and flora are defined there)
    "fedit": ({"name": "fedit"}, {}),
    "ffa_lora": ({"name": "ffa_lora"}, {}),
    "fedex_lora": ({"name": "fedex_lora"}, {}),
    "flora": ({"name": "flora"}, {}),
    "fedsvd": ({"name": "fedsvd"}, {}),
    "hetlora": ({"name": "hetlora"}, {}),
    "flexlora": ({"name": "flexlora"}, {}),
}


def base_config(federation: str, method: str, *, backbone: str, max_train: int,
                rounds: int, local_steps: int = 4) -> dict[str, Any]:
    """The unvalidated config of ``method`` on ``federation`` (before the grid)."""
    raw = json.loads(json.dumps(BASE))
    sections = FEDERATIONS[federation][1]
    for section, values in sections.items():
        if section != "algorithm":  # per algorithm name: below
            raw.setdefault(section, {}).update(json.loads(json.dumps(values)))
    tasks = raw["partition"].get("tasks")
    raw["data"]["max_train_examples"] = max_train // len(tasks["names"]) if tasks else max_train
    # at least 20 examples per client at the default size (a test split of 4 or more);
    # Dirichlet(0.1) cannot give 10 clients that many from a smoke test's 200 examples
    raw["partition"]["min_size"] = max(2, min(sections["partition"].get("min_size", 20),
                                              max_train // 64))
    raw["name"] = f"pers-{federation}-{method}"
    raw["model"]["backbone"] = backbone
    raw["federation"]["rounds"] = rounds
    raw["train"]["local_steps"] = local_steps
    raw["eval"] = {**raw.get("eval", {}), "every": rounds}
    name = METHODS[method][0]["name"]
    raw["algorithm"] = {**sections.get("algorithm", {}).get(name, {}), **METHODS[method][0]}
    if federation in EQUAL_PASSES:
        raw["train"]["local_steps"] = equal_pass_steps(raw["algorithm"], local_steps)
    if algorithms.create(raw["algorithm"]["name"]).pools_data:
        clients = raw["partition"]["num_clients"]  # every client takes part in every round
        raw["train"]["local_steps"] *= clients
    return raw


def equal_pass_steps(algorithm: dict[str, Any], local_steps: int) -> int:
    """The local steps at which ``algorithm`` (an [algorithm] table) trains as many passes
    per client and round as ``local_steps`` plain steps. FedMosaic adds one anchor gradient
    every ``grad_every`` steps (its task vector: ⌈S'/g⌉ passes, on the anchor backbone), so
    it takes the S' with S' + ⌈S'/g⌉ = S (20 of 24 at g = 5); every other method takes S:
    a method whose step costs more passes by definition runs as defined, and its
    compute-matched variant is a row of its own (Ditto: 2·S passes, ``ditto_equal`` S)."""
    if algorithm["name"] != "fedmosaic":
        return local_steps
    every = algorithms.create(**algorithm).grad_every
    steps = local_steps * every // (every + 1)
    if steps < 1 or steps + math.ceil(steps / every) != local_steps:
        raise ConfigError(
            f"--local-steps {local_steps}: no FedMosaic step count S' gives S' + "
            f"ceil(S'/{every}) = {local_steps} training passes (equal compute); choose a "
            f"multiple of {every + 1}")
    return steps


def grid(method: str, lrs: tuple[float, ...] = LRS, defaults: bool = False,
         fixed: tuple[sweep.Axis, ...] = ()) -> list[sweep.Axis]:
    """The shared learning rates times the method's key hyperparameter (``defaults``: the
    method's default value alone, for runs too costly for a grid); ``fixed`` axes of one
    value each replace the method's own axis for their key."""
    keys = {axis.key for axis in fixed}
    own = [] if defaults else [sweep.Axis(f"algorithm.{key}", tuple(values))
                               for key, values in METHODS[method][1].items()]
    return [sweep.Axis("train.lr", lrs), *[a for a in own if a.key not in keys], *fixed]


def registered(method: str) -> bool:
    return METHODS[method][0]["name"] in algorithms.available()


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _key(row: dict[str, Any]) -> str:
    """A result's identity: federation, method, size, overrides and a replicate's seed."""
    seed = row["seed"] if row.get("replicate") else None
    return json.dumps([row["federation"], row["method"], row["size"], row["overrides"], seed],
                      sort_keys=True)


def _rank(value: Any, values: tuple[Any, ...]) -> tuple[int, float, str]:
    """``value``'s place on an axis: its position among ``values``; else after them,
    numbers by size, other values by their TOML text."""
    if value in values:
        return (0, float(values.index(value)), "")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (1, float(value), "")
    return (1, math.inf, sweep.toml_value(value))


def grid_position(method: str, size: dict[str, Any], overrides: dict[str, Any]) -> tuple:
    """Where ``overrides`` stands in ``method``'s grid at ``size``: the order in which
    ``sweep.expand`` lists its points (the first axis slowest); keys outside today's grid
    come after its axes, sorted, and a key a point lacks sorts last."""
    fixed = tuple(sweep.Axis(key, (value,)) for key, value in size.get("set", {}).items())
    axes = {a.key: a.values for a in grid(method, LRS, size.get("defaults", False), fixed)}
    keys = [*axes, *sorted(set(overrides) - set(axes))]
    return tuple(_rank(overrides[key], axes.get(key, ())) if key in overrides
                 else (2, 0.0, "") for key in keys)


def selected_row(method: str, size: dict[str, Any],
                 rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``method``'s row with the best validation mean among its grid's rows at ``size``
    (replicates never), a tie going to the earlier point in its grid; None if all failed."""
    points = sorted((r for r in rows if not r.get("replicate")),
                    key=lambda r: grid_position(method, size, r["overrides"]))
    best = sweep.select([{**p, "index": i} for i, p in enumerate(points)])
    return None if best is None else points[best]


def append_row(out: Path, head: dict[str, Any], total: int, record: dict[str, Any]) -> None:
    """A finished run as one results line (``head``: federation, method, size) and a
    progress line."""
    run_dir = Path(record["run_dir"])
    row = {**head, **record, **groups_found(run_dir), **relevance_found(run_dir),
           **others_found(run_dir), **client_scores_found(run_dir, record.get("adapter")),
           **traffic_found(run_dir), **compute_found(run_dir), **label_mix_found(run_dir)}
    with out.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{head['method']}: {sweep.progress_line(record, total)}", flush=True)


def run_grid(args: argparse.Namespace, head: dict[str, Any], raw: dict[str, Any],
             axes: list[sweep.Axis]) -> None:
    """The points of the method's grid that are not in the results file yet (the
    federation of every seed checked first)."""
    out = Path(args.out)
    done = {_key(r) for r in read_rows(out)}
    if all(_key({**head, "overrides": combo}) in done for combo in sweep.expand(axes)):
        return
    plan = sweep.plan(raw, axes, data_dir_overrides(args.data_dir), seeds=args.seeds)
    todo = [p for p in plan.points if _key({**head, "overrides": p.overrides}) not in done]
    execute_missing(args, head, plan, todo)


def _directory(args: argparse.Namespace, method: str, todo: list[sweep.Point]) -> Path:
    """Where ``todo`` runs: the newest sweep directory of ``method`` holding a killed run
    of one of its points (that run then resumes from its checkpoint), else a new one."""
    root = Path(args.runs) / args.federation
    for directory in sorted(root.glob(f"{method}-sweep-*"), reverse=True):
        if any(_killed_run_of(directory / p.slug, p) for p in todo):
            return directory
    return sweep.create_dir(root, method)


def _killed_run_of(run: Path, point: sweep.Point) -> bool:
    """Whether ``run`` is an unfinished, resumable run of ``point``'s config."""
    status = read_status(run)
    if status is None or status.get("state") == "finished" or not (
            run / "checkpoints" / "resume").is_dir():
        return False
    return _ran_config_of(run, point)


def _ran_config_of(run: Path, point: sweep.Point) -> bool:
    """Whether ``run`` (started or finished) ran exactly ``point``'s config: the same
    algorithm, its defaults filled in (a run's config.toml holds only the keys that were
    set), and the same other sections."""
    saved = run / "config.toml"
    if not saved.is_file():
        return False
    ran = validate(tomllib.loads(saved.read_text()))
    algorithm = build_algorithm(point.config)
    if build_algorithm(ran) != algorithm:
        return False
    return _sections_but_algorithm(ran) == _sections_but_algorithm(
        with_model_for(algorithm, point.config))


def _sections_but_algorithm(cfg: ExperimentConfig) -> dict[str, Any]:
    """``cfg`` as its config.toml reads back, without the algorithm section."""
    sections = tomllib.loads(tomli_w.dumps(to_toml_dict(cfg)))
    return {key: value for key, value in sections.items() if key != "algorithm"}


def reuse_finished(out: Path, head: dict[str, Any], todo: list[sweep.Point]) -> list[sweep.Point]:
    """The points of ``todo`` that no successful row of the method in ``out`` already ran.

    A row recorded under another size key can hold the same run: a ``--defaults`` run at
    lr x is the grid point (x, the method's default value), and its seeds are that point's
    replicates. Such a row is written again under ``head``'s size and the point's
    overrides, marked ``"reused"`` with the size it ran under, instead of running again.
    A failed row is never reused: the point runs.
    """
    rows = [r for r in read_rows(out) if r["federation"] == head["federation"]
            and r["method"] == head["method"] and r["size"] != head["size"]
            and not r.get("error")]
    left = []
    for point in todo:
        same = next((r for r in rows if r.get("replicate", False) == point.replicate
                     and r.get("seed", 0) == point.config.seed
                     and _ran_config_of(Path(r["run_dir"]), point)), None)
        if same is None:
            left.append(point)
            continue
        row = {**same, **head, "index": point.index, "overrides": point.overrides,
               "reused": same.get("reused", same["size"])}
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{head['method']}: point {point.index} reuses {same['run_dir']}", flush=True)
    return left


def run_replicates(args: argparse.Namespace, head: dict[str, Any], raw: dict[str, Any]) -> None:
    """The method's selected point (on validation, as the table selects it) at the seeds
    after its own, up to ``args.seeds`` in all; seeds already in the results file are
    skipped."""
    out = Path(args.out)
    rows = [r for r in read_rows(out) if all(r[key] == value for key, value in head.items())]
    best = selected_row(head["method"], head["size"], rows)
    if best is None:
        print(f"{head['method']}: every point failed, nothing to replicate", file=sys.stderr)
        return
    fixed = [sweep.Axis(key, (value,)) for key, value in best["overrides"].items()]
    plan = sweep.plan(raw, fixed, data_dir_overrides(args.data_dir), seeds=args.seeds)
    done = {_key(r) for r in rows}
    execute_missing(args, head, plan, missing_replicates(head, plan.points[0], args.seeds, done))


def run_point_and_seeds(args: argparse.Namespace, head: dict[str, Any], raw: dict[str, Any],
                        axes: list[sweep.Axis]) -> None:
    """A one-point grid (``--defaults`` at one learning rate, say) and its seeds after its
    own, side by side under ``--jobs``: its one point is the selected one before it runs,
    so its replicates need not wait for it. Rows already in the results file are skipped."""
    plan = sweep.plan(raw, axes, data_dir_overrides(args.data_dir), seeds=args.seeds)
    (point,) = plan.points
    done = {_key(r) for r in read_rows(Path(args.out))}
    todo = [] if _key({**head, "overrides": point.overrides}) in done else [point]
    execute_missing(args, head, plan, todo + missing_replicates(head, point, args.seeds, done))


def missing_replicates(head: dict[str, Any], point: sweep.Point, seeds: int,
                       done: set[str]) -> list[sweep.Point]:
    """``point``'s replicates (up to ``seeds`` runs in all) whose rows are not ``done``."""
    return [p for p in sweep.replicates(point, seeds) if _key(
        {**head, "overrides": p.overrides, "replicate": True, "seed": p.config.seed}) not in done]


def execute_missing(args: argparse.Namespace, head: dict[str, Any], plan: sweep.Plan,
                    todo: list[sweep.Point]) -> None:
    """Run the points of ``todo`` that no finished row can stand for, their rows appended
    to the results file as each ends."""
    out = Path(args.out)
    todo = reuse_finished(out, head, todo)
    if todo:
        directory = _directory(args, head["method"], todo)
        sweep.execute(todo, directory, plan.metric, jobs=args.jobs,
                      on_record=partial(append_row, out, head, len(plan.points)))


def run(args: argparse.Namespace) -> None:
    size = {"backbone": args.backbone, "max_train_examples": args.max_train_examples,
            "rounds": args.rounds}
    if args.local_steps != BASE["train"]["local_steps"]:
        size["local_steps"] = args.local_steps
    if args.defaults:
        size["defaults"] = True
    if args.set:
        size["set"] = {axis.key: axis.values[0] for axis in args.set}
    for method in args.methods:
        if not registered(method):
            print(f"skipping {method}: algorithm {METHODS[method][0]['name']!r} is not "
                  f"registered (fedloom.algorithms.available())", file=sys.stderr)
            continue
        head = {"federation": args.federation, "method": method, "size": size}
        raw = base_config(args.federation, method, backbone=args.backbone,
                          max_train=args.max_train_examples, rounds=args.rounds,
                          local_steps=args.local_steps)
        axes = grid(method, args.lrs, args.defaults, tuple(args.set))
        if args.seeds > 1 and len(sweep.expand(axes)) == 1:
            run_point_and_seeds(args, head, raw, axes)
        else:
            run_grid(args, head, raw, axes)
            if args.seeds > 1:
                run_replicates(args, head, raw)


def groups_found(run_dir: Path) -> dict[str, Any]:
    """What a clustered run found: its final clusters, their adjusted Rand index against the
    true grouping, and for FedEM the mean over clients of max_m π_m."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return {}
    clusters = final_clusters(json.loads(summary_path.read_text(encoding="utf-8")))
    if clusters is None:
        return {}
    stats = json.loads((run_dir / "partition.json").read_text(encoding="utf-8"))
    found: dict[str, Any] = {"clusters": clusters,
                             "ari": adjusted_rand(clusters, true_groups(stats))}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mixtures = [r["weights"] for r in rows if r.get("scope") == "mixture"]
    if mixtures:
        found["mean_max_pi"] = sum(max(pi) for pi in mixtures[-1].values()) / len(mixtures[-1])
    return found


def final_clusters(summary: dict[str, Any]) -> dict[str, int] | None:
    """A run's final cluster of each client; on a mixed-backbone run (one server state per
    backbone, ``server_by_backbone``) the clusters of every backbone numbered apart, since
    a cluster never spans backbones. None for a method without clusters."""
    if "clusters" in summary:
        return summary["clusters"]
    by_backbone = [entry["clusters"] for entry in summary.get("server_by_backbone", {}).values()
                   if "clusters" in entry]
    if not by_backbone:
        return None
    numbered: dict[tuple[int, int], int] = {}
    return {client: numbered.setdefault((b, label), len(numbered))
            for b, clusters in enumerate(by_backbone) for client, label in clusters.items()}


def relevance_found(run_dir: Path) -> dict[str, Any]:
    """How well a relevance-guided run (FedMosaic) told the groups apart: per round, the
    mean relevance within true groups minus across them (``relevance_gap``); for its last
    matrix, the mean share of each client's aggregation weight on its own group's clients
    against the uniform share (``own_share``, ``uniform_share``)."""
    rows_path = run_dir / "metrics.jsonl"
    if not rows_path.is_file():
        return {}
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    matrices = [r for r in rows if r.get("scope") == "relevance"]
    if not matrices:
        return {}
    stats = json.loads((run_dir / "partition.json").read_text(encoding="utf-8"))
    truth = true_groups(stats)
    names = sorted(set(truth.values()))
    groups = {int(c): names.index(g) for c, g in truth.items()}
    gaps = [rela.within_minus_cross(torch.tensor(m["matrix"]), m["clients"], groups)
            for m in matrices]
    config = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    last = matrices[-1]
    if config["algorithm"].get("weighting", "relevance") == "uniform":
        weights = {i: {j: 1 / (len(last["clients"]) - 1) for j in last["clients"] if j != i}
                   for i in last["clients"]}
    else:
        temperature = config["algorithm"].get("temperature", algorithms.create("fedmosaic").temperature)
        weights = rela.relevance_weights(torch.tensor(last["matrix"]), last["clients"], temperature,
                                         dict.fromkeys(last["clients"], True))
    return {"relevance_gap": gaps, **rela.own_group_share(weights, groups)}


def others_found(run_dir: Path) -> dict[str, Any]:
    """The Self / Others scores of the adapters the clients use (summary.json)."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return {}
    found = json.loads(summary_path.read_text(encoding="utf-8")).get("self_others")
    return {} if found is None else {"self_others": found}


def client_scores_found(run_dir: Path, adapter: str | None) -> dict[str, Any]:
    """Each client's last test score with the adapter it uses (``per_client``) and, in a
    mixed-backbone federation, the clients of ``[[model.groups]]`` (``group_clients``)."""
    rows_path = run_dir / "metrics.jsonl"
    if adapter is None or not rows_path.is_file():
        return {}
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    scored = [r for r in rows if r.get("scope") == f"{adapter}/clients"]
    if not scored:
        return {}
    config = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    metric = next(iter(scored[-1]["metrics"]))
    found: dict[str, Any] = {"per_client": {c: s.get(metric)
                                            for c, s in scored[-1]["per_client"].items()}}
    groups = config.get("model", {}).get("groups", [])
    if groups:
        found["group_clients"] = sorted(c for g in groups for c in g["clients"])
    return found


def traffic_found(run_dir: Path) -> dict[str, Any]:
    """The adapter bytes sent down and up per round, averaged over the rounds."""
    rows_path = run_dir / "metrics.jsonl"
    if not rows_path.is_file():
        return {}
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    train = [r for r in rows if r.get("scope") == "train" and "bytes_down" in r]
    if not train:
        return {}
    return {direction: sum(r[direction] for r in train) / len(train)
            for direction in ("bytes_down", "bytes_up")}


def compute_found(run_dir: Path) -> dict[str, Any]:
    """The run's local compute (summary.json's ``compute``): training passes per client and
    round, and where the method has them, its passes to build a scored adapter and a
    pooled party's passes per round."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return {}
    compute = json.loads(summary_path.read_text(encoding="utf-8")).get("compute", {})
    keys = ("train_passes_per_client_round", "adapt_passes_per_client", "pooled_passes_per_round")
    return {key: compute[key] for key in keys if key in compute}


def label_mix_found(run_dir: Path) -> dict[str, Any]:
    """Each client's training label counts (partition.json's), for the paired table split
    by label mix (``by_label_mix``); nothing for a task without classes."""
    path = run_dir / "partition.json"
    if not path.is_file():
        return {}
    clients = json.loads(path.read_text(encoding="utf-8"))["clients"]
    counts = {str(c["client_id"]): c["label_counts"] for c in clients
              if c.get("label_counts") is not None}
    return {"client_label_counts": counts} if counts else {}


def group_mean(row: dict[str, Any]) -> float | None:
    """The mean score of the clients on ``[[model.groups]]``' backbones (None: not recorded)."""
    scores = [row.get("per_client", {}).get(str(c)) for c in row.get("group_clients", [])]
    scores = [s for s in scores if s is not None]
    return sum(scores) / len(scores) if scores else None


def data_dir_overrides(data_dir: str | None) -> list[str]:
    return [f"data.data_dir={json.dumps(data_dir)}"] if data_dir else []


def _pct(stats: dict[str, float] | float | None, key: str = "mean") -> str:
    value = sweep.stat_value(stats, key)
    return "—" if value is None else f"{value:.1%}".replace("%", " %")


def _ari(row: dict[str, Any]) -> str:
    if row.get("ari") is None:
        return "—"
    text = f"{row['ari']:.2f}"
    return text + (f" (max π {row['mean_max_pi']:.2f})" if "mean_max_pi" in row else "")


def _others(row: dict[str, Any]) -> str:
    """The mean Others score of the adapters the clients use (—: not recorded)."""
    found = row.get("self_others")
    if not found:
        return "—"
    return _pct(found["others"].get(row["metric"]))


def _relevance(row: dict[str, Any]) -> list[str]:
    """A relevance-guided row's within-minus-cross relevance after the first and the last
    round, and the mean weight share on a client's own group (the uniform share)."""
    gaps = [g for g in row.get("relevance_gap") or [] if g is not None]
    if not gaps:
        return ["—", "—"]
    share = (f"{row['own_share']:.2f} ({row['uniform_share']:.2f})"
             if row.get("own_share") is not None else "—")
    return [f"{gaps[0]:+.2f} → {gaps[-1]:+.2f}", share]


def _pct_std(values: list[float | None]) -> str:
    """``"61.0 ± 2.5 %"``: mean ± sample std of the values present (no ± for one)."""
    stats = sweep.mean_std(values)
    if stats["mean"] is None:
        return "—"
    std = "" if stats["std"] is None else f" ± {100 * stats['std']:.1f}"
    return f"{100 * stats['mean']:.1f}{std} %"


def _passes(row: dict[str, Any]) -> str:
    """``"8"``, ``"4 + 12"`` (passes to build the scored adapter), ``"0 (pooled 40)"``."""
    passes = row.get("train_passes_per_client_round")
    if passes is None:
        return "—"
    text = f"{passes:.3g}"
    if row.get("adapt_passes_per_client"):
        text += f" + {row['adapt_passes_per_client']:.3g}"
    if row.get("pooled_passes_per_round") is not None:
        text += f" (pooled {row['pooled_passes_per_round']:.3g})"
    return text


def _megabytes(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e6:.2f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _over_seeds(runs: list[dict[str, Any]]) -> list[str]:
    """The replicate columns: client test mean ± std, p10 ± std, the same client mean on
    the clients' own test splits where the test scores are dev-weighted (the precision
    the weighting gains is the ratio of the two stds), and the seeds scored."""
    means = [sweep.stat_value(r["test"]) for r in runs]
    split = [sweep.stat_value(r.get("test_split")) for r in runs]
    return [_pct_std(means), _pct_std([sweep.stat_value(r["test"], "p10") for r in runs]),
            _pct_std(split) if any(v is not None for v in split) else "—",
            _pct_std([group_mean(r) for r in runs]), str(sum(m is not None for m in means))]


def seed_runs(method: str, rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Seed -> run of ``method``'s selected point: its own row and its replicates."""
    runs = [r for r in rows if r["method"] == method]
    best = selected_row(method, runs[0]["size"], runs) if runs else None
    if best is None:
        return {}
    same = [r for r in runs if r.get("replicate") and r["overrides"] == best["overrides"]]
    return {r["seed"]: r for r in [best, *same]}


def _paired_value(run: dict[str, Any], field: str) -> float | None:
    """What the paired table differences: the client mean of ``test`` or ``test_split``,
    the clients' p10 (``p10``, dev-weighted) or the other-backbone clients' mean (``group``)."""
    if field == "group":
        return group_mean(run)
    if field == "p10":
        return sweep.stat_value(run.get("test"), "p10")
    return sweep.stat_value(run.get(field))


def paired(path: Path, pairs: list[tuple[str, str]]) -> str:
    """Paired differences, method a minus method b on the same seeds (the same partition
    and sampling stream): of the client mean under both client scores, of the clients'
    p10 (dev-weighted) and of the other-backbone clients' mean; mean ± sample std over
    seeds, and each seed's difference. Pairing removes what the seed does to both."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in read_rows(path):
        groups.setdefault(json.dumps([row["federation"], row["size"]], sort_keys=True),
                          []).append(row)
    out = [("| federation | a − b | seeds | dev-weighted: mean ± std (per seed) "
            "| dev-weighted p10: mean ± std (per seed) "
            "| own test splits: mean ± std (per seed) "
            "| other-backbone clients: mean ± std (per seed) |"),
           "|---|---|---:|---:|---:|---:|---:|"]
    for key, rows in groups.items():
        for a, b in pairs:
            runs_a, runs_b = seed_runs(a, rows), seed_runs(b, rows)
            seeds = sorted(runs_a.keys() & runs_b.keys())
            if not seeds:
                continue
            cells = []
            for field in ("test", "p10", "test_split", "group"):
                values = [(_paired_value(runs_a[s], field), _paired_value(runs_b[s], field))
                          for s in seeds]
                if any(x is None or y is None for x, y in values):
                    cells.append("—")
                    continue
                diffs = [x - y for x, y in values]
                each = ", ".join(f"{100 * d:+.1f}" for d in diffs)
                cells.append(f"{_pct_std(diffs)} ({each})")
            out.append(f"| {json.loads(key)[0]} | {a} − {b} | {len(seeds)} | "
                       + " | ".join(cells) + " |")
    return "\n".join(out)


def label_mix_groups(row: dict[str, Any]) -> dict[str, list[str]]:
    """The clients of a run whose training split holds one label (``one-label``) and those
    holding several (``mixed``), from its ``client_label_counts``; empty where not recorded."""
    counts = row.get("client_label_counts") or {}
    groups: dict[str, list[str]] = {"one-label": [], "mixed": []}
    for client, labels in counts.items():
        groups["one-label" if sum(n > 0 for n in labels) == 1 else "mixed"].append(client)
    return groups if counts else {}


def by_label_mix(path: Path, pairs: list[tuple[str, str]]) -> str:
    """Paired differences a − b on the same seeds, split by the clients' label mix: the
    mean over the clients whose training split holds one label and over those holding
    several (each seed's partition decides which are which), with b's own mean on each
    group beside it: where a method's gain or loss against b comes from. Mean ± sample
    std over the seeds where both ran and the group has clients; the clients per seed."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in read_rows(path):
        groups.setdefault(json.dumps([row["federation"], row["size"]], sort_keys=True),
                          []).append(row)
    names = ("one-label", "mixed")
    out = ["| federation | a − b | seeds | " + " | ".join(
               f"{g} clients: a − b, mean ± std (per seed) | {g}: b's mean | {g}: clients"
               for g in names) + " |",
           "|---|---|---:|" + "---:|---:|---:|" * len(names)]
    for key, rows in groups.items():
        for a, b in pairs:
            runs_a, runs_b = seed_runs(a, rows), seed_runs(b, rows)
            seeds = [s for s in sorted(runs_a.keys() & runs_b.keys())
                     if label_mix_groups(runs_b[s])]
            if not seeds:
                continue
            cells = []
            for name in names:
                diffs, levels, sizes = [], [], []
                for seed in seeds:
                    clients = label_mix_groups(runs_b[seed])[name]
                    score_a = runs_a[seed].get("per_client", {})
                    score_b = runs_b[seed].get("per_client", {})
                    pairs_ab = [(score_a.get(c), score_b.get(c)) for c in clients]
                    pairs_ab = [(x, y) for x, y in pairs_ab if x is not None and y is not None]
                    sizes.append(str(len(clients)))
                    if pairs_ab:
                        diffs.append(sum(x - y for x, y in pairs_ab) / len(pairs_ab))
                        levels.append(sum(y for _, y in pairs_ab) / len(pairs_ab))
                each = ", ".join(f"{100 * d:+.1f}" for d in diffs)
                cells += [f"{_pct_std(diffs)} ({each})" if diffs else "—",
                          _pct_std(levels) if levels else "—", ", ".join(sizes)]
            out.append(f"| {json.loads(key)[0]} | {a} − {b} | {len(seeds)} | "
                       + " | ".join(cells) + " |")
    return "\n".join(out)


def gap_closed(path: Path, low: str, high: str) -> str:
    """The share of the ``low``-to-``high`` gap each method closes (e.g. `local` to the
    oracle), seed by seed: (m − low) / (high − low) of the dev-weighted client mean and of
    the clients' p10, mean ± sample std over the seeds where all three ran. A seed where
    ``high`` does not beat ``low`` has no gap to close: its cell is "n/a" and the seed is
    left out of the mean."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in read_rows(path):
        groups.setdefault(json.dumps([row["federation"], row["size"]], sort_keys=True),
                          []).append(row)
    header = (f"| federation | method | seeds | gap closed, {low} → {high}: mean ± std "
              "(per seed) | p10 gap closed: mean ± std (per seed) |")
    out = [header, "|---|---|---:|---:|---:|"]
    for key, rows in groups.items():
        ends = seed_runs(low, rows), seed_runs(high, rows)
        present = {row["method"] for row in rows} - {low, high}
        for method in (m for m in METHODS if m in present):
            runs = seed_runs(method, rows)
            seeds = sorted(runs.keys() & ends[0].keys() & ends[1].keys())
            if not seeds:
                continue
            cells = []
            for field in ("test", "p10"):
                shares: list[float | None] = []
                for seed in seeds:
                    m, lo, hi = (_paired_value(r[seed], field) for r in (runs, *ends))
                    ok = None not in (m, lo, hi) and hi - lo > 0  # type: ignore[operator]
                    shares.append((m - lo) / (hi - lo) if ok else None)  # type: ignore[operator]
                each = ", ".join("n/a" if v is None else f"{100 * v:+.0f}" for v in shares)
                cells.append(f"{_pct_std(shares)} ({each})")
            out.append(f"| {json.loads(key)[0]} | {method} | {len(seeds)} | "
                       + " | ".join(cells) + " |")
    return "\n".join(out)


def against(path: Path, baselines: list[str]) -> list[tuple[str, str]]:
    """Every method of the results file (in ``METHODS``' order) paired with each of
    ``baselines`` that the file holds: (method, baseline), the baseline never with itself,
    and a pair of two baselines once (the earlier baseline as b)."""
    present = {row["method"] for row in read_rows(path)}
    methods = [m for m in METHODS if m in present]
    pairs: list[tuple[str, str]] = []
    for b in (b for b in baselines if b in present):
        pairs += [(m, b) for m in methods if m != b and (b, m) not in pairs]
    return pairs


def table(path: Path) -> str:
    """One markdown table per (federation, size) in the results file: each method's
    selected point (on the clients' validation splits); where the file holds replicates,
    also the selected point's client test mean and p10 as mean ± std over its seeds."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in read_rows(path):
        key = json.dumps([row["federation"], row["size"]], sort_keys=True)
        groups.setdefault(key, []).append(row)
    out = []
    for key, rows in groups.items():
        federation, size = json.loads(key)
        metric = rows[0]["metric"]
        steps = size.get("local_steps", BASE["train"]["local_steps"])
        chosen = ("every method at its defaults" if size.get("defaults")
                  else "selected on the clients' validation splits")
        mode = next((r["client_mode"] for r in rows if r.get("client_mode")), "split")
        chosen += f"; client test scores: {mode.replace('_', '-')}"
        if size.get("set"):
            chosen += ", with " + sweep.describe(size["set"])
        seeds = any(r.get("replicate") for r in rows)
        extra = (["client test mean ± std", "p10 ± std", "own test splits: mean ± std",
                  "other-backbone clients ± std", "seeds"] if seeds else [])
        out += [(f"\nFederation {federation}: {FEDERATIONS[federation][0]} ({size['backbone']}, "
                 f"{size['max_train_examples']} training examples, {size['rounds']} rounds of "
                 f"{steps} local steps); {metric}, {chosen}\n"),
                _row(["method", "selected", "adapter", "val mean", "client test mean", "p10",
                      "min", "other-backbone clients", *extra, "others mean", "global dev",
                      "clusters ARI",
                      "relevance gap (first → last)", "own-group weight (uniform)",
                      "passes / client / round", "MB down / round", "MB up / round", "wall s",
                      "points", "grid wall s"]),
                "|---|---|---|" + "---:|" * (16 + len(extra))]
        for method in METHODS:
            runs = [r for r in rows if r["method"] == method]
            points = [r for r in runs if not r.get("replicate")]
            if not points:
                continue
            r = selected_row(method, size, points)
            if r is None:
                out.append(_row([method, "every point failed", *[""] * (15 + len(extra)),
                                 str(len(points)), ""]))
                continue
            chosen = ", ".join(f"{k.rsplit('.', 1)[-1]}={sweep.toml_value(v)}"
                               for k, v in r["overrides"].items())
            replicates = [x for x in runs
                          if x.get("replicate") and x["overrides"] == r["overrides"]]
            over_seeds = _over_seeds([r, *replicates]) if seeds else []
            out.append(_row([
                method, chosen, r["adapter"], _pct(r["val"]), _pct(r["test"]),
                _pct(r["test"], "p10"), _pct(r["test"], "min"), _pct(group_mean(r)), *over_seeds,
                _others(r), _pct(r["global_dev"]), _ari(r), *_relevance(r), _passes(r),
                _megabytes(r.get("bytes_down")), _megabytes(r.get("bytes_up")),
                f"{r['wall_seconds']:.0f}", str(len(points)),
                f"{sum(p['wall_seconds'] or 0 for p in points):.0f}"]))
    return "\n".join(out).lstrip("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--federation", choices=sorted(FEDERATIONS), default="a")
    parser.add_argument("--methods", help="comma-separated row labels (default: all)")
    parser.add_argument("--max-train-examples", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--local-steps", type=int, default=BASE["train"]["local_steps"],
                        help="local steps of batch 8 per client and round")
    parser.add_argument("--defaults", action="store_true",
                        help="no hyperparameter grid: every method at its defaults")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="fix one config value for every method run (repeatable; e.g. "
                             "algorithm.num_clusters=4 at the --defaults budget); the "
                             "results form their own table")
    parser.add_argument("--backbone", default="minilm")
    parser.add_argument("--data-dir", help="GLUE directory (default: the library's)")
    parser.add_argument("--lrs", default=",".join(map(str, LRS)),
                        help="comma-separated shared learning rates (train.lr) swept for every method")
    parser.add_argument("--jobs", type=int, default=1, help="points run at once, one process each")
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs of each method's selected point: its own (seed 0), then "
                             "seeds 1 ... N-1 as replicate rows (resumable)")
    parser.add_argument("--out", default="runs/personalization.jsonl",
                        help="results, one line per finished point (resumable)")
    parser.add_argument("--runs", default="runs/personalization", help="run directories")
    parser.add_argument("--table", type=Path, help="print the markdown table of a results file")
    parser.add_argument("--paired", metavar="A-B,C-D",
                        help="with --table: paired seed-by-seed differences of these methods")
    parser.add_argument("--against", metavar="B,C",
                        help="with --table: paired differences of every method in the file "
                             "against each of these (e.g. local,ditto_equal,fedavg)")
    parser.add_argument("--gap", metavar="LOW-HIGH",
                        help="with --table: the share of the LOW-to-HIGH gap each method "
                             "closes, seed by seed (e.g. local-oracle_la)")
    parser.add_argument("--by-label-mix", action="store_true",
                        help="with --table and --paired or --against: the paired differences "
                             "also split into the clients holding one label and the others")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        pairs = [tuple(item.split("-", 1)) for item in (args.paired or "").split(",") if item]
        if args.against:
            pairs += against(args.table, args.against.split(","))
        if pairs:
            print("\n" + paired(args.table, pairs))
            if args.by_label_mix:
                print("\n" + by_label_mix(args.table, pairs))
        if args.gap:
            low, _, high = args.gap.partition("-")
            print("\n" + gap_closed(args.table, low, high))
        return
    args.methods = args.methods.split(",") if args.methods else list(METHODS)
    args.lrs = tuple(float(v) for v in args.lrs.split(","))
    try:
        args.set = [sweep.parse_axis(item) for item in args.set]
    except ConfigError as err:
        parser.error(f"--set: {err}")
    if any(len(axis.values) != 1 for axis in args.set):
        parser.error("--set: one value per key (use the method's grid to sweep)")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: must be at least 1")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    try:
        run(args)
    except ConfigError as err:  # SweepError included
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    main()

"""The anchor workload three ways: fedloom, the bare PyTorch loop and Flower's simulation.

    python -m benchmarks.anchor [--repeats 3] [--data-dir ../shared/data/glue]
                                [--only fedloom_e2e_s,fedloom_fast_e2e_s,flower]

The workload is ``benchmarks/anchor.toml`` (MiniLM + LoRA r = 8 on MRPC, 8 clients of 32
rows in file order, 3 rounds of one local epoch of batch 16; see the file);
``benchmarks/anchor_fast.toml`` is the same workload on fedloom's fast path. Every
measurement runs in a fresh process, and each repeat runs all of them in turn
(interleaved), so a change in the machine's load hits every side alike; medians over the
repeats are reported.

* **fedloom rounds**: ``simulate`` of the config in-process, its ``wall_seconds`` (the
  rounds: adapter swaps, local training, aggregation, metrics, checkpoints; no start-up).
* **bare loop** (the compute limit): the same model, the same examples in the same
  batches (fedloom's seeds) and the same fresh AdamW per client and round, as a plain
  PyTorch loop in fp32 with none of fedloom's machinery.
* **the fast path's pieces**: fedloom's rounds with length bucketing alone and with bf16
  autocast alone, each switched on over ``anchor.toml``.
* **diagnostics**: fedloom's rounds with the heterogeneity diagnostics at their default
  (G² every round), which the anchor switches off as it does evaluation.
* **DP-FedAvg**: fedloom's rounds with ``[privacy] level = "client"`` (z = 0.5, C = 0.1):
  server-side noise with fixed clipping, client-side noise, and adaptive clipping; and
  sample-level DP-SGD through Opacus (``level = "sample"``, z = 1, C = 1).
* **fedloom end to end**: ``fedloom run CONFIG`` as a process, start to exit.
* **Flower end to end**: Flower's simulation (``flwr.simulation.run_simulation``, Ray
  backend, ``flwr.serverapp.strategy.FedAvg``) of the same workload as a process, start to
  exit: a ClientApp written as a Flower user would write it (Hugging Face model and
  tokenizer, PEFT LoRA with the same settings, a mean-pooling linear head, random batches
  with dynamic padding, AdamW), the backbone and the client's tokenized rows loaded once
  per Ray actor and reused, 1 CPU per actor (two actors in parallel on 2 cores). Its
  rounds alone (``strategy.start``) are reported too.

The output ends with ``ratio_rounds_vs_limit``, ``ratio_fast_vs_limit`` (fedloom's rounds
over the bare loop's, plain and fast path) and ``ratio_e2e_vs_flower`` (fedloom's end to
end over Flower's; ``ratio_e2e_fast_vs_flower`` with the fast path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: the closing lines: name = numerator / denominator (medians)
RATIOS = {
    "ratio_rounds_vs_limit": ("fedloom_rounds_s", "bare_loop_s"),
    "ratio_fast_vs_limit": ("fedloom_fast_rounds_s", "bare_loop_s"),
    "ratio_e2e_vs_flower": ("fedloom_e2e_s", "flower_e2e_s"),
    "ratio_e2e_fast_vs_flower": ("fedloom_fast_e2e_s", "flower_e2e_s"),
    "ratio_dp_vs_plain": ("fedloom_dp_rounds_s", "fedloom_rounds_s"),
    "ratio_dp_client_vs_plain": ("fedloom_dp_client_rounds_s", "fedloom_rounds_s"),
    "ratio_dp_adaptive_vs_plain": ("fedloom_dp_adaptive_rounds_s", "fedloom_rounds_s"),
    "ratio_dp_sgd_vs_plain": ("fedloom_dp_sgd_rounds_s", "fedloom_rounds_s"),
}
#: DP-FedAvg on the anchor (8 clients a round: adaptive clipping's count noise 0.4 allows
#: z < 0.8)
DP = ('privacy.level="client"', "privacy.noise_multiplier=0.5", "privacy.clip_norm=0.1")
ANCHOR = ROOT / "benchmarks" / "anchor.toml"
FAST = ROOT / "benchmarks" / "anchor_fast.toml"


# --- the workers: one measurement each, in a process of its own ---------------------------

def fedloom_rounds(config: Path, data_dir: str, out: str, overrides: list[str]
                   ) -> dict[str, float]:
    from fedloom.config import load_config
    from fedloom.experiment import Experiment
    from fedloom.runtime.rundir import RunDir
    from fedloom.server import simulate

    cfg = load_config(config, [f'data.data_dir="{data_dir}"', *overrides])
    exp = Experiment.build(cfg)
    summary = simulate(exp, RunDir.create(out, cfg.name))
    return {"seconds": summary["wall_seconds"]}


def bare_loop(config: Path, data_dir: str) -> dict[str, float]:
    """The anchor's train steps in a plain loop: per round and client, fedloom's batches
    (its seeds and batching) and a fresh AdamW, fp32; the global weights are not
    reloaded (no adapter swaps: that is fedloom's overhead)."""
    import numpy as np
    import torch

    from fedloom.config import load_config
    from fedloom.experiment import Experiment
    from fedloom.models.heads import feature_length
    from fedloom.runtime.clients import client_seed
    from fedloom.train.batching import client_batches
    from fedloom.train.local import steps_per_round

    cfg = load_config(config, [f'data.data_dir="{data_dir}"'])
    exp = Experiment.build(cfg)
    model, settings = exp.model, cfg.train
    params = list(model.trainable_parameters().values())
    start = time.perf_counter()
    for r in range(cfg.federation.rounds):
        for client in exp.clients:
            seed = client_seed(cfg.seed, r, client.client_id)
            batches = client_batches(settings.batching, [feature_length(f) for f in client.train],
                                     settings.batch_size, np.random.default_rng(seed))
            torch.manual_seed(seed)
            optimizer = torch.optim.AdamW(params, lr=settings.lr,
                                          weight_decay=settings.weight_decay)
            model.head.train()
            for _ in range(steps_per_round(settings, len(client.train))):
                batch = model.head.collate([client.train[i] for i in next(batches)])
                optimizer.zero_grad(set_to_none=True)
                model.loss(batch).backward()
                optimizer.step()
    return {"seconds": time.perf_counter() - start}


def flower_simulation(data_dir: str) -> dict[str, float]:
    from benchmarks import anchor_flower

    return anchor_flower.simulate(data_dir)


# --- the driver ------------------------------------------------------------------------

def _worker(kind: str, data_dir: str, out: str, threads: int, config: Path = ANCHOR,
            overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run one worker in a fresh process; its result and the process's wall seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.anchor", "--worker", kind,
                           "--config", str(config), "--data-dir", data_dir, "--out", out,
                           *(f"--set={o}" for o in overrides)],
                          env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"worker {kind} failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_seconds": wall}


def _fedloom_run(config: Path, data_dir: str, out: str, threads: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fedloom.cli", "run", str(config), "--quiet",
                           "--data-dir", data_dir, "--output-dir", out],
                          env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fedloom run {config.name} failed:\n{proc.stderr[-3000:]}")
    return {"process_seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "glue"))
    parser.add_argument("--out", default="/tmp/fedloom-anchor")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of fedloom and the bare loop")
    parser.add_argument("--only", help="comma-separated measurements (default: all)")
    parser.add_argument("--worker", choices=["rounds", "bare", "flower"], help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, default=ANCHOR, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = {"rounds": lambda: fedloom_rounds(args.config, args.data_dir, args.out,
                                                   args.set),
                  "bare": lambda: bare_loop(args.config, args.data_dir),
                  "flower": lambda: flower_simulation(args.data_dir)}[args.worker]()
        print(json.dumps(result))
        return
    args_for = (args.data_dir, args.out, args.threads)
    measurements: dict[str, Callable[[], dict[str, float]]] = {
        "bare_loop_s": lambda: _worker("bare", *args_for),
        "fedloom_rounds_s": lambda: _worker("rounds", *args_for),
        "fedloom_fast_rounds_s": lambda: _worker("rounds", *args_for, FAST),
        # the fast path's pieces one at a time
        "fedloom_bucketed_rounds_s": lambda: _worker("rounds", *args_for, ANCHOR,
                                                     ('train.batching="bucketed"',)),
        "fedloom_bf16_rounds_s": lambda: _worker("rounds", *args_for, ANCHOR,
                                                 ('model.precision="bf16"',)),
        # what the heterogeneity diagnostics at their default (every round) cost
        "fedloom_diagnostics_rounds_s": lambda: _worker("rounds", *args_for, ANCHOR,
                                                        ("diagnostics.every=1",)),
        # what client-level DP-FedAvg costs (clipping, noise, the accountant every round)
        "fedloom_dp_rounds_s": lambda: _worker("rounds", *args_for, ANCHOR, DP),
        "fedloom_dp_client_rounds_s": lambda: _worker(
            "rounds", *args_for, ANCHOR, (*DP, 'privacy.noise="client"')),
        "fedloom_dp_adaptive_rounds_s": lambda: _worker(
            "rounds", *args_for, ANCHOR, (*DP, "privacy.adaptive_quantile=0.5")),
        # DP-SGD in local training (Opacus: per-example gradients, clipping, noise)
        "fedloom_dp_sgd_rounds_s": lambda: _worker(
            "rounds", *args_for, ANCHOR,
            ('privacy.level="sample"', "privacy.noise_multiplier=1.0", "privacy.clip_norm=1.0"),
        ),
        "fedloom_e2e_s": lambda: _fedloom_run(ANCHOR, *args_for),
        "fedloom_fast_e2e_s": lambda: _fedloom_run(FAST, *args_for),
        "flower": lambda: _worker("flower", args.data_dir, args.out, 1),
    }
    chosen = args.only.split(",") if args.only else list(measurements)
    if unknown := set(chosen) - set(measurements):
        parser.error(f"--only: unknown {sorted(unknown)}; known: {', '.join(measurements)}")
    columns: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        measured: dict[str, float] = {}
        for name in chosen:
            result = measurements[name]()
            if name == "flower":
                measured |= {"flower_rounds_s": result["seconds"],
                             "flower_e2e_s": result["process_seconds"]}
            else:
                measured[name] = result.get("seconds", result["process_seconds"])
        print(json.dumps({"repeat": repeat, **{k: round(v, 2) for k, v in measured.items()}}),
              flush=True)
        for key, value in measured.items():
            columns.setdefault(key, []).append(value)
    median = {key: statistics.median(values) for key, values in columns.items()}
    print(json.dumps({"median": {k: round(v, 2) for k, v in median.items()},
                      "repeats": args.repeats, "threads": args.threads}))
    for line, (mine, theirs) in RATIOS.items():
        if mine in median and theirs in median:
            print(f"{line}={median[mine] / median[theirs]:.3f}")

if __name__ == "__main__":
    main()

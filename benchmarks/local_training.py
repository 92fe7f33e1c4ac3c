"""Local-training throughput of the simulator against the compute limit.

The compute limit is a bare PyTorch loop over the same model, the same batches (same
examples, same padding) and the same AdamW settings, with none of fedloom's machinery
(no Params get/set, no per-client optimizer state, no schedules, no aggregation).
fedloom runs the same number of optimizer steps as FedAvg rounds over K clients, so the
ratio shows what the federated simulation costs on top of the training itself.

    python -m benchmarks.local_training [--clients 3] [--steps 8] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fedloom.config import load_config
from fedloom.experiment import Experiment
from fedloom.models.heads import feature_length
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate
from fedloom.train.batching import bucketed_batches


def bare_loop(exp: Experiment, steps: int, batch_size: int, seed: int) -> float:
    """Seconds for ``steps`` AdamW steps per client in a plain loop."""
    model = exp.model
    params = list(model.trainable_parameters().values())
    total = 0.0
    for client in exp.clients:
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        batches = bucketed_batches(
            [feature_length(f) for f in client.train], batch_size, np.random.default_rng(seed)
        )
        model.head.train()
        start = time.perf_counter()
        for _ in range(steps):
            batch = model.head.collate([client.train[i] for i in next(batches)])
            optimizer.zero_grad()
            model.loss(batch).backward()
            optimizer.step()
        total += time.perf_counter() - start
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/mrpc_fedavg.toml")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="/tmp/fedloom-bench")
    args = parser.parse_args()
    overrides = [
        f"partition.num_clients={args.clients}",
        f"train.local_steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        f"federation.rounds={args.rounds}",
        "eval.dev=false",
        "eval.clients=false",
        "algorithm.name=\"fedavg\"",
        "model.precision=\"fp32\"",  # the bare loop runs in fp32
    ]
    exp = Experiment.build(load_config(args.config, overrides))
    bare_loop(exp, 2, args.batch_size, 0)  # warm-up (allocator, kernels)
    bare = bare_loop(exp, args.steps * args.rounds, args.batch_size, 0)
    start = time.perf_counter()
    simulate(exp, RunDir.create(args.out, "bench"))
    sim = time.perf_counter() - start
    steps = args.steps * args.rounds * args.clients
    print(json.dumps({
        "threads": torch.get_num_threads(),
        "optimizer_steps": steps,
        "bare_pytorch_s": round(bare, 2),
        "fedloom_s": round(sim, 2),
        "bare_steps_per_s": round(steps / bare, 3),
        "fedloom_steps_per_s": round(steps / sim, 3),
        "fedloom_over_bare": round(sim / bare, 3),
    }, indent=2))


if __name__ == "__main__":
    main()

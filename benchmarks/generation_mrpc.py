"""MRPC paraphrase generation with LoRA, in fedloom: ROUGE-1/2/L and the references' NLL
before (zero-shot: the backbone without adapters) and after fine-tuning, centralized
against FedAvg on 3 IID clients.

The classic first exercise of federated LLM fine-tuning (GPT-2 + LoRA on MRPC, scored by
generating and reading ROUGE), with the packaged SmolLM2-135M-Instruct in place of GPT-2
(whose weights are not on this machine; ``--backbone`` takes any causal LM, GPT-2's hub
id included). Task ``mrpc-paraphrase``: MRPC's paraphrase pairs, sentence 1 → sentence 2.

Equal budget: FedAvg's 3 clients each take ``--steps`` local steps a round; centralized
takes 3 × ``--steps`` steps a round on the pooled data, so both see as many examples.
Both are scored on the same dev examples and the same clients' test splits (the same
partition seed), greedy decoding of at most ``--max-new-tokens`` tokens. One JSON line
per run (``--out``) with the summary's dev and client scores and the wall time.

    OMP_NUM_THREADS=2 python -m benchmarks.generation_mrpc --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from fedloom.config import validate
from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

METRICS = ["rougeL", "rouge1", "rouge2", "nll"]


def config(args: argparse.Namespace, algorithm: str, seed: int, out: Path) -> dict[str, Any]:
    steps = args.steps * (3 if algorithm == "centralized" else 1)
    return {
        "name": f"mrpc-gen-{algorithm}",
        "seed": seed,
        "output_dir": str(out),
        "data": {
            "task": "mrpc-paraphrase",
            "max_train_examples": args.train_examples,
            "max_dev_examples": args.dev_examples,
            "max_length": args.max_length,
        },
        "partition": {"scheme": "iid", "num_clients": 3, "test_fraction": 0.2},
        "model": {"backbone": args.backbone, "lora": {"r": args.r, "alpha": 2.0 * args.r}},
        "algorithm": {"name": algorithm},
        "federation": {"rounds": args.rounds},
        "train": {"local_steps": steps, "batch_size": args.batch_size, "lr": args.lr},
        "eval": {
            "every": args.rounds,
            "batch_size": args.eval_batch_size,
            "metrics": METRICS,
            "others": "never",
            "baselines": ["zero_shot"],
            "generation": {"max_new_tokens": args.max_new_tokens},
        },
        "diagnostics": {"every": 0},
    }


def run(args: argparse.Namespace, algorithm: str, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate(config(args, algorithm, seed, Path(tmp)))
        run_dir = RunDir.create(Path(tmp) / "run", cfg.name)
        start = time.perf_counter()
        summary = simulate(Experiment.build(cfg), run_dir)
        wall = time.perf_counter() - start
    scores = {
        adapter: {
            part: {m: summary[adapter][part][m] for m in METRICS}
            for part in ("dev", "clients")
            if part in summary[adapter]
        }
        for adapter in ("global", "zero_shot")
    }
    return {"algorithm": algorithm, "seed": seed, "backbone": args.backbone,
            "train_examples": args.train_examples, "rounds": args.rounds,
            "steps": args.steps, **scores, "wall_s": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backbone", default="smollm2-135m")
    parser.add_argument("--algorithms", nargs="+", default=["centralized", "fedavg"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--train-examples", type=int, default=600)
    parser.add_argument("--dev-examples", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/generation-mrpc.jsonl"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for algorithm in args.algorithms:
            row = run(args, algorithm, seed)
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""SmolLM2-135M-Instruct + LoRA through the verbalizer head, trained centrally on SST-2.

One party trains on a random subset of SST-2's training set (``--train-examples``) with
fedloom's local-training step (AdamW, one linear schedule with warm-up, gradient
clipping), then the adapter is scored on SST-2's dev set (all 872 examples unless
``--dev-examples`` says fewer). ``--zero-shot`` also scores the untrained model first.
Torch runs on ``--threads`` threads (set OMP_NUM_THREADS to the same number).

    OMP_NUM_THREADS=1 python -m benchmarks.smollm2_sst2
    OMP_NUM_THREADS=1 python -m benchmarks.smollm2_sst2 --zero-shot --steps 0 --dev-examples 300
    OMP_NUM_THREADS=1 python -m benchmarks.smollm2_sst2 --precision bf16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedloom.algorithms.base import ClientContext
from fedloom.config import LoraConfig, ModelConfig, TrainConfig
from fedloom.data import Example, get_task
from fedloom.data.glue import default_glue_dir, load_glue
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature
from fedloom.train.local import train_locally

TASK = get_task("SST-2")


def subset(examples: list[Example], n: int, seed: int) -> list[Example]:
    """``n`` examples drawn without replacement with ``seed`` (all of them for n = 0)."""
    if n == 0 or n >= len(examples):
        return examples
    return [examples[i] for i in np.random.default_rng(seed).permutation(len(examples))[:n]]


def score(model: FedModel, features: list[Feature], batch_size: int) -> dict[str, float]:
    """Dev accuracy, the share predicted positive and the wall seconds it took."""
    start = time.perf_counter()
    preds, labels, _ = model.predict(features, batch_size)
    return {
        "accuracy": round(float((preds == labels).mean()), 4),
        "predicted_positive": round(float(preds.mean()), 4),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def train(model: FedModel, features: list[Feature], args: argparse.Namespace) -> dict[str, Any]:
    """``args.steps`` AdamW steps of ``args.batch_size`` examples on one party's data."""
    settings = TrainConfig(
        local_steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        schedule="linear", warmup_ratio=0.06,
    )
    ctx = ClientContext(0, model, features, settings, round=0, total_rounds=1, state={},
                        seed=args.seed)
    start = time.perf_counter()
    metrics = train_locally(ctx)
    return {"train_loss": round(metrics["train_loss"], 4),
            "wall_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=default_glue_dir())
    parser.add_argument("--train-examples", type=int, default=2000)
    parser.add_argument("--dev-examples", type=int, default=0, help="0: the whole dev set")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="model.precision: bf16 autocast for every forward pass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero-shot", action="store_true", help="score before training too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    train_set = subset(load_glue(TASK, "train", args.data_dir), args.train_examples, args.seed)
    dev_set = subset(load_glue(TASK, "dev", args.data_dir), args.dev_examples, args.seed + 1)
    start = time.perf_counter()
    cfg = ModelConfig(backbone="smollm2-135m", head="verbalizer",
                      lora=LoraConfig(r=args.r, alpha=args.alpha, dropout=0.0),
                      precision=args.precision)
    model = FedModel.build(cfg, TASK, max_length=args.max_length, seed=args.seed)
    load_s = time.perf_counter() - start
    train_features, dev_features = model.encode(train_set), model.encode(dev_set)

    report: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "lora": {"r": args.r, "alpha": args.alpha, "targets": "auto"},
        "lr": args.lr,
        "load_s": round(load_s, 1),
        "dev_examples": len(dev_set),
        "dev_positive": round(float(np.mean([e.label for e in dev_set])), 4),
    }
    if args.zero_shot:
        report["zero_shot"] = score(model, dev_features, args.eval_batch_size)
    if args.steps > 0:
        report["steps"] = args.steps
        report["batch_size"] = args.batch_size
        report["examples_seen"] = args.steps * args.batch_size
        report["train"] = train(model, train_features, args)
        report["trained"] = score(model, dev_features, args.eval_batch_size)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

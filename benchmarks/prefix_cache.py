"""What a frozen prefix saves: train-step time with LoRA in every block against LoRA in the
upper blocks only (``model.lora.layers``), without and with ``model.prefix_cache``.

One party trains ``--steps`` AdamW steps of batch ``--batch-size`` on ``--examples``
training examples (several passes, so the cache is reused as in a federation's rounds),
then scores ``--dev-examples`` dev examples twice (the second time from the cache where
it applies). MiniLM runs on MRPC through the classifier, SmolLM2-135M on SST-2 through the
verbalizer. Reported per variant: train seconds per step over the first pass and over
the later ones, the two scoring times and the last training loss.

    OMP_NUM_THREADS=1 python -m benchmarks.prefix_cache --backbone minilm --top 3
    OMP_NUM_THREADS=1 python -m benchmarks.prefix_cache --backbone smollm2-135m --top 10 \\
        --precision bf16
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
from fedloom.data import get_task
from fedloom.data.glue import default_glue_dir, load_glue
from fedloom.models.blocks import num_blocks
from fedloom.models.fedmodel import FedModel
from fedloom.train.local import train_locally

TASKS = {"minilm": "MRPC", "smollm2-135m": "SST-2"}


def variant(args: argparse.Namespace, layers: list[int] | None, cache: bool) -> dict[str, Any]:
    task = get_task(TASKS[args.backbone])
    rng = np.random.default_rng(args.seed)
    train = load_glue(task, "train", args.data_dir)
    dev = load_glue(task, "dev", args.data_dir)
    train = [train[i] for i in rng.permutation(len(train))[: args.examples]]
    dev = [dev[i] for i in rng.permutation(len(dev))[: args.dev_examples]]
    cfg = ModelConfig(backbone=args.backbone, precision=args.precision, prefix_cache=cache,
                      lora=LoraConfig(r=16, alpha=32, dropout=0.0, layers=layers))
    model = FedModel.build(cfg, task, max_length=128, seed=args.seed)
    features, dev_features = model.encode(train), model.encode(dev)
    per_pass = -(-len(features) // args.batch_size)
    settings = TrainConfig(local_steps=per_pass, batch_size=args.batch_size, lr=1e-3,
                           head_lr=3e-3, optimizer_state="persist")
    state: dict[str, Any] = {}
    seconds, losses = [], []
    for epoch in range(-(-args.steps // per_pass)):
        ctx = ClientContext(0, model, features, settings, round=epoch, total_rounds=1,
                            state=state, seed=args.seed + epoch)
        start = time.perf_counter()
        losses.append(train_locally(ctx)["train_loss"])
        seconds.append((time.perf_counter() - start) / per_pass)
    scoring = []
    for _ in range(2):
        start = time.perf_counter()
        preds, labels, _ = model.predict(dev_features, 32)
        scoring.append(round(time.perf_counter() - start, 1))
    return {
        "layers": "all" if layers is None else f"{layers[0]}-{layers[-1]}",
        "prefix_cache": cache,
        "s_per_step_first_pass": round(seconds[0], 3),
        "s_per_step_later": round(float(np.mean(seconds[1:])), 3) if len(seconds) > 1 else None,
        "scoring_s": scoring,
        "last_train_loss": round(losses[-1], 4),
        "dev_accuracy": round(float((preds == labels).mean()), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backbone", choices=sorted(TASKS), default="minilm")
    parser.add_argument("--top", type=int, default=3, help="adapt the top TOP blocks")
    parser.add_argument("--examples", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dev-examples", type=int, default=128)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--data-dir", type=Path, default=default_glue_dir())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    blocks = num_blocks(FedModel.build(ModelConfig(backbone=args.backbone),
                                       get_task(TASKS[args.backbone]), 128, 0).transformer)
    top = list(range(blocks - args.top, blocks))
    for layers, cache in ((None, False), (top, False), (top, True)):
        row = variant(args, layers, cache)
        print(json.dumps({"backbone": args.backbone, "precision": args.precision, **row}),
              flush=True)


if __name__ == "__main__":
    main()

"""Generative fine-tuning speed: fedloom's local training and generation against a bare
transformers + PEFT loop on the same examples, the same model and the same batch size.

Training: ``--steps`` AdamW steps of ``--batch-size`` examples of ``mrpc-paraphrase``,
through fedloom's client step (:func:`fedloom.train.local.train_locally`, the loss on the
response tokens of :mod:`fedloom.models.generative`) and through the loop every SFT
tutorial writes (``model(input_ids, attention_mask, labels=labels).loss``, labels -100 on
the prompt, right padding, the LM head on every position). Tokens are the batches' real
(unpadded) tokens, counted from each loop's own batches (fedloom draws its batches with its
own seeded order from the same examples). Generation: the same ``--generate`` prompts,
greedy, ``--max-new-tokens``, through :meth:`FedModel.generate` and through PEFT's
``generate`` on one left-padded batch each ``--batch-size`` prompts; tokens are the new
tokens until each answer's end-of-text.

    OMP_NUM_THREADS=2 python -m benchmarks.generation_speed --threads 2
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
from fedloom.config import GenerationConfig, LoraConfig, ModelConfig, TrainConfig
from fedloom.data.generative_tasks import load_generative
from fedloom.data.glue import default_glue_dir
from fedloom.data.tasks import generation_task
from fedloom.models.fedmodel import FedModel
from fedloom.models.generative import GenerativeHead
from fedloom.models.heads import Feature, _pad
from fedloom.train.local import train_locally

TASK = generation_task("mrpc-paraphrase")


def build(args: argparse.Namespace) -> FedModel:
    cfg = ModelConfig(backbone=args.backbone, lora=LoraConfig(r=8, alpha=16.0, dropout=0.0),
                      precision=args.precision)
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)
    return FedModel.build(cfg, TASK, args.max_length, 0, generation=generation)


def fedloom_training(model: FedModel, features: list[Feature], args: argparse.Namespace
                     ) -> dict[str, float]:
    tokens = 0
    loss = model.loss

    def counting(batch: dict[str, Any]) -> torch.Tensor:
        nonlocal tokens
        tokens += int(batch["attention_mask"].sum())
        return loss(batch)

    model.loss = counting  # type: ignore[method-assign]
    settings = TrainConfig(local_steps=args.steps, batch_size=args.batch_size, lr=1e-3)
    ctx = ClientContext(0, model, features, settings, round=0, total_rounds=1, state={}, seed=0)
    start = time.perf_counter()
    train_locally(ctx)
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1)}


def bare_training(model: FedModel, features: list[Feature], args: argparse.Namespace
                  ) -> dict[str, float]:
    head = model.head
    assert isinstance(head, GenerativeHead)
    lm, pad = head.lm, head.tokenizer.pad_token_id
    params = [p for p in lm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    order = np.random.default_rng(1).permutation(len(features))
    lm.train()
    tokens, start = 0, time.perf_counter()
    for step in range(args.steps):
        rows = [features[order[(step * args.batch_size + i) % len(order)]]
                for i in range(args.batch_size)]
        seqs = [f["prompt_ids"] + f["response_ids"] for f in rows]
        labels = [[-100] * len(f["prompt_ids"]) + f["response_ids"] for f in rows]
        ids = _pad(seqs, pad, head.device)
        mask = _pad([[1] * len(s) for s in seqs], 0, head.device)
        loss = lm(input_ids=ids, attention_mask=mask, labels=_pad(labels, -100, head.device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int(mask.sum())
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1)}


def new_tokens(texts_ids: list[list[int]], eos: int) -> int:
    return sum(ids.index(eos) + 1 if eos in ids else len(ids) for ids in texts_ids)


def fedloom_generation(model: FedModel, features: list[Feature], args: argparse.Namespace
                       ) -> dict[str, Any]:
    start = time.perf_counter()
    answers = model.generate(features, args.batch_size)
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 2), "answers": answers}


@torch.no_grad()
def bare_generation(model: FedModel, features: list[Feature], args: argparse.Namespace
                    ) -> dict[str, Any]:
    head = model.head
    assert isinstance(head, GenerativeHead)
    lm, pad = head.lm, head.tokenizer.pad_token_id
    lm.eval()
    tokens, answers, start = 0, [], time.perf_counter()
    for i in range(0, len(features), args.batch_size):
        prompts = [f["prompt_ids"] for f in features[i : i + args.batch_size]]
        ids = _pad(prompts, pad, head.device, left=True)
        mask = _pad([[1] * len(p) for p in prompts], 0, head.device, left=True)
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                          do_sample=False, pad_token_id=pad, eos_token_id=head.eos)
        new = out[:, ids.shape[1]:]
        tokens += new_tokens(new.tolist(), head.eos)
        answers += [t.strip() for t in head.tokenizer.batch_decode(new, skip_special_tokens=True)]
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backbone", default="smollm2-135m")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--generate", type=int, default=32, help="prompts to answer")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/generation-speed.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data_root = default_glue_dir()
    assert data_root is not None, "../shared/data/glue is missing"
    train, dev = load_generative("mrpc-paraphrase", data_root.parent, 0)
    row: dict[str, Any] = {"backbone": args.backbone, "precision": args.precision,
                           "threads": args.threads, "batch_size": args.batch_size}
    # each measurement on a freshly built model (the same seeded adapter), warm-up first
    for name, measure, examples in (
        ("train_fedloom", fedloom_training, train[: args.examples]),
        ("train_bare", bare_training, train[: args.examples]),
        ("generate_bare", bare_generation, dev[: args.generate]),
        ("generate_fedloom", fedloom_generation, dev[: args.generate]),
    ):
        model = build(args)
        features = model.encode(examples)
        measure(model, features[: args.batch_size], argparse.Namespace(**{**vars(args), "steps": 1}))
        model = build(args)
        row[name] = measure(model, features, args)
        print(name, {k: v for k, v in row[name].items() if k != "answers"}, flush=True)
    # greedy answers are the same text: the same new tokens, counted once (bare's ids)
    same = row["generate_fedloom"].pop("answers") == row["generate_bare"].pop("answers")
    tokens = row["generate_bare"]["tokens"]
    wall = row["generate_fedloom"]["wall_s"]
    row["generate_fedloom"].update(tokens=tokens, tokens_per_s=round(tokens / wall, 1))
    row["same_answers"] = same
    row["train_ratio"] = round(
        row["train_fedloom"]["tokens_per_s"] / row["train_bare"]["tokens_per_s"], 3)
    row["generate_ratio"] = round(
        row["generate_fedloom"]["tokens_per_s"] / row["generate_bare"]["tokens_per_s"], 3)
    print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""The leakage evaluation: what an honest-but-curious server reads from one client's real
update (:mod:`fedloom.privacy.leakage`), before and after each defence.

A real federation (SST-2, 2000 examples over 10 MiniLM clients, Dirichlet α = 1, LoRA r = 16 on every
projection, FedAvg for 2 rounds, so LoRA's B is no longer zero) gives the global adapter
the server sends in round 3. Client 0 then trains from it as fedloom's client does (its
algorithm's local training, dropout and bf16 autocast on, then the transform chain's
client half: what travels), on examples of its own, in each setting:

* one SGD step on a batch of 1 and of 8 examples (lr 0.1), five AdamW steps on 5
  batches of 8 (fedloom's default optimizer, lr 1e-3, head 3e-3);
* the 8-example SGD step clipped to C (DP-FedAvg's clip, C = a tenth of the step's norm) and
  with client-side DP noise at z ∈ {0.5, 1, 2} for 10 clients a round (each update
  carries N(0, (zC)²/10)): what a server that cannot see the aggregate's noise being
  added reads;
* top-k sparsification and 8-bit quantization: rows kept for the compression operators;
* DLG, the seed material's reference attack, on a small model (:func:`dlg_row`).

The attacks: label counts from the classifier bias (the server's p̄ from the global
adapter on 200 dev examples; beside it, what the same estimate gets from p̄ alone, without
the update: the attack's baseline), tokens by the span check on block 0's LoRA A factors
(threshold 0.9 on the projection ratio, positions 0-63). Several sentences are attacked
per setting (``--trials``) and the mean reported.

    python -m benchmarks.leakage --trials 5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedloom.config import validate
from fedloom.experiment import Experiment
from fedloom.privacy import leakage
from fedloom.runtime.clients import client_context
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate

warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
SGD = {"optimizer": "sgd", "lr": 0.1, "head_lr": 0.1, "local_steps": 1}
#: (label, [train] settings, batch size, steps, [privacy] settings or None)
SETTINGS: list[tuple[str, dict[str, Any], int, int, dict[str, Any] | None]] = [
    ("1 SGD step, batch 1", SGD, 1, 1, None),
    ("1 SGD step, batch 8", SGD, 8, 1, None),
    ("5 AdamW steps, batch 8", {"local_steps": 5}, 8, 5, None),
    ("batch 8, clipped (C = norm / 10)", SGD, 8, 1, {"z": 0.0}),
    ("batch 8, DP z = 0.5", SGD, 8, 1, {"z": 0.5}),
    ("batch 8, DP z = 1", SGD, 8, 1, {"z": 1.0}),
    ("batch 8, DP z = 2", SGD, 8, 1, {"z": 2.0}),
]
PENDING = ["batch 8, top-k sparsification", "batch 8, 8-bit quantization"]
THRESHOLD = 0.9
POSITIONS = range(64)


def base_config(out: Path) -> dict[str, Any]:
    return {
        "name": "leakage",
        "seed": 0,
        "output_dir": str(out),
        "data": {"task": "SST-2", "data_dir": str(GLUE), "max_train_examples": 2000,
                 "max_dev_examples": 200, "max_length": 64},
        "partition": {"scheme": "dirichlet", "alpha": 1.0, "num_clients": 10},
        "model": {"backbone": "minilm"},
        "algorithm": {"name": "fedavg"},
        "federation": {"rounds": 2},
        "train": {"local_steps": 5, "batch_size": 8},
        "eval": {"every": 2, "clients": False},
    }


def global_adapter(out: Path) -> dict[str, torch.Tensor]:
    raw = base_config(out)
    run = RunDir.create(out, "leakage")
    simulate(Experiment.build(validate(raw)), run)
    return load_params(run.checkpoints / "global.safetensors")


def attack(raw: dict[str, Any], payload: dict[str, torch.Tensor], examples: list[dict],
           steps: int, batch: int, clip: float | None) -> dict[str, float]:
    raw = json.loads(json.dumps(raw))
    raw["federation"] = {"rounds": 3}  # the client trains in round 3 of 3, at the rates
    raw["train"]["schedule"] = "constant"  # its settings say (the server knows them)
    exp = Experiment.build(validate(raw))
    model = exp.model
    client = replace(exp.clients[0], train=examples)
    result = exp.algorithm.local_train(client_context(exp, client, 2, {}), payload)
    sent = exp.chain.up(result.params, payload, 0, 2, {})
    delta = {n: sent[n].double() - payload[n].double() for n in payload}
    # labels: the server's mean prediction on its own data under the adapter it sent
    model.set_params(payload)
    probs = torch.tensor(np.exp(model.log_probs(exp.dev or [], 32)).mean(0))
    head_lr = exp.cfg.train.head_lr or exp.cfg.train.lr
    bias = delta["classifier.bias"].float()
    counts = leakage.label_counts(bias, head_lr, steps, batch, probs)
    # what the same estimate gets without the update: the server's prior p̄ alone
    prior = leakage.label_counts(torch.zeros_like(bias), head_lr, steps, batch, probs)
    true_counts = np.bincount([f["label"] for f in examples], minlength=len(probs))
    # tokens: the span of block 0's A factors
    basis = leakage.row_space(leakage.embedding_readers(delta, payload))
    embeddings = next(m for n, m in model.transformer.named_modules() if n.endswith("embeddings"))
    inputs = leakage.FirstLayerInputs.of(embeddings)
    scores = leakage.token_scores(basis, inputs.at, POSITIONS)
    recovered = set(torch.nonzero(scores >= THRESHOLD).flatten().tolist())
    true = {t for f in examples for t in f["input_ids"]}
    precision, recall = leakage.precision_recall(recovered, true)
    return {"labels": leakage.labels_recovered(true_counts, counts),
            "labels_prior": leakage.labels_recovered(true_counts, prior),
            "token_precision": precision,
            "token_recall": recall, "distinct_tokens": len(true), "span_rank": basis.shape[1],
            "update_norm": float(torch.sqrt(sum((d**2).sum() for d in delta.values())))}


def dlg_row(trials: int, iterations: int = 1500) -> dict[str, Any]:
    """DLG on a small model: a 2-layer BERT (d = 32, random weights, LoRA r = 2 with B
    random, as after training; eager attention, whose double backward torch has), the
    gradient of one SST-2 sentence's first 8 tokens, the attacker knowing the length;
    each optimized dummy embedding read as its nearest vocabulary entry (cosine)."""
    import torch.nn.functional as F

    raw = base_config(Path(tempfile.gettempdir()))
    raw["model"] = {"backbone": "tiny-bert", "precision": "fp32", "head_dropout": 0.0,
                    "lora": {"r": 2, "dropout": 0.0}}
    exp = Experiment.build(validate(raw))
    model, head = exp.model, exp.model.head
    g = torch.Generator().manual_seed(0)
    model.set_params({n: (0.3 * torch.randn(t.shape, generator=g) if "lora_B" in n else t)
                      for n, t in model.get_params().items()})
    model.transformer.eval()
    head.eval()
    encoder = head.encoder
    encoder.get_base_model().set_attn_implementation("eager")
    params = list(model.trainable_parameters().values())
    table = next(m for n, m in encoder.named_modules() if n.endswith("word_embeddings"))
    vocab = F.normalize(table.weight.detach(), dim=1)

    def gradient_of(inputs: torch.Tensor, label_logits: torch.Tensor) -> list[torch.Tensor]:
        mask = torch.ones(inputs.shape[:2], dtype=torch.long)
        hidden = encoder(inputs_embeds=inputs, attention_mask=mask).last_hidden_state
        logits = head.classifier(hidden.mean(1))
        target = torch.softmax(label_logits, -1)
        loss = -(target * torch.log_softmax(logits, -1)).sum(-1).mean()
        return list(torch.autograd.grad(loss, params, create_graph=True))

    labels_ok, recalls = 0, []
    for trial in range(trials):
        feature = exp.clients[0].train[trial]
        ids = torch.tensor(feature["input_ids"][:8])
        x = table.weight.detach()[ids].unsqueeze(0)
        y = F.one_hot(torch.tensor([feature["label"]]), 2).float() * 50.0
        observed = [t.detach() for t in gradient_of(x, y)]
        dummy, labels = leakage.dlg(gradient_of, observed, tuple(x.shape), 2, iterations, trial)
        found = {int((vocab @ F.normalize(d, dim=0)).argmax()) for d in dummy[0]}
        recalls.append(len(found & set(ids.tolist())) / len(set(ids.tolist())))
        labels_ok += int(labels.argmax()) == feature["label"]
    return {"setting": "DLG, 1 example (8 tokens), 2-layer BERT", "trials": trials,
            "labels": labels_ok / trials, "labels_prior": float("nan"),
            "token_recall": statistics.mean(recalls), "token_precision": float("nan"),
            "distinct_tokens": 8.0, "span_rank": float("nan"), "update_norm": float("nan")}


def run(trials: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        payload = global_adapter(out)
        exp = Experiment.build(validate(base_config(out)))
        pool = exp.clients[0].train
        if len(pool) < trials * 40:
            raise SystemExit(f"client 0 holds {len(pool)} examples, fewer than {trials} x 40")
        for label, train, batch, steps, privacy in SETTINGS:
            got = []
            for trial in range(trials):
                examples = pool[trial * batch * steps:(trial + 1) * batch * steps]
                raw = base_config(out)
                raw["train"] = {**raw["train"], **train, "batch_size": batch}
                if privacy is not None:
                    # C a tenth of the plain step's norm: the clip binds, as DP needs it to
                    plain = attack({**raw}, payload, examples, steps, batch, None)
                    raw["privacy"] = {"level": "client", "noise": "client",
                                      "clip_norm": plain["update_norm"] / 10,
                                      "noise_multiplier": privacy["z"]}
                got.append(attack(raw, payload, examples, steps, batch, None))
            row = {"setting": label, "trials": trials,
                   **{k: statistics.mean(g[k] for g in got) for k in got[0]}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    rows.append(dlg_row(trials))
    print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [("| what the client sent | labels recovered | (from p̄ alone) | token recall "
              "| token precision | distinct tokens |"), "|---|---|---|---|---|---|"]
    def pct(x: float) -> str:
        return "–" if math.isnan(x) else f"{100 * x:.0f} %"  # NaN: not measured for the row

    for r in rows:
        lines.append(f"| {r['setting']} | {pct(r['labels'])} | {pct(r['labels_prior'])} "
                     f"| {pct(r['token_recall'])} | {pct(r['token_precision'])} "
                     f"| {r['distinct_tokens']:.0f} |")
    lines += [f"| {p} | (with the compression operators) | | | | |" for p in PENDING]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path, help="print the table of a results file")
    args = parser.parse_args()
    if args.table:
        lines = args.table.read_text(encoding="utf-8").splitlines()
        print(table([json.loads(x) for x in lines if x.strip()]))
        return
    rows = run(args.trials)
    if args.out:
        args.out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()

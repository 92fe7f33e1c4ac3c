"""Every federated optimizer on non-IID MRPC at equal communication.

10 clients, Dirichlet alpha = 0.1 label skew over the full MRPC training set (20 % of
each client kept as its local test split), MiniLM + LoRA, 8 rounds of 1/4 local epoch
with batch 8 for every method (FedSGD: one full-batch gradient step per round, as
defined), scored on the full MRPC dev set and on each client's test split. Small
per-client batches and short rounds give every client enough sequential steps without
letting it drift all the way to its own majority label (BENCHMARKS.md, "Why naive FedAvg lagged"). Server hyperparameters are set where
the defaults make a method equal to FedAvg (FedAvgM's momentum, FedProx's mu) or are
sized for images rather than LoRA factors (the FedOpt server rates: a server step of
~3e-3 per coordinate matches what 1e-3 local AdamW steps move in a round).

    python -m benchmarks.algorithms_mrpc --shard 0/2 --out /tmp/alg.jsonl   # half the methods
    python -m benchmarks.algorithms_mrpc --table /tmp/alg.jsonl            # markdown table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedloom.config import validate
from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

BASE: dict[str, object] = {
    "seed": 0,
    "data": {"task": "MRPC"},
    "partition": {"scheme": "dirichlet", "alpha": 0.1, "num_clients": 10, "min_size": 20,
                  "test_fraction": 0.2},
    "model": {"backbone": "minilm", "lora": {"r": 16, "alpha": 32, "dropout": 0.05},
              "precision": "fp32"},  # its tables ran in fp32, before "auto" became the default
    "federation": {"rounds": 8},
    "train": {"local_epochs": 0.25, "batch_size": 8, "lr": 1e-3, "head_lr": 3e-3},
    "eval": {"every": 8},
}

METHODS: dict[str, dict[str, object]] = {
    "centralized": {"name": "centralized"},
    "local": {"name": "local"},
    "fedavg": {"name": "fedavg"},
    "fedsgd": {"name": "fedsgd"},
    "fedprox (mu=0.1)": {"name": "fedprox", "proximal_mu": 0.1},
    "scaffold": {"name": "scaffold"},  # option I under AdamW (see the SCAFFOLD docstring)
    "scaffold (option II)": {"name": "scaffold", "option": "II"},
    "fednova": {"name": "fednova"},
    "fedavgm (lr=1, momentum=0.5)": {"name": "fedavgm", "server_momentum": 0.5},
    "fedadagrad (eta=3e-3)": {"name": "fedadagrad", "eta": 3e-3},
    "fedadam (eta=3e-3)": {"name": "fedadam", "eta": 3e-3},
    "fedyogi (eta=3e-3)": {"name": "fedyogi", "eta": 3e-3},
    "qfedavg (q=0.1)": {"name": "qfedavg", "client_learning_rate": 1e-3},
    # the robust rules: FedAvg with an [aggregation] section
    "median": {"name": "fedavg", "aggregation": {"rule": "median"}},
    "trimmed_mean (beta=0.2)": {"name": "fedavg",
                                "aggregation": {"rule": "trimmed_mean", "beta": 0.2}},
    "krum (f=2)": {"name": "fedavg", "aggregation": {"rule": "krum", "num_malicious_nodes": 2}},
    "multikrum (f=2, m=5)": {"name": "fedavg", "aggregation": {
        "rule": "multikrum", "num_malicious_nodes": 2, "num_nodes_to_select": 5}},
}


def run_method(label: str, out: str) -> dict[str, object]:
    raw = json.loads(json.dumps(BASE))
    raw["algorithm"] = dict(METHODS[label])
    raw["aggregation"] = raw["algorithm"].pop("aggregation", {})
    raw["name"] = "alg-" + str(METHODS[label]["name"])
    summary = simulate(Experiment.build(validate(raw)), RunDir.create(out, str(raw["name"])))
    scores = summary.get("global") or summary["personal"]
    row: dict[str, object] = {"method": label, "wall_seconds": summary["wall_seconds"]}
    if "dev" in scores:
        row["dev_accuracy"] = scores["dev"]["accuracy"]
        row["dev_f1"] = scores["dev"]["f1"]
    row["client_accuracy"] = scores["clients"]["accuracy"]
    return row


def table(path: Path) -> str:
    lines = [
        "| method | dev accuracy | dev F1 | client accuracy mean | p10 | min | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = {r["method"]: r for r in map(json.loads, path.read_text().splitlines())}
    for label in METHODS:
        if label not in rows:
            continue
        r = rows[label]
        c = r["client_accuracy"]
        dev = (f"{r['dev_accuracy']:.1%}", f"{r['dev_f1']:.1%}") if "dev_accuracy" in r else ("—", "—")
        lines.append(f"| {label} | {dev[0]} | {dev[1]} | {c['mean']:.1%} | {c['p10']:.1%} | "
                     f"{c['min']:.1%} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines).replace("%", " %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th method from i")
    parser.add_argument("--out", default="runs/algorithms_mrpc.jsonl")
    parser.add_argument("--runs", default="runs/algorithms_mrpc")
    parser.add_argument("--methods", help="only these method labels, separated by ';'")
    parser.add_argument("--table", type=Path, help="print the markdown table of a results file")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    i, n = map(int, args.shard.split("/"))
    out = Path(args.out)
    done = {json.loads(line)["method"] for line in out.read_text().splitlines()} if out.exists() else set()
    chosen = args.methods.split(";") if args.methods else list(METHODS)[i::n]
    unknown = set(chosen) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {list(METHODS)}")
    for label in [m for m in chosen if m not in done]:  # resumes a partial file
        row = run_method(label, args.runs)
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

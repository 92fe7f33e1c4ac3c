"""What client-level differential privacy costs in accuracy: DP-FedAvg at noise multipliers
z ∈ {0.5, 1, 2} and at a target ε, against the same federation without privacy, for FedAvg
and FedAvg-FT (whose personal fine-tuning never leaves the client, so DP covers exactly
what the server releases: the global adapter), 3 seeds.

The federation: SST-2, 4000 training examples over 20 MiniLM clients (Dirichlet α = 1
label skew), every client in every round (so the accountant is PLD without sampling, add-
or-remove-one neighbours, δ = 1/K^1.1 = 0.037), LoRA r = 4 in blocks 4 and 5 only (the
frozen prefix cached: DP's noise grows with the number of shared values, and the run is 3×
cheaper), 10 rounds of 5 local AdamW steps of batch 16 at lr 3e-3 (head 1e-2). C = 1.0: a
client's update norm on a no-DP probe of this federation's first configuration (LoRA
everywhere, r = 4, seed 0) was 0.73-1.07 in round 1 (mean 0.94); no other C was tried.
Scores: the global adapter on 400 SST-2 dev examples, and each client's adapter (the
personal one for FedAvg-FT) dev-weighted to its label mix (hundreds of examples behind
each client's score), mean and 10th percentile over the 20 clients. What DP costs in time
is measured on the anchor workload (``benchmarks/anchor.py``).

    python -m benchmarks.privacy --out runs/privacy.jsonl          # runs what is missing
    python -m benchmarks.privacy --table runs/privacy.jsonl        # the Markdown table
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import tomli_w

from fedloom.config import validate

GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
METHODS = ("fedavg", "fedavg_ft")
#: (label, the [privacy] table)
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("no DP", {}),
    ("z = 0.5", {"level": "client", "noise_multiplier": 0.5}),
    ("z = 1", {"level": "client", "noise_multiplier": 1.0}),
    ("z = 2", {"level": "client", "noise_multiplier": 2.0}),
    ("target ε = 5", {"level": "client", "target_epsilon": 5.0}),
]
SEEDS = (0, 1, 2)


def config(method: str, privacy: dict[str, Any], seed: int, out: Path) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": f"dp-{method}-{seed}",
        "seed": seed,
        "output_dir": str(out),
        "data": {"task": "SST-2", "data_dir": str(GLUE), "max_train_examples": 4000,
                 "max_dev_examples": 400},
        "partition": {"scheme": "dirichlet", "alpha": 1.0, "num_clients": 20,
                      "test_fraction": 0.1},
        "model": {"backbone": "minilm", "prefix_cache": True,
                  "lora": {"r": 4, "alpha": 8, "layers": [4, 5]}},
        "algorithm": {"name": method},
        "federation": {"rounds": 10},
        "train": {"local_steps": 5, "batch_size": 16, "lr": 3e-3, "head_lr": 1e-2},
        "eval": {"every": 10},
    }
    if privacy:
        raw["privacy"] = {"clip_norm": 1.0, **privacy}
    validate(raw)
    return raw


def run_missing(out: Path) -> None:
    done = {(r["method"], r["setting"], r["seed"]) for r in _rows(out)}
    for seed in SEEDS:
        for method in METHODS:
            for label, privacy in SETTINGS:
                if (method, label, seed) in done:
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "config.toml"
                    path.write_text(tomli_w.dumps(config(method, privacy, seed, Path(tmp))))
                    done_run = subprocess.run(
                        [sys.executable, "-m", "fedloom.cli", "run", str(path), "--quiet",
                         "--json"], capture_output=True, text=True, check=True)
                summary = json.loads(done_run.stdout)
                adapter = "personal" if method == "fedavg_ft" else "global"
                row = {
                    "method": method, "setting": label, "seed": seed,
                    "dev_accuracy": summary["global"]["dev"]["accuracy"],
                    "clients_accuracy": summary[adapter]["clients"]["accuracy"]["mean"],
                    "clients_p10": summary[adapter]["clients"]["accuracy"]["p10"],
                    "privacy": summary.get("privacy"),
                    "wall_seconds": summary["wall_seconds"],
                }
                with out.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def _rows(out: Path) -> list[dict[str, Any]]:
    if not out.is_file():
        return []
    return [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines() if x.strip()]


def _mean_std(values: list[float]) -> str:
    if len(values) < 2:
        return f"{100 * values[0]:.1f}" if values else "–"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def table(out: Path) -> str:
    rows = _rows(out)
    lines = [
        (
            "| method | privacy | z | ε (δ = 0.037) | global dev acc. | clients' acc. (mean) "
            "| clients' p10 | seeds |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for method in METHODS:
        for label, _ in SETTINGS:
            got = [r for r in rows if r["method"] == method and r["setting"] == label]
            if not got:
                continue
            p = got[0]["privacy"]
            z = f"{p['noise_multiplier']:.3g}" if p else "–"
            eps = f"{statistics.mean(r['privacy']['epsilon'] for r in got):.2f}" if p else "∞"
            lines.append(
                f"| {method} | {label} | {z} | {eps} "
                f"| {_mean_std([r['dev_accuracy'] for r in got])} "
                f"| {_mean_std([r['clients_accuracy'] for r in got])} "
                f"| {_mean_std([r['clients_p10'] for r in got])} | {len(got)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/privacy.jsonl"))
    parser.add_argument("--table", type=Path)
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run_missing(args.out)
    print(table(args.out))


if __name__ == "__main__":
    main()

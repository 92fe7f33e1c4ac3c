"""Accuracy against uplink bytes: every compression operator in the ``compress`` transform,
with FedAvg and with FedAvg-FT, 3 seeds.

The federation: SST-2, 2,000 training examples over 10 MiniLM clients (Dirichlet α = 0.5
label skew), every client in every round, LoRA r = 4 in blocks 4 and 5 only (the frozen
prefix cached, as ``benchmarks/privacy.py``: the run is 3× cheaper), 10 rounds of 5 local
AdamW steps of batch 16 at lr 3e-3 (head 1e-2). One FedAvg-FT run gives both methods:
FedAvg-FT's training *is* FedAvg's (the same global adapter, round for round); it then
fine-tunes that adapter on each client before scoring. So "FedAvg" below is the run's
global adapter and "FedAvg-FT" its personal adapters, trained with the same bytes. After
the operators, two methods that compress their own messages run on the same federation
(DIANA with random-k, EF21 with top-k; global adapter only), at their default steps.

Scores: the global adapter on 400 SST-2 dev examples; each client's adapter dev-weighted
to its label mix, mean and 10th percentile over the 10 clients. Bytes: the sum of
``bytes_up`` over the rounds (what the clients sent, as encoded), and the compression
ratio against the float32 run's.

    python -m benchmarks.compression --out runs/compression.jsonl     # runs what is missing
    python -m benchmarks.compression --table runs/compression.jsonl   # Markdown table + PNG
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
#: (label, the compress transform's settings; None: no transform, float32)
OPERATORS: list[tuple[str, dict[str, Any] | None]] = [
    ("float32", None),
    ("fp16", {"compressor": "fp16", "error_feedback": False}),
    ("bf16", {"compressor": "bf16", "error_feedback": False}),
    ("qsgd s=16", {"compressor": "qsgd", "levels": 16}),
    ("qsgd s=4", {"compressor": "qsgd", "levels": 4}),
    ("natural", {"compressor": "natural"}),
    ("terngrad", {"compressor": "terngrad"}),
    ("ps_quant p=inf s=2", {"compressor": "ps_quant", "norm": float("inf"), "levels": 2}),
    ("randk 10%", {"compressor": "randk", "ratio": 0.1}),
    ("topk 10% + EF", {"compressor": "topk", "ratio": 0.1}),
    ("topk 1% + EF", {"compressor": "topk", "ratio": 0.01}),
    ("sign + EF", {"compressor": "sign"}),
    ("powersgd r=1 + EF", {"compressor": "powersgd", "rank": 1}),
]
#: the methods that compress their own messages, each with its operator: (label, [algorithm])
ALGORITHMS: list[tuple[str, dict[str, Any]]] = [
    ("DIANA, randk 10%", {"name": "diana", "compressor": "randk", "ratio": 0.1}),
    ("EF21, topk 1%", {"name": "ef21", "compressor": "topk", "ratio": 0.01}),
]
SEEDS = (0, 1, 2)


def config(
    operator: dict[str, Any] | None,
    seed: int,
    out: Path,
    algorithm: dict[str, Any] | None = None,
) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": f"compress-{seed}",
        "seed": seed,
        "output_dir": str(out),
        "data": {
            "task": "SST-2",
            "data_dir": str(GLUE),
            "max_train_examples": 2000,
            "max_dev_examples": 400,
        },
        "partition": {"scheme": "dirichlet", "alpha": 0.5, "num_clients": 10, "test_fraction": 0.1},
        "model": {
            "backbone": "minilm",
            "prefix_cache": True,
            "lora": {"r": 4, "alpha": 8, "layers": [4, 5]},
        },
        "algorithm": algorithm or {"name": "fedavg_ft"},
        "federation": {"rounds": 10},
        "train": {"local_steps": 5, "batch_size": 16, "lr": 3e-3, "head_lr": 1e-2},
        "eval": {"every": 10, "others": "never"},
    }
    if operator is not None:
        raw["transforms"] = [{"name": "compress", **operator}]
    validate(raw)
    return raw


def run_one(
    operator: dict[str, Any] | None, seed: int, algorithm: dict[str, Any] | None = None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(tomli_w.dumps(config(operator, seed, Path(tmp), algorithm)))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "fedloom.cli",
                "run",
                str(path),
                "--quiet",
                "--json",
                "--no-report",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        summary = json.loads(done.stdout)
        metrics = next(Path(tmp).rglob("metrics.jsonl")).read_text().splitlines()
    rows = [json.loads(x) for x in metrics]
    train = [r for r in rows if r["scope"] == "train"]
    return {
        "seed": seed,
        "bytes_up": sum(r["bytes_up"] for r in train),
        "bytes_down": sum(r["bytes_down"] for r in train),
        "global_dev": summary["global"]["dev"]["accuracy"],
        "global_mean": summary["global"]["clients"]["accuracy"]["mean"],
        **(
            {
                "personal_mean": summary["personal"]["clients"]["accuracy"]["mean"],
                "personal_p10": summary["personal"]["clients"]["accuracy"]["p10"],
            }
            if "personal" in summary
            else {}
        ),
        "wall_seconds": summary["wall_seconds"],
    }


def run_missing(out: Path, seeds: tuple[int, ...]) -> None:
    done = {(r["operator"], r["seed"]) for r in _rows(out)}
    runs = [(label, operator, None) for label, operator in OPERATORS]
    runs += [(label, None, algorithm) for label, algorithm in ALGORITHMS]
    for label, operator, algorithm in runs:  # the operators at every seed first
        for seed in seeds:
            if (label, seed) in done or (algorithm is not None and not _operators_done(out)):
                continue
            row = {"operator": label, **run_one(operator, seed, algorithm)}
            with out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def _operators_done(out: Path) -> bool:
    done = {(r["operator"], r["seed"]) for r in _rows(out)}
    return all((label, seed) in done for label, _ in OPERATORS for seed in SEEDS)


def _rows(out: Path) -> list[dict[str, Any]]:
    if not out.is_file():
        return []
    return [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines() if x.strip()]


def _mean_std(values: list[float]) -> str:
    if len(values) < 2:
        return f"{100 * values[0]:.1f}" if values else "–"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def _signed(values: list[float]) -> str:
    if not values:
        return "–"
    mean = 100 * statistics.mean(values)
    if len(values) < 2:
        return f"{mean:+.1f}"
    return f"{mean:+.1f} ± {100 * statistics.stdev(values):.1f}"


def _grouped(out: Path) -> dict[str, list[dict[str, Any]]]:
    rows = _rows(out)
    labels = [label for label, _ in OPERATORS] + [label for label, _ in ALGORITHMS]
    return {label: got for label in labels if (got := [r for r in rows if r["operator"] == label])}


def table(out: Path) -> str:
    groups = _grouped(out)
    base = statistics.mean(r["bytes_up"] for r in groups["float32"])
    base_acc = statistics.mean(r["global_dev"] for r in groups["float32"])
    lines = [
        (
            "| operator | uplink MB (10 rounds) | ratio | FedAvg: global dev acc. | paired "
            "Δ vs float32 | FedAvg: clients' mean | FedAvg-FT: clients' mean | FedAvg-FT: p10 "
            "| seeds |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    best = None
    for label, got in groups.items():
        up = statistics.mean(r["bytes_up"] for r in got)
        acc = statistics.mean(r["global_dev"] for r in got)
        if acc >= base_acc - 0.01 and (best is None or base / up > best[1]):
            best = (label, base / up)
        reference = {r["seed"]: r["global_dev"] for r in groups["float32"]}
        paired = [r["global_dev"] - reference[r["seed"]] for r in got if r["seed"] in reference]
        lines.append(
            f"| {label} | {up / 2**20:.2f} | {base / up:.1f}× "
            f"| {_mean_std([r['global_dev'] for r in got])} "
            f"| {'–' if label == 'float32' else _signed(paired)} "
            f"| {_mean_std([r['global_mean'] for r in got])} "
            f"| {_mean_std([r['personal_mean'] for r in got if 'personal_mean' in r])} "
            f"| {_mean_std([r['personal_p10'] for r in got if 'personal_p10' in r])} "
            f"| {len(got)} |"
        )
    if best:
        lines.append(
            f"\nHighest compression within one point of float32 FedAvg's global dev accuracy "
            f"(mean over seeds): {best[0]}, {best[1]:.1f}×."
        )
    return "\n".join(lines)


def plot(out: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _grouped(out)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, key, title in (
        (axes[0], "global_dev", "FedAvg: global adapter, SST-2 dev"),
        (axes[1], "personal_mean", "FedAvg-FT: clients' mean (dev-weighted)"),
    ):
        for label, got in groups.items():
            x = statistics.mean(r["bytes_up"] for r in got) / 2**20
            ys = [100 * r[key] for r in got if key in r]
            if not ys:
                continue
            err = statistics.stdev(ys) if len(ys) > 1 else 0.0
            ax.errorbar(x, statistics.mean(ys), yerr=err, fmt="o", capsize=3)
            ax.annotate(
                label,
                (x, statistics.mean(ys)),
                fontsize=7,
                xytext=(4, 3),
                textcoords="offset points",
            )
        ax.set_xscale("log")
        ax.set_xlabel("uplink MB over 10 rounds (log)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/compression.jsonl"))
    parser.add_argument("--table", type=Path)
    parser.add_argument("--png", type=Path, default=Path("benchmarks/results/compression.png"))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        plot(args.table, args.png)
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run_missing(args.out, tuple(args.seeds))
    print(table(args.out))
    plot(args.out, args.png)


if __name__ == "__main__":
    main()

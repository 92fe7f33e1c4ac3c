"""Secure aggregation: what it costs a round, and what it changes in a run's accuracy.

    python -m benchmarks.secagg cost --out benchmarks/results/secagg.jsonl
    python -m benchmarks.secagg accuracy --out benchmarks/results/secagg.jsonl
    python -m benchmarks.secagg table benchmarks/results/secagg.jsonl

* **cost**: the MRPC workload of ``benchmarks/anchor.toml`` (MiniLM + LoRA r = 8 on
  query/value and the head, 664k shared values; clients of 32 MRPC rows, one local epoch
  of 2 steps) with 10 and 50 clients, every client every round, 3 rounds in process:
  without secure aggregation, with SecAgg+ (k = 2⌈log2 n⌉ neighbours) and with SecAgg
  (every client a neighbour). Per round: the wall seconds of the round's training and
  aggregation step (``_train_round``, evaluation off), the seconds of the protocol's four
  stages inside it (every client's side and the server's, one after another as the
  simulator runs them), and the bytes each client sends and receives. The first round,
  which pays warm-up, is dropped from the means.
* **accuracy**: MRPC with 10 MiniLM clients (Dirichlet α = 1, 1,200 training rows, the
  frozen prefix cached and LoRA r = 4 in blocks 4 and 5), 10 rounds of 5 steps, the dev
  set scored: plain FedAvg against SecAgg+, and both again with 20 % simulated mid-round
  drop-outs; the largest difference between their final global adapters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fedloom.config import validate
from fedloom.experiment import Experiment
from fedloom.runtime import local, secure_round
from fedloom.runtime.rundir import RunDir

GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
ANCHOR = Path(__file__).resolve().parent / "anchor.toml"
PROTOCOLS = ("none", "secagg+", "secagg")


def cost_config(clients: int, protocol: str, out: Path) -> dict[str, Any]:
    raw = tomllib.loads(ANCHOR.read_text())
    raw["name"] = f"secagg-cost-{clients}"
    raw["output_dir"] = str(out)
    raw["data"]["data_dir"] = str(GLUE)
    raw["partition"]["num_clients"] = clients
    raw["checkpoint"] = {"every": 100}
    if protocol != "none":
        raw["secagg"] = {"protocol": protocol}
    return raw


def _timed(run_dir: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """One run in process with its rounds and its protocol timed."""
    rounds: list[float] = []
    protocol: list[float] = []
    train_round, run_protocol = local._train_round, secure_round.run

    def timed_round(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = train_round(*args, **kwargs)
        rounds.append(time.perf_counter() - began)
        return out

    def timed_protocol(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = run_protocol(*args, **kwargs)
        protocol.append(time.perf_counter() - began)
        return out

    local._train_round, secure_round.run = timed_round, timed_protocol  # type: ignore[assignment]
    try:
        run = RunDir.create(run_dir, raw["name"])
        summary = local.simulate(Experiment.build(validate(raw)), run)
    finally:
        local._train_round, secure_round.run = train_round, run_protocol  # type: ignore[assignment]
    rows = [json.loads(x) for x in run.metrics_path.read_text().splitlines()]
    train = [r for r in rows if r["scope"] == "train"]
    return {"rounds": rounds, "protocol": protocol, "train": train, "summary": summary, "run": run}


def cost(out: Path, sizes: tuple[int, ...]) -> None:
    for clients in sizes:
        for protocol in PROTOCOLS:
            with tempfile.TemporaryDirectory() as tmp:
                got = _timed(Path(tmp), cost_config(clients, protocol, Path(tmp)))
            train = got["train"]
            row = {
                "bench": "cost",
                "clients": clients,
                "protocol": protocol,
                "round_seconds": got["rounds"],
                "protocol_seconds": got["protocol"],
                "bytes_up_per_client": train[-1]["bytes_up"] / clients,
                "bytes_down_per_client": train[-1]["bytes_down"] / clients,
                "secagg": train[-1].get("secagg"),
                "threads": torch.get_num_threads(),
            }
            _append(out, row)


def accuracy_config(protocol: str, dropout: float, seed: int, out: Path) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": f"secagg-acc-{seed}",
        "seed": seed,
        "output_dir": str(out),
        "data": {"task": "MRPC", "data_dir": str(GLUE), "max_train_examples": 1200},
        "partition": {"scheme": "dirichlet", "alpha": 1.0, "num_clients": 10, "test_fraction": 0.1},
        "model": {
            "backbone": "minilm",
            "prefix_cache": True,
            "lora": {"r": 4, "alpha": 8, "layers": [4, 5]},
        },
        "algorithm": {"name": "fedavg"},
        "federation": {"rounds": 10},
        "faults": {"dropout": dropout},
        "train": {"local_steps": 5, "batch_size": 16, "lr": 3e-3, "head_lr": 1e-2},
        "eval": {"every": 10, "others": "never"},
    }
    if protocol != "none":
        raw["secagg"] = {"protocol": protocol}
    return raw


def accuracy(out: Path, seeds: tuple[int, ...]) -> None:
    for seed in seeds:
        for dropout in (0.0, 0.2):
            finals: dict[str, dict[str, torch.Tensor]] = {}
            for protocol in ("none", "secagg+"):
                with tempfile.TemporaryDirectory() as tmp:
                    got = _timed(Path(tmp), accuracy_config(protocol, dropout, seed, Path(tmp)))
                    finals[protocol] = load_file(
                        got["run"].path / "checkpoints" / "global.safetensors"
                    )
                summary, train = got["summary"], got["train"]
                row = {
                    "bench": "accuracy",
                    "seed": seed,
                    "dropout": dropout,
                    "protocol": protocol,
                    "dev_accuracy": summary["global"]["dev"]["accuracy"],
                    "dev_f1": summary["global"]["dev"]["f1"],
                    "dev_n": summary["global"]["dev"]["n"],
                    "dropouts_recovered": sum(r.get("secagg_dropouts", 0) for r in train),
                    "missing": sum(len(r["missing"]) for r in train),
                    "quant_bits": [r["secagg"]["quant_bits"] for r in train if "secagg" in r],
                }
                if protocol != "none":
                    a, b = finals["none"], finals[protocol]
                    row["max_abs_diff_global"] = max(
                        (a[k].double() - b[k].double()).abs().max().item() for k in a
                    )
                _append(out, row)


def _append(out: Path, row: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines() if x.strip()]


def table(out: Path) -> str:
    rows = _rows(out)
    lines = [
        (
            "| clients | protocol | k | t | b_q | round s | protocol s | protocol / plain round "
            "| extra up / client | extra down / client |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain: dict[int, dict[str, Any]] = {}
    for r in (r for r in rows if r["bench"] == "cost"):
        seconds = statistics.mean(r["round_seconds"][1:])
        if r["protocol"] == "none":
            plain[r["clients"]] = {**r, "seconds": seconds}
            continue
        base = plain[r["clients"]]
        proto = statistics.mean(r["protocol_seconds"][1:])
        s = r["secagg"]
        up = r["bytes_up_per_client"] - base["bytes_up_per_client"]
        down = r["bytes_down_per_client"] - base["bytes_down_per_client"]
        lines.append(
            f"| {r['clients']} | {r['protocol']} | {s['neighbours']} | {s['threshold']} | "
            f"{s['quant_bits']} | {seconds:.2f} (plain {base['seconds']:.2f}) | {proto:.3f} | "
            f"{100 * proto / base['seconds']:.2f} % | {up / 1e3:.1f} kB | {down / 1e3:.1f} kB |"
        )
    acc = [r for r in rows if r["bench"] == "accuracy"]
    if acc:
        lines += [
            "",
            "| seed | drop-outs | protocol | dev accuracy | dev F1 | recovered | max abs diff |",
            "|---:|---:|---|---:|---:|---:|---:|",
        ]
        for r in acc:
            diff = r.get("max_abs_diff_global")
            lines.append(
                f"| {r['seed']} | {r['dropout']:.0%} | {r['protocol']} | "
                f"{100 * r['dev_accuracy']:.2f} | {100 * r['dev_f1']:.2f} | "
                f"{r['dropouts_recovered']} | {'–' if diff is None else f'{diff:.1e}'} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("cost", "accuracy", "table"))
    parser.add_argument(
        "out", nargs="?", type=Path, default=Path("benchmarks/results/secagg.jsonl")
    )
    parser.add_argument("--clients", default="10,50")
    parser.add_argument("--seeds", default="0")
    args = parser.parse_args()
    if args.what == "cost":
        cost(args.out, tuple(int(x) for x in args.clients.split(",")))
    elif args.what == "accuracy":
        accuracy(args.out, tuple(int(x) for x in args.seeds.split(",")))
    else:
        print(table(args.out))


if __name__ == "__main__":
    main()

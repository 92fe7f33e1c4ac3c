"""Secure aggregation: what it costs a round, and what it changes in a run's accuracy.

    python -m benchmarks.secagg cost --out benchmarks/results/secagg.jsonl
    python -m benchmarks.secagg cost --clients 10 --protocols paillier --rounds 2
    python -m benchmarks.secagg encrypt --clients 50 --protocols ckks paillier
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
  which pays warm-up, is dropped from the means. ``--protocols ckks paillier`` runs
  homomorphic aggregation on the same federation, with the seconds of its parts too (the
  key pair, each client's encoding and encryption, the server's addition, the
  decryption; SecAgg's masking of each client's input, for comparison).
* **encrypt**: homomorphic aggregation's parts for one client of a round of n, on the
  same workload's update length without training it (key pair, one client's encryption
  and bytes, the server's sum of n inputs, the decryption): what a client pays where a
  whole federation does not fit the machine's time (Paillier at 50 clients).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from fedloom.config import validate
from fedloom.experiment import Experiment
from fedloom.homomorphic import HomomorphicServer, KeyHolder, Layout, scheme_for
from fedloom.homomorphic.messages import Ciphertexts, PublicContext
from fedloom.runtime import clients, local, secure_round
from fedloom.runtime.rundir import RunDir
from fedloom.secagg import SecAggClient
from fedloom.transforms.secure_sum import SecureSum

GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
ANCHOR = Path(__file__).resolve().parent / "anchor.toml"
PROTOCOLS = ("none", "secagg+", "secagg")
#: the parts of a round timed one call at a time: (owner, attribute), by name
PARTS: dict[str, tuple[Any, str]] = {
    "mask": (SecAggClient, "masked_integers"),
    "keygen": (KeyHolder, "__init__"),
    "encrypt": (clients, "encrypt_input"),
    "add": (HomomorphicServer, "add"),
    "decrypt": (KeyHolder, "decrypt"),
}


def cost_config(
    clients: int, protocol: str, out: Path, rounds: int | None = None
) -> dict[str, Any]:
    raw = tomllib.loads(ANCHOR.read_text())
    raw["name"] = f"secagg-cost-{clients}"
    raw["output_dir"] = str(out)
    raw["data"]["data_dir"] = str(GLUE)
    raw["partition"]["num_clients"] = clients
    raw["checkpoint"] = {"every": 100}
    if rounds is not None:
        raw["federation"]["rounds"] = rounds
    if protocol != "none":
        raw["secagg"] = {"protocol": protocol}
    return raw


@dataclass
class Clock:
    """The wall and the process CPU seconds of each call of something timed (CPU seconds
    count this process only: on a shared machine they are the cost, the wall seconds
    include the waits for the cores)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def _clocked(call: Any, *args: Any) -> tuple[Any, float, float]:
    """``call(*args)``, its wall seconds and its process CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = call(*args)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _timer(clock: Clock, call: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        out = call(*args, **kwargs)
        clock.wall.append(time.perf_counter() - wall)
        clock.cpu.append(time.process_time() - cpu)
        return out

    return timed


def _timed(run_dir: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """One run in process with its rounds, its protocol and the protocol's parts
    (:data:`PARTS`, each call) timed."""
    rounds, protocol = Clock(), Clock()
    parts = {name: Clock() for name in PARTS}
    originals = {name: getattr(owner, attr) for name, (owner, attr) in PARTS.items()}
    train_round, run_protocol = local._train_round, secure_round.run
    local._train_round = _timer(rounds, train_round)  # type: ignore[assignment]
    secure_round.run = _timer(protocol, run_protocol)  # type: ignore[assignment]
    for name, (owner, attr) in PARTS.items():
        setattr(owner, attr, _timer(parts[name], originals[name]))
    try:
        run = RunDir.create(run_dir, raw["name"])
        summary = local.simulate(Experiment.build(validate(raw)), run)
    finally:
        local._train_round, secure_round.run = train_round, run_protocol  # type: ignore[assignment]
        for name, (owner, attr) in PARTS.items():
            setattr(owner, attr, originals[name])
    rows = [json.loads(x) for x in run.metrics_path.read_text().splitlines()]
    train = [r for r in rows if r["scope"] == "train"]
    return {
        "rounds": rounds,
        "protocol": protocol,
        "parts": {name: clock for name, clock in parts.items() if clock.wall},
        "train": train,
        "summary": summary,
        "run": run,
    }


def cost(
    out: Path,
    sizes: tuple[int, ...],
    protocols: tuple[str, ...] = PROTOCOLS,
    rounds: int | None = None,
) -> None:
    for n in sizes:
        for protocol in protocols:
            with tempfile.TemporaryDirectory() as tmp:
                got = _timed(Path(tmp), cost_config(n, protocol, Path(tmp), rounds))
            train = got["train"]
            row = {
                "bench": "cost",
                "clients": n,
                "protocol": protocol,
                "round_seconds": got["rounds"].wall,
                "round_cpu_seconds": got["rounds"].cpu,
                "protocol_seconds": got["protocol"].wall,
                "protocol_cpu_seconds": got["protocol"].cpu,
                "part_seconds": {name: c.wall for name, c in got["parts"].items()},
                "part_cpu_seconds": {name: c.cpu for name, c in got["parts"].items()},
                "bytes_up_per_client": train[-1]["bytes_up"] / n,
                "bytes_down_per_client": train[-1]["bytes_down"] / n,
                "secagg": train[-1].get("secagg"),
                "threads": torch.get_num_threads(),
            }
            _append(out, row)


def _update_length() -> int:
    """The workload's mask-stage input length: its shared values, a weight, a count."""
    with tempfile.TemporaryDirectory() as tmp:
        exp = Experiment.build(validate(cost_config(2, "none", Path(tmp))))
    return SecureSum.dim(exp.model.initial_params)


def encrypt(out: Path, sizes: tuple[int, ...], protocols: tuple[str, ...]) -> None:
    dim = _update_length()
    rng = np.random.default_rng(0)
    for n in sizes:
        for protocol in protocols:
            scheme = scheme_for(protocol, Layout(dim, 32, n), 3072)
            x = rng.integers(0, (1 << 32) // n, dim, dtype=np.uint64)
            secret, *keygen = _clocked(scheme.keygen)
            public = scheme.public_key(secret.public)
            blobs, *encrypted = _clocked(public.encrypt, x)
            total, *added = _clocked(public.sum, [blobs] * n)
            summed, *decrypted = _clocked(secret.decrypt, total)
            assert np.array_equal(summed, x * np.uint64(n))
            row = {
                "bench": "encrypt",
                "clients": n,
                "protocol": protocol,
                "dim": dim,
                "ciphertexts": len(blobs),
                # (wall, CPU) seconds of each part
                "keygen_seconds": keygen,
                "encrypt_seconds": encrypted,
                "add_seconds": added,
                "decrypt_seconds": decrypted,
                "bytes_up_per_client": Ciphertexts(0, 0, blobs).nbytes(),
                "public_key_bytes": PublicContext(0, 0, secret.public).nbytes(),
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
            f"| {r['clients']} | {r['protocol']} | {s.get('neighbours', '–')} | "
            f"{s.get('threshold', '–')} | {s['quant_bits']} | {seconds:.2f} (plain "
            f"{base['seconds']:.2f}) | {proto:.3f} | {100 * proto / base['seconds']:.2f} % | "
            f"{up / 1e3:.1f} kB | {down / 1e3:.1f} kB |"
        )
    lines += _parts_table(rows)
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


def _mean_after_first_round(seconds: list[float], per_round: int) -> str:
    later = seconds[per_round:]
    return f"{statistics.mean(later):.3f}" if later else "–"


def _parts_table(rows: list[dict[str, Any]]) -> list[str]:
    """Each protocol's parts, CPU seconds per call after the first round: a client's input
    (SecAgg's masking, or encoding and encryption), the key pair, the server's addition,
    the decryption; and ``encrypt`` rows (one client's share of a round, no training)."""
    lines = [
        "",
        (
            "| clients | protocol | client's input CPU s | key pair CPU s | server sum CPU s "
            "| decryption CPU s | up / client | down / client |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["bench"] == "cost" and r.get("part_cpu_seconds") and r["protocol"] != "none":
            parts, n = r["part_cpu_seconds"], r["clients"]
            cells = [
                _mean_after_first_round(
                    parts.get(name, []), n if name in ("mask", "encrypt") else 1
                )
                for name in ("mask" if "mask" in parts else "encrypt", "keygen", "add", "decrypt")
            ]
            up, down = r["bytes_up_per_client"], r["bytes_down_per_client"]
        elif r["bench"] == "encrypt":
            cells = [
                f"{r[f'{name}_seconds'][1]:.3f}" for name in ("encrypt", "keygen", "add", "decrypt")
            ]
            up, down = r["bytes_up_per_client"], r["public_key_bytes"]
        else:
            continue
        lines.append(
            f"| {r['clients']} | {r['protocol']} | {' | '.join(cells)} | {up / 1e3:.1f} kB | "
            f"{down / 1e3:.1f} kB |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("cost", "encrypt", "accuracy", "table"))
    parser.add_argument(
        "out", nargs="?", type=Path, default=Path("benchmarks/results/secagg.jsonl")
    )
    parser.add_argument("--clients", default="10,50")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--protocols", nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None, help="instead of the anchor's 3")
    args = parser.parse_args()
    sizes = tuple(int(x) for x in args.clients.split(","))
    if args.what == "cost":
        cost(args.out, sizes, tuple(args.protocols or PROTOCOLS), args.rounds)
    elif args.what == "encrypt":
        encrypt(args.out, sizes, tuple(args.protocols or ("ckks", "paillier")))
    elif args.what == "accuracy":
        accuracy(args.out, tuple(int(x) for x in args.seeds.split(",")))
    else:
        print(table(args.out))


if __name__ == "__main__":
    main()

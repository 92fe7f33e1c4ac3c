"""Secure aggregation on Flower: the MRPC run of ``benchmarks/secagg.py accuracy`` (10
MiniLM clients, 10 rounds, SecAgg+) on a loopback deployment, a SuperLink and one
SuperNode with its worker per client on 127.0.0.1, every stage of the protocol a Flower
message round:

* whole: every node answers every stage (its scores equal the local runtime's run, to
  the torch threads each node computes with: one here);
* killed: client ``--kill``'s SuperNode is killed (SIGKILL) in round ``--round`` between
  sharing its keys and sending its masked input; its masks are rebuilt from the others'
  shares, and the client is missing from the rounds after.

    python -m benchmarks.secagg_flower --out benchmarks/results/secagg.jsonl
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.secagg import _append, accuracy_config
from fedloom.config import validate
from fedloom.runtime.flower_deploy import Federation, free_port, run_config
from fedloom.runtime.rundir import RunDir

CLIENTS = 10


def _run(federation: Federation, raw: dict[str, Any]) -> Path:
    """The run of ``raw`` on ``federation``, prepared as ``fedloom run`` prepares one."""
    cfg = validate({**raw, "runtime": {"name": "flower", "cpus_per_worker": 1}})
    run = RunDir.create(cfg.output_dir, cfg.name)
    run.write_config(run_config(cfg))
    run.write_status("running", rounds=cfg.federation.rounds)
    federation.submit(run.path / "config.toml", run.path)
    return run.path


def measure(out: Path, seed: int, kill: int, round_: int, cases: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp, Federation(Path(tmp) / "flower") as federation:
        superlink = federation.start_superlink(free_port())
        nodes = {c: federation.start_supernode(c, superlink) for c in range(CLIENTS)}
        federation.connect(superlink)
        for case in cases:
            raw = accuracy_config("secagg+", 0.0, seed, Path(tmp) / case)
            killed = None
            if case == "killed":
                # its reply to round --round's "share" stage (4 stages a round)
                killed = federation.kill_after_replies(
                    kill, nodes[kill], "train.secagg", 4 * (round_ - 1) + 2
                )
            began = time.perf_counter()
            run = _run(federation, raw)
            wall = time.perf_counter() - began
            status = json.loads((run / "status.json").read_text())
            if status["state"] != "finished":
                raise RuntimeError(f"the {case} run ended {status['state']}: {status['error']}")
            summary = json.loads((run / "summary.json").read_text())
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            train = [r for r in rows if r.get("scope") == "train"]
            _append(
                out,
                {
                    "bench": "flower",
                    "case": case,
                    "seed": seed,
                    "killed_client": kill if case == "killed" else None,
                    "killed_in_round": round_ if case == "killed" else None,
                    "killed": bool(killed and killed.is_set()),
                    "dev_accuracy": summary["global"]["dev"]["accuracy"],
                    "dev_f1": summary["global"]["dev"]["f1"],
                    "dev_n": summary["global"]["dev"]["n"],
                    "dropouts_recovered": sum(r.get("secagg_dropouts", 0) for r in train),
                    "summed": [r["secagg"]["summed"] for r in train if "secagg" in r],
                    "missing": {r["round"]: r["missing"] for r in train if r["missing"]},
                    "wall_seconds": round(wall, 1),
                },
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/secagg.jsonl"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill", type=int, default=3, help="the client whose node is killed")
    parser.add_argument("--round", type=int, default=5, help="in this round (1-based)")
    parser.add_argument("--cases", nargs="+", default=["whole", "killed"])
    args = parser.parse_args()
    measure(args.out, args.seed, args.kill, args.round, args.cases)


if __name__ == "__main__":
    main()

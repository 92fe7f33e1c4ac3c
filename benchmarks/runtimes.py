"""Wall time per round and peak memory of the runtimes, against the number of clients.

One workload per client count K: MiniLM + LoRA r = 8 on SST-2, 16 training examples per
client (IID), 4 local steps of batch 8 per client and round, every client every round,
FedAvg, evaluation only after the last round; ``--rounds`` rounds. Each runtime runs it in
a fresh process (``python -m benchmarks.runtimes --one ...``), so that start-up, model
loading and Ray's own processes are counted the same way every time. ``flower`` is the
loopback deployment of ``fedloom run`` (a SuperLink and one SuperNode per client; Flower
starts a fresh client process, which loads the model, for every message).

* seconds per round: the wall time between the first and the last round's ``train`` rows
  of metrics.jsonl, over ``rounds - 1`` (start-up and the final evaluation excluded);
* start-up: from the process start to the first round's row;
* peak memory: the largest sum of the resident set sizes of the process and all its
  descendants (for Ray: the actors, the raylet and the GCS), sampled every 0.2 s.

    python -m benchmarks.runtimes --clients 8,32,128 --runtimes local,ray --rounds 3
    python -m benchmarks.runtimes --clients 8 --runtimes local,flower --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime

import psutil


def tree_rss(process: psutil.Process) -> int:
    """Resident bytes of ``process`` and every descendant still alive."""
    total = 0
    for p in [process, *process.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def run_one(clients: int, runtime: str, rounds: int, workers: int, data_dir: str | None) -> dict:
    """The workload at ``clients`` clients on ``runtime``, in this process."""
    from fedloom.config import to_toml_dict, validate
    from fedloom.experiment import Experiment
    from fedloom.runtime.flower_deploy import run_loopback
    from fedloom.runtime.local import simulate
    from fedloom.runtime.rundir import RunDir

    raw = {
        "name": f"runtimes-{runtime}-{clients}",
        "data": {"task": "SST-2", "max_train_examples": 20 * clients, "max_dev_examples": 64,
                 "max_length": 64, **({"data_dir": data_dir} if data_dir else {})},
        "partition": {"scheme": "iid", "num_clients": clients, "test_fraction": 0.2,
                      "min_size": 4},
        "model": {"backbone": "minilm", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "algorithm": {"name": "fedavg"},
        "federation": {"rounds": rounds},
        "train": {"batch_size": 8, "local_steps": 4, "lr": 5e-4},
        "eval": {"every": rounds, "clients": False, "others": "never"},
        "diagnostics": {"every": 0},
        "runtime": {"name": runtime, "workers": workers, "cpus_per_worker": 1},
    }
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir.create(tmp, raw["name"])
        if runtime == "flower":  # as `fedloom run` does: the ServerApp writes the run
            run.write_config(to_toml_dict(validate(raw)))
            run.write_status("running", rounds=rounds)
            run_loopback(run.path / "config.toml", run.path, list(range(clients)))
        else:
            simulate(Experiment.build(validate(raw)), run)
        rows = [json.loads(x) for x in run.metrics_path.read_text().splitlines()]
        log = (run.path / "run.log").read_text().splitlines()
    stamps = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") for line in log
              if " round " in line and "train_loss" in line]
    per_round = ((stamps[-1] - stamps[0]).total_seconds() / (len(stamps) - 1)
                 if len(stamps) > 1 else None)
    return {"clients": clients, "runtime": runtime, "rounds": rounds,
            "train_rows": sum(r["scope"] == "train" for r in rows),
            "seconds_per_round": per_round, "first_round_at": stamps[0].isoformat()}


def measure(clients: int, runtime: str, rounds: int, workers: int, data_dir: str | None) -> dict:
    """:func:`run_one` in a fresh process, with its peak tree memory and start-up time."""
    started = time.time()
    cmd = [sys.executable, "-m", "benchmarks.runtimes", "--one", f"{clients}:{runtime}",
           "--rounds", str(rounds), "--workers", str(workers)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    watched, peak, stop = psutil.Process(proc.pid), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss(watched))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{runtime} at {clients} clients failed ({proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    first = datetime.fromisoformat(result.pop("first_round_at")).timestamp()
    return {**result, "startup_s": round(first - started, 1),
            "peak_rss_mb": round(peak[0] / 2**20), "wall_s": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="8,32,128")
    parser.add_argument("--runtimes", default="local,ray")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="Ray actors")
    parser.add_argument("--data-dir")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        clients, runtime = args.one.split(":")
        print(json.dumps(run_one(int(clients), runtime, args.rounds, args.workers,
                                 args.data_dir)))
        return
    print("| clients | runtime | s / round | start-up s | peak memory MB | wall s |")
    print("|---:|---|---:|---:|---:|---:|")
    for clients in map(int, args.clients.split(",")):
        for runtime in args.runtimes.split(","):
            r = measure(clients, runtime, args.rounds, args.workers, args.data_dir)
            print(f"| {clients} | {runtime} | {r['seconds_per_round']:.2f} | "
                  f"{r['startup_s']} | {r['peak_rss_mb']} | {r['wall_s']} |", flush=True)


if __name__ == "__main__":
    main()

"""Wall time per round and peak memory of the runtimes, against the number of clients.

One workload per client count K: MiniLM + LoRA r = 8 on SST-2, 16 training examples per
client (IID), 4 local steps of batch 8 per client and round, every client every round,
FedAvg, evaluation only after the last round; ``--rounds`` rounds. Each runtime runs it in
a fresh process (``python -m benchmarks.runtimes --one ...``), so that start-up, model
loading and Ray's own processes are counted the same way every time. ``flower`` is the
loopback deployment of ``fedloom run`` (a SuperLink and one SuperNode per client, and
beside each a fedloom worker that keeps the experiment built; Flower starts a fresh client
process for every message, which hands it to the worker); ``flower-noworker`` the same
without workers (each message's process builds the experiment: data, tokens, model).
With ``--config FILE`` the workload is that experiment file's (its clients and rounds).

* seconds per round: the wall time between the first and the last round's ``train`` rows
  of metrics.jsonl, over ``rounds - 1`` (start-up and the final evaluation excluded);
* start-up: from the process start to the first round's row;
* peak memory: the largest sum of the resident set sizes of the process and all its
  descendants (for Ray: the actors, the raylet and the GCS), sampled every 0.2 s.

With ``--check-memory`` (the local runtime at the two ``--clients`` counts), the peak
memory must grow by at most what each extra client is owed: its update held by the server
and its persistent AdamW moments, committed and pending (1 + 2 x 2 adapters), with 25 %
and 64 MB of slack; one backbone per client would be 90 MB each. It exits 1 otherwise.

    python -m benchmarks.runtimes --clients 8,32,128 --runtimes local,ray --rounds 3
    python -m benchmarks.runtimes --clients 8 --runtimes local,flower --rounds 3
    python -m benchmarks.runtimes --clients 10,100 --rounds 2 --check-memory
    python -m benchmarks.runtimes --config examples/flower/experiment.toml \
        --runtimes local,ray,flower,flower-noworker --workers 2
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


def run_one(clients: int, runtime: str, rounds: int, workers: int, data_dir: str | None,
            config: str | None = None) -> dict:
    """The workload at ``clients`` clients on ``runtime``, in this process (``config``: an
    experiment file instead, its own clients and rounds, on ``runtime``)."""
    from fedloom.config import load_config, to_toml_dict, validate
    from fedloom.experiment import Experiment
    from fedloom.params import num_bytes
    from fedloom.runtime.flower_deploy import run_config, run_loopback
    from fedloom.runtime.rundir import RunDir
    from fedloom.server import simulate

    raw = {
        "name": f"runtimes-{runtime}-{clients}",
        "data": {"task": "SST-2", "max_train_examples": 20 * clients, "max_dev_examples": 64,
                 "max_length": 64, **({"data_dir": data_dir} if data_dir else {})},
        "partition": {"scheme": "iid", "num_clients": clients, "test_fraction": 0.2,
                      "min_size": 4},
        "model": {"backbone": "minilm", "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
                  "precision": "fp32"},  # its table ran in fp32
        "algorithm": {"name": "fedavg"},
        "federation": {"rounds": rounds},
        "train": {"batch_size": 8, "local_steps": 4, "lr": 5e-4},
        "eval": {"every": rounds, "clients": False, "others": "never"},
        "diagnostics": {"every": 0},
        "runtime": {"name": runtime, "workers": workers, "cpus_per_worker": 1},
    }
    if config is not None:
        raw = to_toml_dict(load_config(config, [f'data.data_dir="{data_dir}"'] if data_dir else []))
        raw["runtime"] = {**raw["runtime"], "name": runtime.split("-")[0], "workers": workers}
        clients, rounds = raw["partition"]["num_clients"], raw["federation"]["rounds"]
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir.create(tmp, raw["name"])
        if runtime.startswith("flower"):  # as `fedloom run` does: the ServerApp writes the run
            run.write_config(run_config(validate(raw)))
            run.write_status("running", rounds=rounds)
            run_loopback(run.path / "config.toml", run.path, list(range(clients)),
                         workers=runtime != "flower-noworker")
            adapter = backbone = 0
        else:
            exp = Experiment.build(validate(raw))
            adapter = num_bytes(exp.model.initial_params)
            backbone = sum(t.numel() * t.element_size() for t in exp.model.head.parameters())
            simulate(exp, run)
        rows = [json.loads(x) for x in run.metrics_path.read_text().splitlines()]
        log = (run.path / "run.log").read_text().splitlines()
    stamps = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") for line in log
              if " round " in line and "train_loss" in line]
    per_round = ((stamps[-1] - stamps[0]).total_seconds() / (len(stamps) - 1)
                 if len(stamps) > 1 else None)
    return {"clients": clients, "runtime": runtime, "rounds": rounds,
            "train_rows": sum(r["scope"] == "train" for r in rows),
            "seconds_per_round": per_round, "first_round_at": stamps[0].isoformat(),
            "adapter_bytes": adapter, "backbone_bytes": backbone}


def measure(clients: int, runtime: str, rounds: int, workers: int, data_dir: str | None,
            config: str | None = None) -> dict:
    """:func:`run_one` in a fresh process, with its peak tree memory and start-up time."""
    started = time.time()
    cmd = [sys.executable, "-m", "benchmarks.runtimes", "--one", f"{clients}:{runtime}",
           "--rounds", str(rounds), "--workers", str(workers)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    if config:
        cmd += ["--config", config]
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


def check_memory(few: int, many: int, rounds: int, data_dir: str | None) -> int:
    """0 if the local runtime's peak memory grows from ``few`` to ``many`` clients by at
    most the clients' own state (see the module docstring), else 1."""
    small, big = (measure(k, "local", rounds, 1, data_dir) for k in (few, many))
    adapter_mb, backbone_mb = big["adapter_bytes"] / 2**20, big["backbone_bytes"] / 2**20
    per_client = (big["peak_rss_mb"] - small["peak_rss_mb"]) / (many - few)
    owed = 5 * adapter_mb  # the update, and AdamW's two moments committed and pending
    bound = 1.25 * owed + 64 / (many - few)
    print(f"peak memory: {small['peak_rss_mb']} MB at {few} clients, {big['peak_rss_mb']} MB "
          f"at {many}; backbone {backbone_mb:.1f} MB, adapter {adapter_mb:.2f} MB")
    print(f"memory_per_client_mb={per_client:.2f} owed={owed:.2f} bound={bound:.2f}")
    return 0 if per_client <= bound else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="8,32,128")
    parser.add_argument("--runtimes", default="local,ray")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="Ray actors")
    parser.add_argument("--data-dir")
    parser.add_argument("--check-memory", action="store_true",
                        help="assert the local runtime's memory per client (two --clients)")
    parser.add_argument("--config", help="an experiment file to run instead (its clients "
                        "and rounds; e.g. examples/flower/experiment.toml)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        clients, runtime = args.one.split(":")
        print(json.dumps(run_one(int(clients), runtime, args.rounds, args.workers,
                                 args.data_dir, args.config)))
        return
    if args.check_memory:
        sys.exit(check_memory(*map(int, args.clients.split(",")), args.rounds, args.data_dir))
    print("| clients | runtime | s / round | start-up s | peak memory MB | wall s |")
    print("|---:|---|---:|---:|---:|---:|")
    for clients in map(int, args.clients.split(",")):
        for runtime in args.runtimes.split(","):
            r = measure(clients, runtime, args.rounds, args.workers, args.data_dir, args.config)
            print(f"| {r['clients']} | {runtime} | {r['seconds_per_round']:.2f} | "
                  f"{r['startup_s']} | {r['peak_rss_mb']} | {r['wall_s']} |", flush=True)


if __name__ == "__main__":
    main()

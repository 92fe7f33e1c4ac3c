"""Why naive FedAvg lagged centralized LoRA on MRPC: one change at a time.

Every variant starts from examples/mrpc_fedavg.toml (3 IID clients, 4 passes over the
data in total) and overrides some keys; `centralized` is examples/mrpc_centralized.toml.

    python -m benchmarks.fedavg_ablation --variant naive          # one variant (~10 min)
    python -m benchmarks.fedavg_ablation                          # all of them

Prints one JSON line per variant with the final MRPC dev accuracy / F1.
"""

from __future__ import annotations

import argparse
import json

from fedloom.config import load_config
from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

FEDAVG = "examples/mrpc_fedavg.toml"
VARIANTS: dict[str, tuple[str, list[str]]] = {
    # 4 rounds x 1 local epoch, AdamW re-created and the schedule restarted every round,
    # one learning rate for head and adapters, batch 32 per client.
    "naive": (FEDAVG, [
        "federation.rounds=4", "train.local_epochs=1.0", "train.optimizer_state=\"reset\"",
        "train.schedule_scope=\"round\"", "train.head_lr=1e-3", "train.batch_size=32",
        "eval.every=1",
    ]),
    # naive, but batch 32 / 3 per client: as many sequential steps as centralized.
    "naive_small_batch": (FEDAVG, [
        "federation.rounds=4", "train.local_epochs=1.0", "train.optimizer_state=\"reset\"",
        "train.schedule_scope=\"round\"", "train.head_lr=1e-3", "eval.every=1",
    ]),
    # 16 short rounds, AdamW moments kept per client, one schedule over the run, head 3x
    # faster, but still batch 32 per client (3x fewer sequential steps than centralized).
    "short_rounds_persistent_adam": (FEDAVG, ["train.batch_size=32"]),
    # ... and batch 32 / 3 per client: the shipped examples/mrpc_fedavg.toml.
    "fedloom_default": (FEDAVG, []),
    "centralized": ("examples/mrpc_centralized.toml", []),
}


def run_variant(name: str, out: str) -> dict[str, object]:
    path, overrides = VARIANTS[name]
    cfg = load_config(path, overrides + [f"name=\"ablation-{name}\""])
    summary = simulate(Experiment.build(cfg), RunDir.create(out, cfg.name))
    dev = summary["global"]["dev"]
    return {"variant": name, "accuracy": dev["accuracy"], "f1": dev["f1"],
            "wall_seconds": summary["wall_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), action="append")
    parser.add_argument("--out", default="runs/ablation")
    args = parser.parse_args()
    for name in args.variant or list(VARIANTS):
        print(json.dumps(run_variant(name, args.out)), flush=True)


if __name__ == "__main__":
    main()

"""FedAvg-FT's fine-tuning defaults, chosen on the clients' validation splits.

FedAvg-FT trains exactly as FedAvg; its hyperparameters (``ft_epochs``, ``ft_patience``,
``ft_holdout``) only decide how each client fine-tunes the final global adapter before it
is scored. So one FedAvg run serves the whole grid: train once, then fine-tune and score
every grid point from the same final global adapter. Selection reads the personal
adapters' mean validation accuracy only (``partition.val_fraction = 0.2``; the validation
split is never trained on, neither by FedAvg nor by the fine-tuning); the global adapter's
validation score is printed beside it, which is the check of "the global adapter is not a
fine-tuning candidate". Test scores are printed for the selected point only.

Run it on a federation or seed other than the ones whose tables report FedAvg-FT (the
personalization tables use seed 0):

    python -m benchmarks.fedavg_ft_defaults --federation c --seed 1
    python -m benchmarks.fedavg_ft_defaults --federation b --seed 1
    python -m benchmarks.fedavg_ft_defaults --backbone tiny-bert --max-train-examples 200 \
        --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.personalization import FEDERATIONS, base_config
from fedloom.algorithms.fedavg_ft import FedAvgFT
from fedloom.config import validate
from fedloom.evaluation.round import evaluate_state
from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate

warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

#: (ft_epochs, ft_patience, ft_holdout); patience means nothing without a holdout
GRID: list[tuple[float, int, float]] = [
    *[(epochs, 1, 0.0) for epochs in (1.0, 2.0, 3.0)],
    *[(epochs, patience, 0.2) for epochs, patience in itertools.product((1.0, 2.0, 3.0), (1, 2))
      if not (epochs == 1.0 and patience == 2)],
]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    raw = base_config(args.federation, "fedavg_ft", backbone=args.backbone,
                      max_train=args.max_train_examples, rounds=args.rounds)
    raw["seed"] = args.seed
    raw["eval"]["client_mode"] = "split"  # selection reads val; test only for the choice
    exp = Experiment.build(validate(raw))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDir.create(tmp, "fedavg-ft-defaults")
        simulate(exp, run_dir)
        final = load_params(run_dir.checkpoints / "global.safetensors")
    rows = []
    for epochs, patience, holdout in GRID:
        alg = FedAvgFT(ft_epochs=epochs, ft_patience=patience, ft_holdout=holdout)
        scored = evaluate_state(replace(exp, algorithm=alg), alg.init(final), args.rounds)
        summary = scored.summary
        rows.append({
            "federation": args.federation, "seed": args.seed,
            "ft_epochs": epochs, "ft_patience": patience, "ft_holdout": holdout,
            "personal_val": summary["personal"]["val"]["accuracy"]["mean"],
            "global_val": summary["global"]["val"]["accuracy"]["mean"],
            "personal_test": summary["personal"]["clients"]["accuracy"]["mean"],
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    best = max(range(len(rows)), key=lambda i: (rows[i]["personal_val"], -i))
    lines = [("| ft_epochs | ft_patience | ft_holdout | personal val mean | global val mean "
              "| personal test mean (selected only) |"), "|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(rows):
        test = f"{r['personal_test']:.1%}" if i == best else ""
        lines.append(f"| {r['ft_epochs']:g} | {r['ft_patience']} | {r['ft_holdout']:g} | "
                     f"{r['personal_val']:.1%} | {r['global_val']:.1%} | {test} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--federation", choices=sorted(FEDERATIONS), default="c")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backbone", default="minilm")
    parser.add_argument("--max-train-examples", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, help="append the rows as JSON lines")
    args = parser.parse_args()
    rows = run(args)
    if args.out:
        with args.out.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))


if __name__ == "__main__":
    main()

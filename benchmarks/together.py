"""Many clients, one pass (``train.clients_per_pass``, :mod:`fedloom.train.together`)
against one by one: seconds per round of local training for K clients, and how far the
two modes' adapters end apart.

The workload is the anchor's (``benchmarks/anchor.toml``: MiniLM + LoRA r = 8 on query and
value plus the classifier, MRPC rows in file order, batch 16, one local epoch, AdamW),
with ``--clients`` clients of ``--client-size`` examples, FedAvg, evaluation off. Each
repetition runs one round of every client's local training from the same adapter in each
mode, the modes interleaved; reported: the median seconds per round of each mode, the
ratio one-by-one / together (the speed-up), and how far the two modes' updates end apart
(the largest over the clients of ‖Δ_one − Δ_together‖ / ‖Δ_one‖). The backbone's own
dropout (MiniLM's 0.1, on in training) is set to 0 here, as LoRA's and the head's are in
the anchor, so that the modes compute the same thing up to floating-point reassociation.

    OMP_NUM_THREADS=1 python -m benchmarks.together --clients 8 --reps 5
    OMP_NUM_THREADS=1 python -m benchmarks.together --clients 64 --client-size 16 --reps 3

``--precision`` sets ``model.precision`` (the anchor's is fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedloom.config import load_config
from fedloom.experiment import Experiment
from fedloom.runtime.clients import ClientHost

ANCHOR = Path(__file__).with_name("anchor.toml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--client-size", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "auto"))
    parser.add_argument("--data-dir", help="GLUE directory (default: the library's)")
    args = parser.parse_args()
    overrides = [f"partition.num_clients={args.clients}",
                 f"partition.client_size={args.client_size}",
                 f'model.precision="{args.precision}"']
    if args.data_dir:
        overrides.append(f"data.data_dir={json.dumps(args.data_dir)}")
    modes = {1: None, args.clients: None}
    for per_pass in modes:
        cfg = load_config(ANCHOR, [*overrides, f"train.clients_per_pass={per_pass}"])
        modes[per_pass] = exp = Experiment.build(cfg)
        for module in exp.model.head.modules():  # the backbone's dropout, on in training
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    start = next(iter(modes.values())).model.get_params()
    ids = list(range(args.clients))
    times: dict[int, list[float]] = {p: [] for p in modes}
    adapters: dict[int, dict] = {}
    for rep in range(args.reps):
        for per_pass, exp in modes.items():
            host = ClientHost(exp, ids)
            began = time.perf_counter()
            replies = host.train_many(rep, 0, {cid: start for cid in ids})
            times[per_pass].append(time.perf_counter() - began)
            adapters[per_pass] = {r.client_id: r.result.params for r in replies}
    one, together = (adapters[p] for p in modes)
    # Adam moves a coordinate by about lr whatever its gradient's size, so coordinates whose
    # gradient is ~0 flip with the sign of rounding noise: compare the whole update
    gap = max(float(torch.linalg.vector_norm(torch.cat([(one[c][n] - together[c][n]).ravel()
                                                        for n in one[c]]))
                    / torch.linalg.vector_norm(torch.cat([(one[c][n] - start[n]).ravel()
                                                          for n in one[c]])))
              for c in one)
    t_one, t_together = (statistics.median(times[p]) for p in modes)
    print(json.dumps({"clients": args.clients, "client_size": args.client_size,
                      "precision": args.precision, "threads": torch.get_num_threads(),
                      "one_by_one_s": round(t_one, 3), "together_s": round(t_together, 3),
                      "update_gap": gap}))
    print(f"speedup_together_vs_one_by_one={t_one / t_together:.2f}")


if __name__ == "__main__":
    main()

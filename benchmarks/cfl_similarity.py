"""What CFL's split criterion sees on real data: per round, the optimal bipartition of the
clients' LoRA updates, its largest cross-group cosine similarity α_cross and the update
norms, on MRPC with and without concept shift. A diagnostic: it reads the true grouping,
so it explains what γ does but must not choose it (the default is chosen on validation
splits, see ``fedloom.algorithms.cfl``).

CFL runs with splitting off (γ = −1), so every round tests the same single cluster of all
clients. A split is right when its two parts are exactly the swapped and the unswapped
clients.

    python -m benchmarks.cfl_similarity --rounds 6               # MiniLM, 800 examples
    python -m benchmarks.cfl_similarity --backbone tiny-bert --max-train-examples 200 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import dataclass
from typing import Any

from benchmarks.personalization import base_config
from fedloom import algorithms
from fedloom.algorithms.cfl import CFL
from fedloom.config import validate
from fedloom.experiment import Experiment
from fedloom.runtime.clients import client_context
from fedloom.server import sample_clients

warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")


@dataclass(frozen=True)
class Probe(CFL):
    """CFL that never splits (γ = −1) and records its split check of every round."""

    max_cross_similarity: float = -1.0


def measure(federation: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    raw = base_config("c" if federation == "iid" else federation, "fedavg",
                      backbone=args.backbone, max_train=args.max_train_examples,
                      rounds=args.rounds)
    if federation == "iid":  # federation c without its concept shift
        del raw["partition"]["concept"]
    raw["algorithm"] = {"name": "cfl"}
    exp = Experiment.build(validate(raw))
    alg = Probe()
    swapped = {s.client_id for s in exp.data.splits if s.label_map is not None}
    ids = [c.client_id for c in exp.clients]
    states: dict[int, dict] = {cid: {} for cid in ids}
    state = alg.init(exp.model.get_params())
    rows = []
    for r in range(args.rounds):
        sampled = sample_clients(ids, exp.cfg.federation.fraction, exp.cfg.federation.min_clients,
                                 exp.cfg.seed, r)
        results = []
        for c in (exp.clients[i] for i in sampled):
            ctx = client_context(exp, c, r, states[c.client_id])
            results.append(alg.local_train(ctx, alg.payload(state, c.client_id)))
            states[c.client_id] = ctx.state
        check = alg.split_check(alg.payload(state, 0), results, r + 1)
        parts = [sorted(results[i].client_id for i in part) for part in check["parts"]]
        rows.append({
            "federation": federation, "round": r + 1,
            "cross_similarity": round(check["cross_similarity"], 4),
            "mean_norm": round(check["mean_norm"], 5), "max_norm": round(check["max_norm"], 5),
            "parts": parts, "swapped": sorted(swapped),
            "right": bool(swapped) and {frozenset(p) for p in parts} == {
                frozenset(swapped), frozenset(set(ids) - swapped)},
        })
        print(json.dumps(rows[-1]), flush=True)
        state = alg.aggregate(state, results)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--federations", default="c,iid",
                        help="c (concept shift), iid (c without the shift), a (Dirichlet 0.1)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-train-examples", type=int, default=800)
    parser.add_argument("--backbone", default="minilm")
    args = parser.parse_args()
    for federation in args.federations.split(","):
        measure(federation, args)


if __name__ == "__main__":
    assert "cfl" in algorithms.available()
    main()

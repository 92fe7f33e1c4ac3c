"""How well do PQ-LoRA factors align across backbones, and how long does it take?

Aligns ``--big`` to ``--anchor`` (fedloom.models.align) on the first ``--texts`` SST-2
training sentences and scores the result on the next ``--held-out`` ones:

- A: relative MSE of the rank-space match, Σ||A_big x_big − A_anchor x_anchor||² /
  Σ||A_anchor x_anchor||² over matched tokens, for the fitted A_big and for a random
  orthonormal one; also after the best scalar rescaling of A_big x_big (the part of the
  error that is direction, not scale).
- B: R² of the fitted output map G (centred outputs, y_big ≈ G y_anchor) on held-out tokens.

Reports the seconds of each phase (loading, the two models' forward passes, the fits).

    OMP_NUM_THREADS=1 python -m benchmarks.align_quality --glue ../shared/data/glue
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedloom.models import align
from fedloom.models.backbones import load_backbone
from fedloom.models.catalog import resolve_backbone
from fedloom.models.pqlora import orthonormal


def sst2_sentences(glue: Path, count: int) -> list[str]:
    lines = (glue / "SST-2" / "train.tsv").read_text().splitlines()[1 : count + 1]
    return [line.split("\t")[0] for line in lines]


def relative_mse(pred: torch.Tensor, target: torch.Tensor, rescale: bool = False) -> float:
    if rescale:
        pred = pred * (pred * target).sum() / (pred * pred).sum()
    return ((pred - target).square().sum() / target.square().sum()).item()


Rows = tuple[torch.Tensor, torch.Tensor]


def r_squared(g: torch.Tensor, held: Rows, fit: Rows) -> float:
    """R² of y_b ≈ G y_a on ``held`` rows, centred with the means of the ``fit`` rows."""
    a, b = held[0].double() - fit[0].double().mean(0), held[1].double() - fit[1].double().mean(0)
    return 1 - ((a @ g.T - b).square().sum() / b.square().sum()).item()


def summary(values: list[float]) -> dict[str, float]:
    stats = {"median": statistics.median(values), "mean": statistics.mean(values),
             "max": max(values), "min": min(values)}
    return {key: round(value, 3) for key, value in stats.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--glue", type=Path, default=Path("../shared/data/glue"))
    parser.add_argument("--anchor", default="minilm")
    parser.add_argument("--big", default="smollm2-135m")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--held-out", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", choices=["lstsq", "cca"], default="lstsq")
    parser.add_argument("--ridge", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    sentences = sst2_sentences(args.glue, args.texts + args.held_out)
    train, held = sentences[: args.texts], sentences[args.texts :]
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    anchor = load_backbone(resolve_backbone(args.anchor))
    big = load_backbone(resolve_backbone(args.big))
    seconds["load"] = time.perf_counter() - start

    start = time.perf_counter()
    anchor_params = align.anchor_adapters(anchor[0], args.rank, args.blocks, args.seed)
    acts = align.collect_pair(anchor, big, train, args.blocks)
    seconds["forward"] = time.perf_counter() - start
    start = time.perf_counter()
    fits = align.fit_pair(
        acts, anchor_params, method=args.method, ridge=args.ridge, steps=args.steps
    )
    seconds["fit"] = time.perf_counter() - start
    seconds["align_pair"] = seconds["forward"] + seconds["fit"]

    held_acts = align.collect_pair(anchor, big, held, args.blocks)
    fitted, random, rescaled, r2 = [], [], [], []
    per_role: dict[str, list[float]] = {}
    generator = torch.Generator().manual_seed(args.seed + 1)
    for match, held_match in zip(acts.matches, held_acts.matches, strict=True):
        x_a, x_b = held_acts.rows(held_match, "inputs")
        z = x_a @ anchor_params[f"anchor.{match.anchor_slot}.A"].T
        pred = x_b @ fits[f"big.{match.big_slot}.A"].T
        fitted.append(relative_mse(pred, z))
        rescaled.append(relative_mse(pred, z, rescale=True))
        baseline = orthonormal(args.rank, x_b.shape[1], generator)
        random.append(relative_mse(x_b @ baseline.T, z))
        per_role.setdefault(match.big_slot.split(".")[1], []).append(fitted[-1])
        fit_rows = acts.rows(match, "outputs")
        g = align.output_map(*fit_rows, args.ridge, args.method)
        r2.append(r_squared(g, held_acts.rows(held_match, "outputs"), fit_rows))

    matched = sum(map(len, acts.pairs))
    report = {
        "pair": f"{args.anchor} -> {args.big}",
        "texts": args.texts,
        "held_out": args.held_out,
        "matched_tokens": matched,
        "rank": args.rank,
        "blocks": args.blocks,
        "modules": len(acts.matches),
        "threads": torch.get_num_threads(),
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "A_held_out_relative_mse": {
            "fitted": summary(fitted),
            "random_orthonormal": summary(random),
            "fitted_rescaled": summary(rescaled),
        },
        "A_fitted_by_role_median": {r: round(statistics.median(v), 3) for r, v in per_role.items()},
        f"B_held_out_r2_{args.method}": summary(r2),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

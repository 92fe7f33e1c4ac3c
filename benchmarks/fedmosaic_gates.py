"""How much say FedMosaic's clients give their global slot: the gate values g(x) of a
finished run's personal adapters.

Every adapted layer of a FedMosaic client mixes its two branches per example,
``g(x) · global slot + (1 − g(x)) · local adapter`` (:mod:`fedloom.models.mosaic`), g from
the layer's :class:`~fedloom.models.gate.NoisyTokenGate`, σ(mean_t x_t · w + b) at
evaluation. The gates start at g = 1/2; where they end after training says how much of a
client's prediction the relevance-weighted mix of its partners carries. For each client's
saved adapter this scores the first ``--examples`` examples of the run's task split and
records g at every gated layer and example (mean, 10th and 90th percentile), with σ(b) and
‖w‖ averaged over the client's layers: whether the bias or the input weights did the moving.
The accuracy is on the split's labels as they are, so a client trained on swapped labels
scores low there by design. On federation (s) (12 clients, 4 on SmolLM2) at 160 examples it
takes about 6 CPU minutes on one thread, mostly the SmolLM2 clients.

    python -m benchmarks.fedmosaic_gates RUN_DIR --data ../shared/data/glue --examples 160
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedloom.config import load_config
from fedloom.evaluation.finished_run import load_verified, scoring_models
from fedloom.evaluation.run_data import load_examples
from fedloom.evaluation.run_task import run_task
from fedloom.evaluation.score import evaluate
from fedloom.models.fedmodel import FedModel
from fedloom.models.gate import NoisyTokenGate
from fedloom.models.heads import Feature
from fedloom.params import Params


def gated_scores(
    model: FedModel, gates: list[NoisyTokenGate], params: Params, features: list[Feature]
) -> tuple[torch.Tensor, dict[str, float | None]]:
    """``params``' scores on ``features`` and every value the ``gates`` put out meanwhile."""
    values: list[torch.Tensor] = []

    def record(_gate: nn.Module, _args: Any, g: torch.Tensor) -> None:
        values.append(g.detach().float().flatten())

    handles = [g.register_forward_hook(record) for g in gates]
    try:
        scores = evaluate(model, params, features, batch_size=32)
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(values), scores


def client_gates(
    run_dir: Path, data: Path, examples: int, split: str = "dev"
) -> dict[int, dict[str, Any]]:
    """Per client of the run in ``run_dir``: its slot weight g(x) over ``examples`` examples
    of ``split`` and every gated layer, the gates' σ(b) and ‖w‖, and its accuracy there."""
    cfg = load_config(run_dir / "config.toml")
    if cfg.model.adapters != "mosaic":
        raise ValueError(
            f"{run_dir}: not a FedMosaic run (model.adapters = {cfg.model.adapters!r})"
        )
    run = run_task(cfg)
    chosen = load_examples(data, run, split=split)[:examples]
    model_for = scoring_models(run_dir, cfg, run, chosen)
    paths = sorted((run_dir / "checkpoints" / "personal").glob("client_*.safetensors"))
    if not paths:
        raise ValueError(f"{run_dir}: no personal adapters saved")
    out: dict[int, dict[str, Any]] = {}
    for path in paths:
        cid = int(path.stem.removeprefix("client_"))
        backbone = cfg.model.backbone_of(cid)
        model, features = model_for(backbone)
        params, _, _ = load_verified(path, lambda line: print(line, file=sys.stderr))
        gates = [m for m in model.head.modules() if isinstance(m, NoisyTokenGate)]
        g, scores = gated_scores(model, gates, params, features)
        out[cid] = {
            "backbone": backbone,
            "layers": len(gates),
            "g_mean": g.mean().item(),
            "g_p10": g.quantile(0.1).item(),
            "g_p90": g.quantile(0.9).item(),
            "sigmoid_bias": torch.stack([torch.sigmoid(m.proj.bias).squeeze() for m in gates])
            .mean()
            .item(),
            "weight_norm": torch.stack([m.proj.weight.norm() for m in gates]).mean().item(),
            "accuracy": scores.get("accuracy"),
            "n": len(features),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--data", type=Path, required=True, help="the run's data (GLUE directory or file)"
    )
    parser.add_argument("--split", default="dev")
    parser.add_argument("--examples", type=int, default=160)
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON")
    args = parser.parse_args()
    try:
        result = client_gates(args.run_dir, args.data, args.examples, args.split)
    except (ValueError, OSError) as err:  # not a FedMosaic run, no checkpoints, no data
        parser.error(str(err))
    print("| client | backbone | g mean | g p10–p90 | σ(b) | ‖w‖ | accuracy |")
    print("|---:|---|---:|---|---:|---:|---:|")
    for cid, r in result.items():
        print(
            f"| {cid} | {r['backbone']} | {r['g_mean']:.3f} | {r['g_p10']:.3f}–{r['g_p90']:.3f} "
            f"| {r['sigmoid_bias']:.3f} | {r['weight_norm']:.3f} | {r['accuracy']:.3f} |"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

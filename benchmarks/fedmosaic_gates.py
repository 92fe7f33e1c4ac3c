"""How much say FedMosaic's clients give their global slot, and what the slot holds: the
gate values g(x) of a finished run's personal adapters, and each adapter scored with its
gates pinned to one branch.

Every adapted layer of a FedMosaic client mixes its two branches per example,
``g(x) · global slot + (1 − g(x)) · local adapter`` (:mod:`fedloom.models.mosaic`), g from
the layer's :class:`~fedloom.models.gate.NoisyTokenGate`, σ(mean_t x_t · w + b) at
evaluation. The gates start at g = 1/2; where they end after training says how much of a
client's prediction the relevance-weighted mix of its partners carries. For each client's
saved adapter this scores the first ``--examples`` examples of the run's task split and
records g at every gated layer and example (mean, 10th and 90th percentile), with σ(b) and
‖w‖ averaged over the client's layers: whether the bias or the input weights did the moving.
It then scores the adapter twice more with every gate's bias set to +∞ (g ≡ 1: the slot
alone) and to −∞ (g ≡ 0: the local adapter alone), which the gate's bias joining after the
pooling makes exact. ``accuracy`` is on the split's labels as they are (what ``fedloom eval
--personal`` reports on it, so a client trained on swapped labels scores low there by
design); ``own``, ``slot`` and ``local`` are on the client's own labeling (its label map
in the run's ``partition.json`` applied), gated, slot alone and local adapter alone. On
federation (s) (12 clients, 4 on SmolLM2) at 160 examples it takes about 18 CPU minutes on
one thread (three scoring passes), mostly the SmolLM2 clients.

    python -m benchmarks.fedmosaic_gates RUN_DIR --data ../shared/data/glue --examples 160
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedloom.config import load_config
from fedloom.evaluation.finished_run import load_verified, scoring_models
from fedloom.evaluation.run_data import load_examples
from fedloom.evaluation.run_task import run_task
from fedloom.evaluation.score import scores as scored
from fedloom.models.dual import GATE
from fedloom.models.fedmodel import FedModel
from fedloom.models.gate import NoisyTokenGate
from fedloom.models.heads import Feature
from fedloom.params import Params


def gated_predictions(
    model: FedModel, gates: list[NoisyTokenGate], params: Params, features: list[Feature]
) -> tuple[torch.Tensor, np.ndarray, np.ndarray, dict[str, float | None]]:
    """Every value the ``gates`` put out while ``params`` predict ``features``, the
    predictions, the features' labels, and the predictions' scores on them."""
    values: list[torch.Tensor] = []

    def record(_gate: nn.Module, _args: Any, g: torch.Tensor) -> None:
        values.append(g.detach().float().flatten())

    handles = [g.register_forward_hook(record) for g in gates]
    model.set_params(params)
    try:
        predictions, labels, losses = model.predict_each(features, batch_size=32)
    finally:
        for handle in handles:
            handle.remove()
    scores = scored(model, predictions, labels, losses, features)
    return torch.cat(values), predictions, labels, scores


def pinned(params: Params, bias: float) -> Params:
    """``params`` with every gate's bias set to ``bias``: +inf gives g ≡ 1 (the global slot
    alone), −inf g ≡ 0 (the local adapter alone)."""
    suffix = f"{GATE}.proj.bias"
    return {k: torch.full_like(v, bias) if k.endswith(suffix) else v for k, v in params.items()}


def accuracy(model: FedModel, params: Params, features: list[Feature], labels: np.ndarray) -> float:
    """The share of ``features`` whose prediction under ``params`` is the one in ``labels``."""
    model.set_params(params)
    return float(np.mean(model.predict_each(features, batch_size=32)[0] == labels))


def label_maps(run_dir: Path) -> dict[int, list[int] | None]:
    """Each client's label map (``y -> map[y]``) from the run's ``partition.json``."""
    path = run_dir / "partition.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing; the clients' label maps are read from it")
    return {c["client_id"]: c.get("label_map") for c in json.loads(path.read_text())["clients"]}


def client_gates(
    run_dir: Path, data: Path, examples: int, split: str = "dev"
) -> dict[int, dict[str, Any]]:
    """Per client of the run in ``run_dir``: its slot weight g(x) over ``examples`` examples
    of ``split`` and every gated layer, the gates' σ(b) and ‖w‖, its accuracy there on the
    labels as they are, and on its own labeling gated, slot alone and local alone."""
    cfg = load_config(run_dir / "config.toml")
    if cfg.model.adapters != "mosaic":
        raise ValueError(
            f"{run_dir}: not a FedMosaic run (model.adapters = {cfg.model.adapters!r})"
        )
    run = run_task(cfg)
    chosen = load_examples(data, run, split=split)[:examples]
    maps = label_maps(run_dir)
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
        g, predictions, labels, scores = gated_predictions(model, gates, params, features)
        own = labels if maps.get(cid) is None else np.asarray(maps[cid])[labels]
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
            "own": float(np.mean(predictions == own)),
            "slot": accuracy(model, pinned(params, float("inf")), features, own),
            "local": accuracy(model, pinned(params, float("-inf")), features, own),
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
    print("| client | backbone | g mean | g p10–p90 | σ(b) | ‖w‖ | accuracy | own | slot | local |")
    print("|---:|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for cid, r in result.items():
        print(
            f"| {cid} | {r['backbone']} | {r['g_mean']:.3f} | {r['g_p10']:.3f}–{r['g_p90']:.3f} "
            f"| {r['sigmoid_bias']:.3f} | {r['weight_norm']:.3f} | {r['accuracy']:.3f} "
            f"| {r['own']:.3f} | {r['slot']:.3f} | {r['local']:.3f} |"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

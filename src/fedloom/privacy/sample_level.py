"""Sample-level DP in a run: ``[privacy] level = "sample"`` (DP-SGD in every client's
local training, :mod:`fedloom.train.dp_sgd`), the algorithms and training paths it
covers, and the server's record of the clients' ε.

Every example's influence on everything the client computes from its training data is
bounded by DP-SGD's clipping and noise, so whatever the client derives and sends (the
shared update, a personal adapter it keeps) is covered, as post-processing, provided the
data is read only through DP-SGD steps. Covered: the algorithms whose client step is the
shared local-training loop on a mean of per-example losses, which each declares for itself
(``per_example_client_step``, not inherited). Refused: a client
step with a term that is not per-example (FedProx's and Ditto's proximal terms, SCAFFOLD's
correction), one that reads the data outside the loop (IFCA's and FedEM's loss-based
choices, FedMosaic's gates and task vectors, the hand-written steps of pFedMe, Per-FedAvg,
APFL, L2GD). The scores a client reports on its own splits are not covered.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedloom.algorithms import Algorithm
from fedloom.algorithms.base import declares
from fedloom.algorithms.registry import declaring
from fedloom.config import ExperimentConfig
from fedloom.privacy.client_level import LOOSE_EPSILON
from fedloom.privacy.ledger import RoundRelease
from fedloom.train import dp_sgd


def on(cfg: ExperimentConfig) -> bool:
    return cfg.privacy.level == "sample"


def check(cfg: ExperimentConfig, algorithm: Algorithm) -> None:
    """A ``ValueError`` naming the key of what DP-SGD cannot cover: the algorithm, a
    training path without per-example gradients, a precision other than fp32."""
    if not declares(type(algorithm), "per_example_client_step"):
        covered = declaring("per_example_client_step")
        raise ValueError(
            f"privacy.level: DP-SGD does not cover algorithm {algorithm.name!r} (its client "
            f"step has a term that is not per-example, or reads the data outside the "
            f"training loop); covered: {', '.join(covered)}"
        )
    train = cfg.train
    if train.clients_per_pass > 1:
        raise ValueError(
            "train.clients_per_pass: DP-SGD needs each example's gradient, which "
            "training several clients in one pass does not compute; use 1"
        )
    if train.grad_accum > 1:
        raise ValueError("train.grad_accum: DP-SGD draws one Poisson batch per step; use 1")
    if train.bf16 or cfg.model.precision != "fp32":
        key = "train.bf16" if train.bf16 else "model.precision"
        raise ValueError(f"{key}: DP-SGD through Opacus runs in fp32; set model.precision = 'fp32'")


@dataclass
class SampleLedger:
    """Each client's latest ε, as its updates report it."""

    cfg: ExperimentConfig
    per_client: dict[int, float] = field(default_factory=dict)

    def announce(self, log: logging.Logger) -> None:
        """Nothing before the first round: each client's DP-SGD reports its own ε."""

    def record(self, round_: RoundRelease) -> dict[str, Any]:
        """The round's entries for metrics.jsonl: the largest ε of any client so far."""
        for res in round_.results:
            if "epsilon" in res.metrics:
                self.per_client[res.client_id] = float(res.metrics["epsilon"])
        return {
            "epsilon": max(self.per_client.values(), default=0.0),
            "per_client_epsilon": {
                str(r.client_id): float(r.metrics["epsilon"])
                for r in round_.results
                if "epsilon" in r.metrics
            },
        }

    def unreleased_row(self) -> dict[str, Any]:
        return {}

    def warning(self, summary: Mapping[str, Any]) -> str | None:
        if summary["epsilon"] <= LOOSE_EPSILON:
            return None
        return (
            f"a client's DP-SGD epsilon reached {summary['epsilon']:.3g}, above "
            f"{LOOSE_EPSILON:g}, which promises little: raise privacy.noise_multiplier or "
            f"train fewer steps"
        )

    def summary(self) -> dict[str, Any]:
        return dp_sgd.summary(self.per_client, self.cfg.privacy)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"client": c, "epsilon": e} for c, e in sorted(self.per_client.items())]

    @classmethod
    def from_json(cls, cfg: ExperimentConfig, rows: Sequence[Mapping[str, Any]]) -> SampleLedger:
        return cls(cfg, {int(r["client"]): float(r["epsilon"]) for r in rows})

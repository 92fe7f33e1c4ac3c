"""A run's privacy ledger: what each round released, read from the round itself.

The round hands the ledger what it knows (:class:`RoundRelease`): the clients it sampled,
the updates it accepted, and the DP events the transform chain's stages report in their
measurements (:meth:`fedloom.transforms.base.Chain.dp_events`), as TensorFlow Federated's
DP aggregators carry their event in the aggregator's state. The ledger composes them
(:mod:`fedloom.privacy.accountant`) and says what the round's row and the summary hold.
The round itself knows nothing of which privacy is on: :func:`ledger_for` picks the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fedloom.algorithms import ClientResult
from fedloom.config import ExperimentConfig


@dataclass(frozen=True)
class RoundRelease:
    """One kept round, as a ledger reads it."""

    #: the clients sampled for the round
    sampled: Sequence[int]
    #: the updates the server accepted (their metrics carry a DP-SGD client's ε)
    results: Sequence[ClientResult]
    #: each DP stage's measurements of the round, by transform name (the DP events)
    events: Mapping[str, Mapping[str, Any]]


class Ledger(Protocol):
    """What a run asks of its privacy ledger; a checkpoint keeps :meth:`to_json`."""

    def announce(self, log: logging.Logger) -> None:
        """Say, before the first round, what the run will add and how it was chosen."""

    def record(self, round_: RoundRelease) -> dict[str, Any]:
        """Account a kept round; its entries for the round's row of metrics.jsonl."""

    def unreleased_row(self) -> dict[str, Any]:
        """The entries of a round's row when the round released nothing."""

    def summary(self) -> dict[str, Any]:
        """summary.json's ``privacy`` entry."""

    def warning(self, summary: Mapping[str, Any]) -> str | None:
        """One line when the guarantee in ``summary`` promises little; else None."""

    def to_json(self) -> list[dict[str, Any]]: ...


def ledger_for(
    cfg: ExperimentConfig, rows: Sequence[Mapping[str, Any]] | None = None
) -> Ledger | None:
    """The ledger of ``cfg``'s privacy (None without privacy), restored from a checkpoint's
    ``rows`` when given."""
    from fedloom.privacy import client_level, sample_level  # they import RoundRelease

    if client_level.on(cfg):
        return client_level.Ledger.from_json(cfg, rows or [])
    if sample_level.on(cfg):
        return sample_level.SampleLedger.from_json(cfg, rows or [])
    return None

"""Which splits a client is scored on, by scope (:func:`scored_splits`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedloom.client_mode import DEV_MATCHED, DEV_WEIGHTED
from fedloom.evaluation.dev_weighted import dev_weighted, label_proportions
from fedloom.models.heads import Feature

if TYPE_CHECKING:
    from fedloom.experiment import ClientData, Experiment


def scored_splits(exp: Experiment, client: ClientData) -> dict[str, list[Feature]]:
    """What a client is scored on, by scope: ``clients`` (its test score: its own test
    split, or the dev set weighted to its label mix under ``client_mode = "dev_weighted"``,
    or the dev examples of the client's values of the partition's metadata field under
    ``"dev_matched"``, when its own split is also scored as ``clients_split``) and ``val``.
    Each is scored on its own; an empty one is skipped."""
    if exp.data.client_mode == DEV_MATCHED and client.split is not None:
        return {
            "clients": exp.data.dev_matched(client.split, exp.dev or []),
            "val": client.val,
            "clients_split": client.test,
        }
    if exp.data.client_mode != DEV_WEIGHTED:
        return {"clients": client.test, "val": client.val}
    proportions = label_proportions([f["label"] for f in client.train], exp.task.num_labels)
    label_map = client.split.label_map if client.split is not None else None
    weighted, _ = dev_weighted(exp.dev or [], proportions, label_map)
    return {"clients": weighted, "val": client.val, "clients_split": client.test}

"""What a client's local training sees (:class:`ClientContext`): in a module of its own so
that the local-training step (``fedloom.train``) and the algorithms, which call it, both
import it without importing each other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedloom.config import PrivacyConfig, TrainConfig
from fedloom.models.fedmodel import FedModel
from fedloom.models.heads import Feature


@dataclass
class ClientContext:
    """What a client's local training sees: the shared model, its own data, its
    persistent local state (optimizer moments, personal tensors) and a seed for this round."""

    client_id: int
    model: FedModel
    train: Sequence[Feature]
    settings: TrainConfig
    round: int
    total_rounds: int
    state: dict[str, Any]
    seed: int
    #: in a mixed-backbone federation, the backbone a spanning method measures every client
    #: on (FedMosaic's anchor) and this client's training data encoded for it; None: the
    #: client's own model and data
    anchor: FedModel | None = None
    anchor_train: Sequence[Feature] | None = None
    #: the client's LoRA rank in a mixed-rank federation ([[model.ranks]]); None: the model's
    rank: int | None = None
    #: ``[privacy]`` when it asks for sample-level DP (DP-SGD in local training); None: none
    privacy: PrivacyConfig | None = None
    #: the client's validation split (``partition.val_fraction``, carved from its training
    #: data; a pooled party's: its clients'), for what a method fits on held-out data
    val: Sequence[Feature] = ()

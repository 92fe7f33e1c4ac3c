"""FedRep (Collins, Hassani, Mokhtari & Shakkottai 2021, "Exploiting Shared
Representations for Personalized Federated Learning").

A shared representation (the body: the LoRA factors) and a personal head per client
(``personal = ("head",)``). Round t, client k alternates, each phase with the other part
frozen:

    head phase:  h_k ← τ_h steps on F_k(φ^t, h)   over h only        (φ^t frozen)
    body phase:  φ_k ← τ steps on F_k(φ, h_k)     over φ only        (h_k frozen)
    sends φ_k, keeps h_k;   server:  φ^{t+1} = Σ_k n_k φ_k / Σ_k n_k   (FedAvg over φ)

τ is the usual local budget (``train.local_steps`` / ``train.local_epochs``); τ_h is
``head_epochs`` passes over the client's data. The paper trains the head much longer than
the body (10 head epochs to 1 body epoch in its image experiments); with a frozen backbone
each head step still costs a full forward pass, so the default ``head_epochs = 1.0``
re-fits the small head to the moved body once per round at the cost of doubling a
1-epoch round (a cost choice, not tuned). Each phase keeps its own optimizer moments
(``optimizer_head``, ``optimizer_body`` in the client's state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fedloom.algorithms import sharing
from fedloom.algorithms.base import ClientContext
from fedloom.algorithms.partial import PartialFedAvg
from fedloom.algorithms.registry import register
from fedloom.train.local import train_locally


@register("fedrep")
@dataclass(frozen=True)
class FedRep(PartialFedAvg):
    """FedRep (Collins et al. 2021): train the personal head with the body frozen, then the
    shared body with the head frozen; only the body is aggregated."""

    per_example_client_step: ClassVar[bool] = True

    personal: Sequence[str] = ("head",)
    #: passes over the client's data for the head phase
    head_epochs: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.head_epochs > 0:
            raise ValueError(f"algorithm.head_epochs: must be > 0 (got {self.head_epochs})")

    def head_steps(self, ctx: ClientContext) -> int:
        per_step = ctx.settings.batch_size * ctx.settings.grad_accum
        return max(1, math.ceil(self.head_epochs * len(ctx.train) / per_step))

    def train(self, ctx: ClientContext) -> dict[str, float]:
        """The head phase, then the body phase; the head phase's metrics as ``head_*``."""

        names = ctx.model.param_names
        head = sharing.select(names, self.personal)
        body = [n for n in names if n not in head]
        first = train_locally(
            ctx, only=head, state_key="optimizer_head", steps=self.head_steps(ctx)
        )
        metrics = train_locally(ctx, only=body, state_key="optimizer_body")
        return {**metrics, **{f"head_{k}": v for k, v in first.items()}}

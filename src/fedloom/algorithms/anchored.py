"""A payload that carries a proximal anchor: the client's own adapter plus the point m_k
and strength μ_k of a term (μ_k / 2)‖x − m_k‖² the server wants in its local objective.

Several server-coupled methods reduce their client step to exactly this (MOCHA's
task-relationship term, the mixture ADMM's consensus and dual terms): the server does the
coupling arithmetic and each client runs its ordinary local training plus one proximal
term. The anchor travels under ``anchor/<name>`` and μ_k as ``anchor_mu`` in the same
``Params`` message.
"""

from __future__ import annotations

import torch

from fedloom.algorithms.base import ClientContext, ClientResult
from fedloom.algorithms.fedprox import proximal_term
from fedloom.params import Params
from fedloom.train.local import train_locally

_ANCHOR, _MU = "anchor/", "anchor_mu"


def with_anchor(own: Params, anchor: Params, mu: float) -> Params:
    """The payload: ``own`` adapter, the anchor m_k and μ_k."""
    return {
        **own,
        **{_ANCHOR + n: t for n, t in anchor.items()},
        _MU: torch.tensor(mu, dtype=torch.float64),
    }


def own_part(payload: Params) -> Params:
    """The client's adapter in an anchored payload."""
    return {n: t for n, t in payload.items() if not n.startswith(_ANCHOR) and n != _MU}


def train_towards_anchor(ctx: ClientContext, payload: Params) -> ClientResult:
    """The round's local training of the payload's adapter on f_k + (μ_k / 2)‖x − m_k‖²;
    the result carries the trained adapter."""

    anchor = {n.removeprefix(_ANCHOR): t for n, t in payload.items() if n.startswith(_ANCHOR)}
    mu = float(payload[_MU])
    ctx.model.set_params(own_part(payload))
    named = ctx.model.trainable_parameters()
    extra = (lambda: proximal_term(named, anchor, mu)) if mu > 0 else None
    metrics = train_locally(ctx, extra_loss=extra)
    return ClientResult(
        ctx.client_id, ctx.model.get_params(), len(ctx.train), {**metrics, "anchor_mu": mu}
    )

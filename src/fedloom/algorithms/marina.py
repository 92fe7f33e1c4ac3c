"""MARINA (Gorbunov, Burlachenko, Li & Richtárik 2021, "MARINA: Faster Non-Convex
Distributed Learning with Compression"): the server's gradient estimate is moved by the
clients' compressed gradient differences, and reset to the full mean gradient when a coin
of probability p comes up.

The server keeps g, its estimate of the mean pseudo-gradient at the previous point; client
i keeps Δ_i at that point (in ``ctx.state``). Round t, with x the global adapter and
Δ_i(x) = x − y_i the client's pseudo-gradient after local training
(:mod:`fedloom.algorithms.compressed`):

    server:  c_t ~ Bernoulli(p) (c_0 = 1), sent in the payload as ``marina.full``
    client:  c_t = 1:  sends Δ_i(x) in full (float32 through the identity)
             c_t = 0:  sends C(Δ_i(x) − Δ_i(x_prev))
             keeps Δ_i(x)
    server:  g ← mean Δ_i(x)  if c_t = 1,  else  g ← g + mean C(Δ_i(x) − Δ_i(x_prev))
             x ← x − γ g                                          (γ = ``gamma``)

This is the paper's Algorithm 1 (g⁰ = ∇f(x⁰), x^{k+1} = x^k − γ g^k, then g^{k+1} from
the gradients at x^{k+1}): with one local SGD step at learning rate η_l it is MARINA on
the gradients η_l ∇f_i, step size γ η_l. The coin is the server's, drawn from (``seed``,
round), a pure function of the state's round; both messages are real bytes (the full one
costs the float32 vector, header included).

``p`` defaults to 1/(ω + 1), ω the operator's variance bound on the adapter's d values:
k/d for random-k, the paper's p = ζ_Q/d (the expected density); an operator whose ω
depends on x needs ``p``; p must be in (0, 1]. The operator must be unbiased. The theory
asks for γ ≤ 1 / (1 + √((1 − p) ω / (p n))) in units where ``train.lr`` = 1/L.

MARINA needs every client in every round (a difference only makes sense against the
client's gradient of the previous round): partial participation is refused. A client
that missed the previous round (a fault) sends its difference against the last
pseudo-gradient it computed, and the estimate is off until the next full round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.compressed import (
    Compressed,
    check_fraction,
    flat64,
    refuse_partial,
    server_coin,
    unflat,
    zeros_like,
)
from fedloom.algorithms.registry import register
from fedloom.comm import message
from fedloom.comm.compressors.identity import Identity
from fedloom.params import Params

#: the coin in the payload; the full and the difference messages; the client's last Δ_i
COIN, FULL, DIFF, LAST = "marina.full", "marina.g/", "marina.d/", "marina_g"
_COIN_SALT = 0x3A21


@register("marina")
@dataclass(frozen=True)
class Marina(Compressed):
    #: γ, the server's step along g (in units of the clients' local travel)
    gamma: float = 1.0
    #: the probability of a full round (unset: 1/(ω + 1))
    p: float | None = None
    #: seeds the server's coins
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gamma <= 0:
            raise ValueError(f"algorithm.gamma: must be > 0 (got {self.gamma})")
        check_fraction("p", self.p)

    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        refuse_partial(self.name, clients_per_round, num_clients)

    def check_model(self, params: Params) -> None:
        super().check_model(params)
        self.full_probability(self.dimension(params))

    def full_probability(self, d: int) -> float:
        """p: ``p``, else 1/(ω + 1) for the operator's ω on d values."""
        if self.p is not None:
            return self.p
        return 1.0 / (self.needs_omega("p", d) + 1.0)

    def coin(self, round_: int, d: int) -> bool:
        """Whether round ``round_`` is a full round (always the first)."""
        return round_ == 0 or server_coin(self.seed, round_, self.full_probability(d), _COIN_SALT)

    def init(self, global_params: Params) -> ServerState:
        return ServerState(0, global_params, extra={"g": zeros_like(global_params)})

    def payload(self, state: ServerState, client_id: int) -> Params:
        full = self.coin(state.round, self.dimension(state.global_params))
        return {**state.global_params, COIN: torch.tensor([1.0 if full else 0.0])}

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        full = bool(payload[COIN].item() > 0.5)
        x = {n: t for n, t in payload.items() if n != COIN}
        delta, metrics = self.pseudo_gradient(ctx, x)
        if full:
            wire = message.encode(delta, Identity(), prefix=FULL)
        else:
            last = ctx.state.get(LAST) or zeros_like(delta)
            wire, _ = self.send(ctx, {n: delta[n] - last[n] for n in delta}, DIFF)
        ctx.state[LAST] = delta
        return self.result(ctx, wire, metrics)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        x_params, g_params = state.global_params, state.extra["g"]
        names = sorted(x_params)
        if self.coin(state.round, self.dimension(x_params)):
            g = self.received(results, g_params, FULL, Identity())
        else:
            g = flat64(g_params, names) + self.received(results, g_params, DIFF)
        x_new = flat64(x_params, names) - self.gamma * g
        return self.next_state(
            state,
            global_params=unflat(x_new, x_params),
            extra={**state.extra, "g": unflat(g, g_params)},
        )

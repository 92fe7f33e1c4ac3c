"""DIANA (Mishchenko, Gorbunov, Takáč & Richtárik 2019, "Distributed Learning with
Compressed Gradient Differences"): each client compresses the difference between its
pseudo-gradient and a shift it learns, so the compression error vanishes at the optimum.

Client i keeps a shift h_i (in ``ctx.state``, starting at 0); the server keeps h, the mean
of all the h_i. In a round, with x the global adapter and Δ_i(x) = x − y_i the client's
pseudo-gradient after local training (:mod:`fedloom.algorithms.compressed`):

    client:  m_i = C(Δ_i(x) − h_i)            sent: the operator's bytes of m_i
             h_i ← h_i + α m_i
    server:  ĝ = h + mean_{i∈S} m_i
             h ← h + α (1/N) Σ_{i∈S} m_i       (N = ``num_clients``; unset: N = |S|)
             x ← x − γ ĝ                       (γ = ``gamma``)

With one local SGD step at learning rate η_l this is the paper's Algorithm 1 (full
gradients, no momentum, no regularizer) on the gradients η_l ∇f_i, i.e. step size γ η_l. Its plain
compressed gradient descent (h = 0) reaches only a neighbourhood of the optimum when the
clients' gradients differ there; the learned shifts h_i → ∇f_i(x*) remove that floor.

``alpha`` defaults to 1/(ω + 1), ω the operator's variance bound on the d values of the
adapter (E‖C(x) − x‖² ≤ ω‖x‖²): an operator whose ω depends on x (TernGrad) needs
``alpha``; α must be in (0, 1]. The operator must be unbiased (``compressor``:
``randk``, ``qsgd``, ``natural``, ``terngrad``, ``ps_quant``, ``identity``). ``gamma``
(1.0: FedAvg with the identity) is the server's step in units of the local travel; the
theory asks for γ ≤ 1 / (1 + 2ω/n) in units where ``train.lr`` = 1/L.

Partial participation: the sampled clients update their shifts, and h keeps the mean of
all N shifts by the 1/N step; ĝ stays an unbiased estimate of the mean pseudo-gradient.
Set ``num_clients`` = N (``partition.num_clients``) when fewer than all clients are
sampled; it is refused unset then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.compressed import (
    Compressed,
    check_fraction,
    check_share,
    flat64,
    unflat,
    zeros_like,
)
from fedloom.algorithms.registry import register
from fedloom.params import Params

#: the message's name prefix, and the client's shift in its state
M, SHIFT = "diana.m/", "diana_h"


@register("diana")
@dataclass(frozen=True)
class Diana(Compressed):
    #: γ, the server's step along ĝ (in units of the clients' local travel)
    gamma: float = 1.0
    #: α, the shifts' step (unset: 1/(ω + 1))
    alpha: float | None = None
    #: N, the number of clients (unset: every client takes part in every round)
    num_clients: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gamma <= 0:
            raise ValueError(f"algorithm.gamma: must be > 0 (got {self.gamma})")
        check_fraction("alpha", self.alpha)
        if self.num_clients is not None and self.num_clients < 1:
            raise ValueError(f"algorithm.num_clients: must be >= 1 (got {self.num_clients})")

    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        check_share(self.name, self.num_clients, clients_per_round, num_clients)

    def check_model(self, params: Params) -> None:
        super().check_model(params)
        self.shift_step(self.dimension(params))

    def shift_step(self, d: int) -> float:
        """α: ``alpha``, else 1/(ω + 1) for the operator's ω on d values."""
        if self.alpha is not None:
            return self.alpha
        return 1.0 / (self.needs_omega("alpha", d) + 1.0)

    def init(self, global_params: Params) -> ServerState:
        return ServerState(0, global_params, extra={"h": zeros_like(global_params)})

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        delta, metrics = self.pseudo_gradient(ctx, payload)
        alpha = self.shift_step(self.dimension(delta))
        return self.result(ctx, self.send_shifted(ctx, delta, M, SHIFT, alpha), metrics)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        x_params, h_params = state.global_params, state.extra["h"]
        names = sorted(x_params)
        mean_m = self.received(results, h_params, M)
        h = flat64(h_params, names)
        g_hat = h + mean_m
        share = 1.0 if self.num_clients is None else len(results) / self.num_clients
        h_new = h + self.shift_step(h.numel()) * share * mean_m
        x_new = flat64(x_params, names) - self.gamma * g_hat
        return self.next_state(
            state,
            global_params=unflat(x_new, x_params),
            extra={**state.extra, "h": unflat(h_new, h_params)},
        )

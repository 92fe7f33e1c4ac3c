"""EF21 (Richtárik, Sokolov & Fatkhullin 2021, "EF21: A New, Simpler, Theoretically
Better, and Practically Faster Error Feedback"): each client keeps a gradient estimate and
sends the compressed difference to its new pseudo-gradient; works with biased
(contractive) operators such as top-k.

Client i keeps g_i (in ``ctx.state``, starting at 0); the server keeps g, the mean of all
the g_i. In a round, with x the global adapter and Δ_i(x) = x − y_i the client's
pseudo-gradient after local training (:mod:`fedloom.algorithms.compressed`):

    client:  c_i = C(Δ_i(x) − g_i)            sent: the operator's bytes of c_i
             g_i ← g_i + c_i
    server:  g ← g + (1/N) Σ_{i∈S} c_i         (N = ``num_clients``; unset: N = |S|)
             x ← x − γ g                       (γ = ``gamma``)

This is the paper's Algorithm 1 (x^{t+1} = x^t − γ g^t, then c_i^t = C(∇f_i(x^{t+1}) −
g_i^t)) started from g_i⁰ = C(∇f_i(x⁰)): the first round's message, against g_i = 0, is
C(Δ_i(x⁰)), which sets g_i⁰ and g⁰ before the first step. With one local SGD step at
learning rate η_l it is EF21 on the gradients η_l ∇f_i, step size γ η_l.

The operator C must be contractive (E‖C(x) − x‖² ≤ (1 − a)‖x‖², a ∈ (0, 1]): a biased
operator (``topk``, ``sign``, ``powersgd``, ``fp16``, ``bf16``) is used as it is; an
unbiased one of variance ω (``randk``, ``qsgd``, ...) is used scaled, C/(ω + 1), which is
contractive with a = 1/(ω + 1) (random-k then keeps its k values unscaled); an unbiased
operator whose ω depends on x is refused. The theory's step is γ ≤ 1/(L + L̃ √(β/θ)),
θ = 1 − √(1 − a), β = (1 − a)/(1 − √(1 − a)).

Partial participation is EF21-PP (Fatkhullin, Sokolov, Gorbunov, Li & Richtárik 2021,
"EF21 with Bells & Whistles"): only the sampled clients update their g_i, and the 1/N
step keeps g the mean of all N; set ``num_clients`` = N (``partition.num_clients``)
when fewer than all clients are sampled (refused unset then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fedloom.algorithms.base import ClientContext, ClientResult, ServerState
from fedloom.algorithms.compressed import Compressed, check_share, flat64, unflat, zeros_like
from fedloom.algorithms.registry import register
from fedloom.params import Params

#: the message's name prefix, and the client's estimate in its state
C, ESTIMATE = "ef21.c/", "ef21_g"


@register("ef21")
@dataclass(frozen=True)
class EF21(Compressed):
    needs_unbiased: ClassVar[bool] = False

    #: γ, the server's step along g (in units of the clients' local travel)
    gamma: float = 1.0
    #: N, the number of clients (unset: every client takes part in every round)
    num_clients: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gamma <= 0:
            raise ValueError(f"algorithm.gamma: must be > 0 (got {self.gamma})")
        if self.num_clients is not None and self.num_clients < 1:
            raise ValueError(f"algorithm.num_clients: must be >= 1 (got {self.num_clients})")

    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        check_share(self.name, self.num_clients, clients_per_round, num_clients)

    def check_model(self, params: Params) -> None:
        super().check_model(params)
        self.scale(self.dimension(params))

    def scale(self, d: int) -> float:
        """The factor that makes the operator contractive: 1/(ω + 1) for an unbiased one
        (ω on d values), 1 for a biased one."""
        if not self.operator.unbiased:
            return 1.0
        omega = self.omega(d)
        if omega is None:
            raise ValueError(
                f"algorithm.compressor: ef21 uses an unbiased operator scaled by 1/(ω + 1), "
                f"and the ω of {self.operator.name} depends on the values compressed; use a "
                f"contractive operator (topk) or one of fixed ω (randk, qsgd, natural)"
            )
        return 1.0 / (omega + 1.0)

    def init(self, global_params: Params) -> ServerState:
        return ServerState(0, global_params, extra={"g": zeros_like(global_params)})

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        delta, metrics = self.pseudo_gradient(ctx, payload)
        scale = self.scale(self.dimension(delta))
        return self.result(ctx, self.send_shifted(ctx, delta, C, ESTIMATE, scale), metrics)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        x_params, g_params = state.global_params, state.extra["g"]
        names = sorted(x_params)
        share = 1.0 if self.num_clients is None else len(results) / self.num_clients
        mean_c = self.received(results, g_params, C) * self.scale(self.dimension(x_params))
        g = flat64(g_params, names) + share * mean_c
        x_new = flat64(x_params, names) - self.gamma * g
        return self.next_state(
            state,
            global_params=unflat(x_new, x_params),
            extra={**state.extra, "g": unflat(g, g_params)},
        )

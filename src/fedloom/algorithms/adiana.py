"""ADIANA (Li, Kovalev, Qian & Richtárik 2020, "Acceleration for Compressed Gradient
Descent in Distributed and Federated Optimization"): DIANA's compressed, shifted gradients
inside a Katyusha-style accelerated method, two compressed messages per client a round.

The server keeps the sequences y (the global adapter, what is scored and checkpointed), z,
w, the next query point x, and h, the mean of the clients' shifts; client i keeps its shift
h_i (in ``ctx.state``, starting at 0). Round k, with Δ_i(v) = v − y_i the client's
pseudo-gradient after local training from v (:mod:`fedloom.algorithms.compressed`):

    payload: x^k = θ1 z^k + θ2 w^k + (1 − θ1 − θ2) y^k   and  w^k
    client:  m_i = C(Δ_i(x^k) − h_i)                     sent
             h̃_i = C'(Δ_i(w^k) − h_i)                    sent (an independent draw)
             h_i ← h_i + α h̃_i
    server:  g = h + mean m_i,   h ← h + α mean h̃_i
             y^{k+1} = x^k − η g
             z^{k+1} = β z^k + (1 − β) x^k + (γ/η)(y^{k+1} − x^k)
             w^{k+1} = y^k with probability p, else w^k   (the server's coin, from
                                                          ``seed`` and the round)

This is the paper's Algorithm 2 (ψ = 0, x⁰ = y⁰ = z⁰ = w⁰, h_i⁰ = 0): with one local
SGD step at learning rate η_l it is ADIANA on the gradients η_l ∇f_i, with the paper's
η and γ the ones here times η_l and its μ the one here divided by η_l. Each client trains
twice a round (from x^k and from w^k; the second keeps its optimizer state apart) and
sends two messages, and the payload carries both x^k and w^k: twice DIANA's compute and
traffic per round, for fewer rounds on ill-conditioned problems.

Defaults: the paper's parameter choice for L-smooth, μ-strongly convex f, in units where
``train.lr`` = 1/L (L = 1): α = 1/(1 + ω) (ω the operator's variance bound on the
adapter's d values), θ2 = 1/2, p = min{1, max{1, √(n/(32ω)) − 1} / (2(1 + ω))} (1 for
ω = 0; n the clients of the round), θ1 = min{1/4, √(ημ/p)}, γ = η/(2(θ1 + ημ)),
β = 1 − γμ, and η = 1/(2L) = 0.5, the bound without compression (with much compression
relative to n the theory asks for a smaller η: set ``eta``). ``mu`` (μ in the same units,
μ/L; 0 by default) is rarely known: with μ = 0, θ1 = 1/4, γ = 2η and β = 1, which
converges on the tests' quadratics but is not accelerated; a good estimate of μ/L is what
buys the acceleration. Setting a parameter overrides its formula. The operator must be
unbiased, and ADIANA needs every client in every round (partial participation is
refused).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

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
from fedloom.params import Params

#: the payload's w; the two messages; the client's shift
W, M, H, SHIFT = "adiana.w/", "adiana.m/", "adiana.h/", "adiana_h"
_COIN_SALT = 0xAD1A


class Parameters(NamedTuple):
    """ADIANA's parameters, resolved for a round (the defaults' formulas applied)."""

    eta: float
    theta_1: float
    theta_2: float
    alpha: float
    beta: float
    gamma: float
    p: float


@register("adiana")
@dataclass(frozen=True)
class Adiana(Compressed):
    #: η, the gradient step of y (1/(2L) with L = 1)
    eta: float = 0.5
    #: μ, the strong convexity in the same units (μ/L); 0: not assumed
    mu: float = 0.0
    #: θ1 (unset: min{1/4, √(ημ/p)}, 1/4 with μ = 0)
    theta_1: float | None = None
    #: θ2
    theta_2: float = 0.5
    #: α, the shifts' step (unset: 1/(1 + ω))
    alpha: float | None = None
    #: β (unset: 1 − γμ)
    beta: float | None = None
    #: γ, the step of z (unset: η/(2(θ1 + ημ)))
    gamma: float | None = None
    #: the probability that w is moved to y (unset: the paper's formula)
    p: float | None = None
    #: seeds the server's coins
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eta <= 0:
            raise ValueError(f"algorithm.eta: must be > 0 (got {self.eta})")
        if self.mu < 0:
            raise ValueError(f"algorithm.mu: must be >= 0 (got {self.mu})")
        check_fraction("theta_1", self.theta_1)
        check_fraction("theta_2", self.theta_2, closed_zero=True)
        if self.theta_1 is not None and self.theta_1 + self.theta_2 > 1.0:
            raise ValueError(
                f"algorithm.theta_1: θ1 + θ2 must be <= 1 (got {self.theta_1} + {self.theta_2})"
            )
        if self.theta_2 > 0.75 and self.theta_1 is None:
            raise ValueError(
                f"algorithm.theta_2: θ1 + θ2 must be <= 1, and θ1 defaults up to 1/4 "
                f"(got θ2 = {self.theta_2}); set theta_1 too"
            )
        check_fraction("alpha", self.alpha)
        check_fraction("beta", self.beta, closed_zero=True)
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"algorithm.gamma: must be > 0 (got {self.gamma})")
        check_fraction("p", self.p)

    def check_federation(self, clients_per_round: int, num_clients: int) -> None:
        refuse_partial(self.name, clients_per_round, num_clients)

    def check_model(self, params: Params) -> None:
        super().check_model(params)
        self.parameters(self.dimension(params), 1)

    def parameters(self, d: int, n: int) -> Parameters:
        """The round's parameters for messages of d values from n clients."""
        eta, mu = self.eta, self.mu
        omega: float | None = None
        if self.alpha is None or self.p is None:
            omega = self.needs_omega("alpha" if self.alpha is None else "p", d)
        alpha = self.alpha if self.alpha is not None else 1.0 / (1.0 + (omega or 0.0))
        if self.p is not None:
            p = self.p
        elif not omega:
            p = 1.0
        else:
            p = min(1.0, max(1.0, math.sqrt(n / (32.0 * omega)) - 1.0) / (2.0 * (1.0 + omega)))
        if self.theta_1 is not None:
            theta_1 = self.theta_1
        else:
            theta_1 = min(0.25, math.sqrt(eta * mu / p)) if mu > 0 else 0.25
        gamma = self.gamma if self.gamma is not None else eta / (2.0 * (theta_1 + eta * mu))
        beta = self.beta if self.beta is not None else 1.0 - gamma * mu
        if not 0.0 <= beta <= 1.0:
            raise ValueError(
                f"algorithm.mu: β = 1 − γμ = {beta:.4g} is outside [0, 1] (γ = {gamma:.4g}, "
                f"μ = {mu}); lower mu or set beta"
            )
        return Parameters(eta, theta_1, self.theta_2, alpha, beta, gamma, p)

    def moves_w(self, round_: int, p: float) -> bool:
        """The server's coin of round ``round_``: w^{k+1} = y^k (probability p)."""
        return server_coin(self.seed, round_, p, _COIN_SALT)

    def init(self, global_params: Params) -> ServerState:
        copies = {key: dict(global_params) for key in ("x", "z", "w")}
        return ServerState(0, global_params, extra={**copies, "h": zeros_like(global_params)})

    def payload(self, state: ServerState, client_id: int) -> Params:
        w = state.extra["w"]
        return {**state.extra["x"], **{W + n: t for n, t in w.items()}}

    def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
        x = {n: t for n, t in payload.items() if not n.startswith(W)}
        w = {n[len(W) :]: t for n, t in payload.items() if n.startswith(W)}
        delta_x, metrics = self.pseudo_gradient(ctx, x)
        delta_w, metrics_w = self.pseudo_gradient(ctx, w, state_key="optimizer_w")
        h_i = ctx.state.get(SHIFT) or zeros_like(delta_x)
        wire_m, _ = self.send(ctx, {n: delta_x[n] - h_i[n] for n in x}, M, stream=0)
        wire_h, h_tilde = self.send(ctx, {n: delta_w[n] - h_i[n] for n in x}, H, stream=1)
        alpha = self.parameters(self.dimension(delta_x), 1).alpha
        ctx.state[SHIFT] = {n: h_i[n] + alpha * h_tilde[n] for n in x}
        metrics = {
            **metrics,
            "train_loss_w": metrics_w.get("train_loss", math.nan),
            "local_steps": metrics.get("local_steps", 0.0) + metrics_w.get("local_steps", 0.0),
        }
        return self.result(ctx, {**wire_m, **wire_h}, metrics)

    def aggregate(self, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        y_params, extra = state.global_params, state.extra
        h_params = extra["h"]
        names = sorted(y_params)
        a = self.parameters(self.dimension(y_params), len(results))
        h = flat64(h_params, names)
        g = h + self.received(results, h_params, M)
        h_new = h + a.alpha * self.received(results, h_params, H)
        x, y = flat64(extra["x"], names), flat64(y_params, names)
        z, w = flat64(extra["z"], names), flat64(extra["w"], names)
        y_new = x - a.eta * g
        z_new = a.beta * z + (1.0 - a.beta) * x + (a.gamma / a.eta) * (y_new - x)
        w_new = y if self.moves_w(state.round, a.p) else w
        x_new = a.theta_1 * z_new + a.theta_2 * w_new + (1.0 - a.theta_1 - a.theta_2) * y_new
        return self.next_state(
            state,
            global_params=unflat(y_new, y_params),
            extra={
                **extra,
                "x": unflat(x_new, y_params),
                "z": unflat(z_new, y_params),
                "w": unflat(w_new, y_params),
                "h": unflat(h_new, h_params),
            },
        )

"""What the algorithms built on compression share (DIANA, ADIANA, MARINA, EF21).

Their papers are stated for gradients; fedloom's clients train locally. The federated form
used by all four: a client that receives x trains from it as every method does
(``train_locally``: ``train.local_steps`` steps of ``train.optimizer``) to y_i and takes
as its "gradient" the pseudo-gradient

    Δ_i(x) = x − y_i,

the raw model delta, which the server steps along with a step size of its own, as FedOpt
does. With one local step of plain SGD at learning rate η_l, Δ_i(x) = η_l ∇f_i(x)
exactly, and every method here is then its paper's algorithm run on the gradient oracle
η_l ∇f_i: the papers' step sizes are the server's step sizes times η_l (and a strong
convexity μ in these units is the paper's μ times η_l). With ``train.lr = 1/L`` the units
are the papers' with L = 1. With the identity operator and a server step of 1, DIANA,
MARINA and EF21 are FedAvg (uniform weights).

What travels is the operator's encoding (:mod:`fedloom.comm.message`: the tensors as one
vector, a ``uint8`` tensor named ``<method>.<message>/wire/flat``), so ``bytes_up``
counts the real bytes; the server decodes it against its own tensors of the same names.
The operator's randomness comes from a generator seeded by (the round's client seed, the
round, the client, the message): a run is reproducible, and the client reconstructs
exactly what the server decodes. Client state (shifts, last gradients) lives in
``ctx.state`` as tensors, in the client's checkpoint; the server's in ``ServerState.extra``.
These methods have no personal tensors: every tensor of the adapter is compressed and sent.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.algorithms.base import Algorithm, ClientContext, ClientResult
from fedloom.comm import message
from fedloom.comm.compressors import Compressor
from fedloom.comm.settings import CompressionSettings
from fedloom.params import Params, unflatten
from fedloom.train.local import train_locally

#: keeps the operators' random draws apart from the run's other seeded streams
SALT = 0xD1A7A


def message_generator(seed: int, client_id: int, round_: int, stream: int = 0) -> torch.Generator:
    """The generator of the operator for client ``client_id``'s message ``stream`` (ADIANA
    sends two) in round ``round_``, its context's ``seed`` given."""
    key = [seed, round_, client_id + 1, stream, SALT]
    return torch.Generator().manual_seed(int(np.random.default_rng(key).integers(2**63 - 1)))


def server_coin(seed: int, round_: int, p: float, salt: int) -> bool:
    """A Bernoulli(p) draw of the server's, from (``seed``, ``round_``): reproducible, and a
    pure function of the state's round (so checkpoint/resume is exact)."""
    return bool(np.random.default_rng([seed, round_, salt, SALT]).random() < p)


def state_dtype(t: torch.Tensor) -> torch.dtype:
    """What the methods' states and messages are kept in: float64 for a float64 model (the
    closed-form tests), float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def flat64(params: Params, names: Sequence[str]) -> torch.Tensor:
    """The tensors ``names`` as one float64 vector on the CPU (``params.flatten`` rounds to
    float32 first)."""
    return torch.cat([params[n].detach().reshape(-1).to("cpu", torch.float64) for n in names])


def zeros_like(params: Params) -> Params:
    return {n: torch.zeros(t.shape, dtype=state_dtype(t)) for n, t in params.items()}


@functools.lru_cache(maxsize=64)
def _omega(compressor: Compressor, d: int) -> float | None:
    """ω of ``compressor`` on vectors of ``d`` values when it does not depend on the vector
    (probed on two different vectors), else None; None for a biased operator."""
    if not compressor.unbiased or compressor.matrix or d < 1:
        return None
    probes = (
        torch.ones(d),
        torch.randn(d, generator=torch.Generator().manual_seed(SALT)),
    )
    values = [compressor.omega(x) for x in probes]
    if values[0] is None or values[1] is None:
        return None
    if not np.isclose(values[0], values[1], rtol=1e-9, atol=0.0):
        return None
    return float(values[0])


def refuse_partial(name: str, clients_per_round: int, num_clients: int) -> None:
    """A method whose server step needs every client's message in every round."""
    if clients_per_round < num_clients:
        raise ValueError(
            f"federation.clients_per_round: {name} needs every client in every round (the "
            f"federation samples {clients_per_round} of its {num_clients} clients); set "
            f"federation.fraction = 1.0"
        )


def check_share(name: str, mine: int | None, clients_per_round: int, num_clients: int) -> None:
    """DIANA's and EF21's ``num_clients`` (N in the server's 1/N) against the federation."""
    if mine is not None and mine != num_clients:
        raise ValueError(
            f"algorithm.num_clients: {mine}, but the federation has {num_clients} clients "
            f"(partition.num_clients); leave it unset when every client takes part in "
            f"every round"
        )
    if mine is None and clients_per_round < num_clients:
        raise ValueError(
            f"algorithm.num_clients: {name} with partial participation ({clients_per_round} "
            f"of {num_clients} clients a round) keeps the server's state the mean over all "
            f"N clients, so it needs N: set algorithm.num_clients = {num_clients}"
        )


def check_fraction(key: str, value: float | None, closed_zero: bool = False) -> None:
    """``value`` in (0, 1] ([0, 1] with ``closed_zero``), when set."""
    if value is None:
        return
    low_ok = value >= 0.0 if closed_zero else value > 0.0
    if not (low_ok and value <= 1.0):
        interval = "[0, 1]" if closed_zero else "(0, 1]"
        raise ValueError(f"algorithm.{key}: must be in {interval} (got {value})")


@dataclass(frozen=True)
class Compressed(CompressionSettings, Algorithm):
    """Base of DIANA, ADIANA, MARINA and EF21 (not registered itself): the operator of the
    ``compressor`` settings, the client's pseudo-gradient, and the messages."""

    #: the method's analysis needs E[C(x)] = x (DIANA, ADIANA, MARINA); EF21 takes any
    needs_unbiased: ClassVar[bool] = True
    sends = "encoded"

    def __post_init__(self) -> None:
        op = self.operator
        if self.needs_unbiased and not op.unbiased:
            raise ValueError(
                f"algorithm.compressor: {self.name} needs an unbiased operator "
                f"(E[C(x)] = x, a variance bound ω), and {op.name} is biased; use ef21 for "
                f"biased (contractive) operators such as topk"
            )

    @functools.cached_property
    def operator(self) -> Compressor:
        """The operator C of the ``compressor`` settings (a mistake names ``algorithm.<key>``)."""
        try:
            return self.build_compressor()
        except ValueError as err:
            raise ValueError(f"algorithm.{err}") from None

    def omega(self, d: int) -> float | None:
        """The operator's ω on the d values a message carries, when it does not depend on
        the values; None otherwise (biased, or x-dependent like TernGrad's)."""
        return _omega(self.operator, d)

    def needs_omega(self, key: str, d: int) -> float:
        """ω for a default that is computed from it (``key`` names the hyperparameter to set
        instead)."""
        omega = self.omega(d)
        if omega is None:
            raise ValueError(
                f"algorithm.{key}: its default comes from the operator's ω, and the ω of "
                f"{self.operator.name} depends on the values compressed; set {key}"
            )
        return omega

    def check_model(self, params: Params) -> None:
        """k ≤ d, a rank that compresses a matrix: the operator's limits on one message
        (every tensor)."""
        try:
            message.check(params, sorted(params), self.operator)
        except ValueError as err:
            raise ValueError(f"algorithm.{err}") from None

    @staticmethod
    def dimension(params: Params) -> int:
        return sum(t.numel() for t in params.values())

    # --- the client ---------------------------------------------------------------------
    @staticmethod
    def pseudo_gradient(
        ctx: ClientContext, x: Params, state_key: str = "optimizer"
    ) -> tuple[Params, dict[str, float]]:
        """Δ_i(x) = x − y_i after local training from ``x`` (on the CPU, in the state's
        dtype), and the training's metrics."""
        ctx.model.set_params(x)
        metrics = train_locally(ctx, state_key=state_key)
        y = ctx.model.get_params()
        delta = {}
        for n, t in x.items():
            dtype = state_dtype(t)
            delta[n] = t.detach().to("cpu", dtype) - y[n].detach().to("cpu", dtype)
        return delta, metrics

    def send(
        self,
        ctx: ClientContext,
        values: Params,
        prefix: str,
        stream: int = 0,
        operator: Compressor | None = None,
    ) -> tuple[Params, Params]:
        """``values`` encoded under ``prefix`` (what travels) and what the server decodes
        from it (in ``values``' dtypes)."""
        op = operator or self.operator
        generator = message_generator(ctx.seed, ctx.client_id, ctx.round, stream)
        encoder = ctx.state.setdefault(f"{self.name}_encoder", {}) if op.matrix else None
        wire = message.encode(values, op, generator, encoder, prefix)
        return wire, message.decode(wire, values, op, prefix)

    def send_shifted(
        self, ctx: ClientContext, delta: Params, prefix: str, key: str, step: float
    ) -> Params:
        """DIANA's and EF21's client step: with v the vector the client keeps in
        ``ctx.state[key]`` (0 at first), send m = C(Δ − v) and move v ← v + step · m;
        returns what travels."""
        kept = ctx.state.get(key) or zeros_like(delta)
        wire, m = self.send(ctx, {n: delta[n] - kept[n] for n in delta}, prefix)
        ctx.state[key] = {n: kept[n] + step * m[n] for n in delta}
        return wire

    @staticmethod
    def result(ctx: ClientContext, wire: Params, metrics: dict[str, Any]) -> ClientResult:
        return ClientResult(ctx.client_id, wire, len(ctx.train), metrics)

    # --- the server ---------------------------------------------------------------------
    def received(
        self,
        results: Sequence[ClientResult],
        like: Params,
        prefix: str,
        operator: Compressor | None = None,
    ) -> torch.Tensor:
        """The mean over ``results`` of their decoded ``prefix`` messages, as one float64
        vector over ``sorted(like)``."""
        if not results:
            raise ValueError("aggregate of no clients")
        op = operator or self.operator
        names = sorted(like)
        total = torch.zeros(sum(like[n].numel() for n in names), dtype=torch.float64)
        for r in results:
            try:
                total += flat64(message.decode(r.params, like, op, prefix), names)
            except KeyError:
                raise ValueError(
                    f"client {r.client_id}: no {prefix}{message.FLAT} message "
                    f"(sent {sorted(r.params)[:3]})"
                ) from None
        return total / len(results)


def unflat(vector: torch.Tensor, like: Params) -> Params:
    """``vector`` (over ``sorted(like)``) as tensors shaped and typed like ``like``'s."""
    return unflatten(vector, like, sorted(like))

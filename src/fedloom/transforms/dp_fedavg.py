"""Client-level differential privacy, DP-FedAvg's clip stage (McMahan et al. 2018,
"Learning Differentially Private Recurrent Language Models", Algorithm 1; adaptive clipping
from Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping").

Each client's shared update Δ_k = θ_k − θ (over the tensors it was sent) is clipped to
‖Δ_k‖₂ ≤ C; the aggregate is θ + (Σ_k clip(Δ_k) + ξ) / m with ξ ~ N(0, σ²I), σ = z·C,
over the m clients that reported. The server step of every averaging algorithm is a
function of that uniform mean (FedAvg's θ_{t+1}, FedAdam's pseudo-gradient, Ditto's and
the partial methods' global part), so fedloom adds ξ to the updates before the
aggregation sees them, split as N(0, σ²/m) on each of the m updates: their sum carries
exactly N(0, σ²). ``privacy.level = "client"`` makes the aggregation a uniform mean
(:func:`fedloom.privacy.client_level.uniform`).

* ``noise = "server"`` (a trusted server, as Flower's ``DifferentialPrivacy*Clipping``
  wrappers): the clients clip (Flower's ``ClientSideFixedClipping``), the server clips
  again (``ServerSideFixedClipping``: an update that was not clipped is clipped here) and
  adds ξ.
* ``noise = "client"`` (distributed noise, for secure aggregation): each client adds its
  share N(0, σ²/m̄), m̄ the clients sampled per round, in the noise stage
  (:mod:`fedloom.transforms.client_noise`); the server only measures. A client that drops
  out takes its share with it: the round's effective multiplier is z·√(m/m̄), and that is
  what the accountant composes.
* adaptive clipping (``adaptive_quantile`` γ, server noise only; the clients would need
  the round's C): the server clips to C_t, counts the clients with ‖Δ_k‖ ≤ C_t, adds
  N(0, σ_b²) to the count (σ_b = m̄/20 by default, Andrew et al.'s choice) and sets
  C_{t+1} = C_t · exp(−η (b̃ − γ)), b̃ the noised fraction (the geometric update). The
  updates' noise multiplier is z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), so that the pair of releases
  is as private as one Gaussian with multiplier z (Andrew et al., Theorem 1): the
  accountant composes z.

How fedloom differs from Flower's wrappers: Flower counts the *clipped* updates and moves C
by exp(−η (clipped fraction − γ)), which shrinks C when too many are clipped (the paper
counts the unclipped ones; tensorflow_privacy's quantile estimator does too); Flower noises
with the C after that update rather than the one it clipped to; and it adds σ/m to
whatever its inner strategy returns, a mean weighted by examples, whose sensitivity can
exceed C/m. fedloom follows the paper on all three. Per-client train losses and example
counts still reach the server in the clear (they are not part of the guarantee).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from fedloom.params import Params
from fedloom.transforms.base import Served, Stage, Transform
from fedloom.transforms.clip_update import clip_delta, shared_names
from fedloom.transforms.gaussian import add_noise, noise_generator

#: salts that keep the server's update noise and count noise apart from other streams
UPDATE_NOISE_SALT, COUNT_NOISE_SALT = 0xD9F1, 0xD9C7


def uncovered(update: Params, payload: Params) -> list[str]:
    """Tensors ``update`` sends that DP-FedAvg cannot clip: floating-point ones the payload
    did not hold (no reference point, so no Δ)."""
    return [n for n in update if update[n].is_floating_point() and n not in payload]


def update_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """z_Δ of Andrew et al.'s Theorem 1: (z⁻² − (2σ_b)⁻²)^(−1/2) (0 for z = 0)."""
    if noise_multiplier == 0:
        return 0.0
    if noise_multiplier >= 2 * count_noise:
        raise ValueError(
            f"noise_multiplier: {noise_multiplier} needs count noise above "
            f"{noise_multiplier / 2:g} for adaptive clipping (privacy.count_noise is "
            f"{count_noise:g}; the default is the clients per round / 20)"
        )
    return float((noise_multiplier**-2 - (2 * count_noise) ** -2) ** -0.5)


@dataclass(frozen=True)
class DPFedAvg(Transform):
    name: ClassVar[str] = "dp_fedavg"
    stage: ClassVar[Stage] = "clip"
    releases_dp_event: ClassVar[bool] = True
    needs_a_mean: ClassVar[bool] = True
    bounds_norm: ClassVar[bool] = True
    #: z: the noise on the sum of the clipped updates is N(0, (zC)²)
    noise_multiplier: float
    #: C (the first round's with adaptive clipping)
    clip_norm: float
    #: m̄, the clients sampled per round (client-side noise is split among them)
    clients_per_round: int
    #: where the noise is added
    noise: Literal["server", "client"] = "server"
    #: γ, the target fraction of unclipped updates (None: fixed clipping)
    adaptive_quantile: float | None = None
    #: η, the geometric step of adaptive clipping
    adaptive_lr: float = 0.2
    #: σ_b, the std of the noise on the count of unclipped updates (None: m̄ / 20)
    count_noise: float | None = None
    seed: int = 0
    secure_noise: bool = False

    @property
    def needs_each_update(self) -> bool:
        """With server-side noise the server clips each client's update again."""
        return self.noise == "server"

    @property
    def adaptive(self) -> bool:
        return self.adaptive_quantile is not None

    @property
    def count_std(self) -> float:
        """σ_b: ``count_noise``, else m̄ / 20 (none without noise: z = 0 promises nothing)."""
        if self.count_noise is not None:
            return self.count_noise
        return self.clients_per_round / 20 if self.noise_multiplier > 0 else 0.0

    @property
    def update_noise_multiplier(self) -> float:
        """The multiplier of the updates' noise (z, or z_Δ with adaptive clipping)."""
        if not self.adaptive:
            return self.noise_multiplier
        return update_multiplier(self.noise_multiplier, self.count_std)

    def up(
        self,
        update: Params,
        payload: Params,
        client_id: int,
        round_: int,
        state: dict[str, Any],
    ) -> Params:
        if extra := uncovered(update, payload):
            raise ValueError(
                f"privacy: the update carries {extra[0]!r}, which DP-FedAvg cannot clip"
            )
        if self.adaptive:  # the server clips, to the round's norm
            return update
        return clip_delta(update, payload, self.clip_norm)[0]

    def init_state(self) -> Mapping[str, Any]:
        return {"clip_norm": self.clip_norm}

    def server(
        self,
        updates: dict[int, Params],
        payloads: dict[int, Params],
        round_: int,
        state: Mapping[str, Any],
    ) -> Served:
        clip_norm = float(state["clip_norm"])
        m = len(updates)
        if m == 0:
            return Served(updates, state)
        z = self.update_noise_multiplier
        if self.noise == "client":
            # the clients clipped and noised; the shares of those missing are missing
            share = math.sqrt(m / self.clients_per_round)
            return Served(
                updates,
                state,
                {
                    "clip_norm": clip_norm,
                    "noise_std": z * clip_norm * share,
                    "noise_multiplier": self.noise_multiplier * share,
                    "clients": m,
                },
            )
        out: dict[int, Params] = {}
        unclipped = 0
        for cid in sorted(updates):
            if extra := uncovered(updates[cid], payloads[cid]):
                raise ValueError(
                    f"privacy: client {cid}'s update carries {extra[0]!r}, which DP-FedAvg cannot clip"
                )
            clipped, norm = clip_delta(updates[cid], payloads[cid], clip_norm)
            unclipped += norm <= clip_norm
            std = z * clip_norm / math.sqrt(m)  # m shares of N(0, σ²)
            g = noise_generator(self.seed, round_, cid, UPDATE_NOISE_SALT, self.secure_noise)
            out[cid] = add_noise(clipped, shared_names(clipped, payloads[cid]), std, g)
        measurements: dict[str, Any] = {
            "clip_norm": clip_norm,
            "noise_std": z * clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "clients": m,
        }
        if not self.adaptive:
            return Served(out, state, measurements)
        assert self.adaptive_quantile is not None
        g = noise_generator(self.seed, round_, -1, COUNT_NOISE_SALT, self.secure_noise)
        noise = float(torch.randn((), generator=g, dtype=torch.float64))
        noised = (unclipped + self.count_std * noise) / m
        new_norm = clip_norm * math.exp(-self.adaptive_lr * (noised - self.adaptive_quantile))
        measurements["unclipped_fraction"] = noised
        return Served(out, {"clip_norm": new_norm}, measurements)

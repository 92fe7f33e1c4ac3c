"""Distributed Gaussian noise: each client adds its share N(0, σ²/m̄) to its (clipped)
shared update before it leaves, so that the sum of the m̄ sampled clients' updates carries
N(0, σ²) and no party, the server included, ever holds an update without noise: the
noise stage of DP-FedAvg with ``privacy.noise = "client"``, meant to run under secure
aggregation (its mask stage comes after this one). The clip stage
(:mod:`fedloom.transforms.dp_fedavg`) clips first and, on the server, accounts the round
with the shares that arrived.

Continuous Gaussian shares, as Flower's and TensorFlow Federated's distributed-DP
examples add before quantization; a mask over a finite field will need the noise
discretized (the distributed discrete Gaussian of Kairouz et al. 2021), which the secure
aggregation stage will own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from fedloom.params import Params
from fedloom.transforms.base import Stage, Transform
from fedloom.transforms.clip_update import shared_names
from fedloom.transforms.gaussian import add_noise, noise_generator

#: keeps the clients' noise apart from their other seeded streams
CLIENT_NOISE_SALT = 0xD9A3


@dataclass(frozen=True)
class ClientNoise(Transform):
    name: ClassVar[str] = "client_noise"
    stage: ClassVar[Stage] = "noise"
    needs_values: ClassVar[bool] = True
    #: σ = z·C, the std of the noise on the sum of m̄ updates
    std: float
    #: m̄, the clients sampled per round
    clients_per_round: int
    seed: int = 0
    secure_noise: bool = False

    def up(
        self,
        update: Params,
        payload: Params,
        client_id: int,
        round_: int,
        state: dict[str, Any],
    ) -> Params:
        g = noise_generator(self.seed, round_, client_id, CLIENT_NOISE_SALT, self.secure_noise)
        share = self.std / math.sqrt(self.clients_per_round)
        return add_noise(update, shared_names(update, payload), share, g)

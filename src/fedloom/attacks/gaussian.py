"""Gaussian: each attacker sends random noise instead of its update.

Rule, for each shared tensor t::

    Δ'_t ~ N(0, (σ · r_t)² I),   r_t = sqrt(mean over benign clients and coordinates of Δ_t²)

the Gaussian Byzantine worker of Blanchard et al. 2017 (Krum) and Xie, Koyejo and Gupta
2018 ("Generalized Byzantine-tolerant SGD"), who draw N(0, 200² I) on raw gradients. A
LoRA update's scale depends on the learning rate, the rank and the tensor (A, B, head),
so an absolute σ is meaningless across runs; σ (``sigma``, default 10) is relative to the
root-mean-square coordinate r_t of the round's benign updates of that tensor: each
malicious update is about σ = 10 times a benign one's norm, so that with 20 % attackers
the noise in the mean, ≈ σ r_t √f / n per coordinate, is as large as a benign update's
coordinates (it does damage a mean) while a norm check or a median sees it plainly.
Seeded by (experiment seed, round, client).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from fedloom.attacks.base import ModelPoisoning, RoundView, stacked
from fedloom.params import Params

_SALT = 0x6A55


@dataclass(frozen=True)
class Gaussian(ModelPoisoning):
    name: ClassVar[str] = "gaussian"
    sigma: float = 10.0

    def __post_init__(self) -> None:
        if not self.sigma > 0:
            raise ValueError(f"sigma: must be > 0 (got {self.sigma})")

    def forge(self, view: RoundView) -> dict[int, Params]:
        reference = view.reference()
        out: dict[int, Params] = {}
        for cid, own in view.honest.items():
            seed = int(np.random.default_rng([view.seed, cid, _SALT]).integers(2**63 - 1))
            gen = torch.Generator().manual_seed(seed)
            out[cid] = {}
            for n, t in own.items():
                rows = stacked(reference, n, t)
                rms = float(rows.pow(2).mean().sqrt()) if rows is not None else 0.0
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float64)
                out[cid][n] = self.sigma * rms * noise
        return out

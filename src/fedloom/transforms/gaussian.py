"""Gaussian noise on a set of tensors, from a generator seeded per (seed, round, client),
the way every other random stream of a run is drawn (so that a run is reproducible and
resumes exactly), or from the operating system's entropy when the noise must stay unknown
to whoever knows the experiment's seed (``privacy.secure_noise``)."""

from __future__ import annotations

import secrets

import numpy as np
import torch

from fedloom.params import Params


def noise_generator(
    seed: int, round_: int, client_id: int, salt: int, secure: bool
) -> torch.Generator:
    """A generator for one client's noise in one round (``client_id`` -1: the server's)."""
    if secure:
        return torch.Generator().manual_seed(secrets.randbits(63))
    key = [seed, round_, client_id + 1, salt]
    return torch.Generator().manual_seed(int(np.random.default_rng(key).integers(2**63 - 1)))


def add_noise(params: Params, names: list[str], std: float, generator: torch.Generator) -> Params:
    """``params`` with N(0, std²) added to every value of the tensors ``names`` (drawn in
    float64, in the order of ``names``, and cast back to each tensor's dtype)."""
    if std == 0:
        return params
    noised = {
        n: (
            params[n].double()
            + std * torch.randn(params[n].shape, generator=generator, dtype=torch.float64)
        ).to(params[n].dtype)
        for n in names
    }
    return {**params, **noised}

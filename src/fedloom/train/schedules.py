"""Learning-rate schedules as pure functions of the position on a *global* clock.

The position runs over all rounds, ``pos = round * steps_per_round + step``, out of
``total = rounds * steps_per_round``; a federated run therefore decays its rate once over
the whole run instead of restarting warm-up and decay in every round (restarting made
each round's first steps the largest and was one reason naive FedAvg lagged centralized
training). Written by hand because the transformers/torch schedulers are stateful
objects tied to one optimizer's step counter, which a client re-created every round
does not have.

* constant: 1 after a linear warm-up of ``warmup`` steps;
* linear:   warm-up, then linear decay to 0 at ``total``;
* cosine:   warm-up, then 0.5 (1 + cos(pi * progress));
* noam:     min((pos + 1) / warmup, sqrt(warmup / (pos + 1))) (Vaswani et al. 2017,
            normalized so the peak factor is 1).
"""

from __future__ import annotations

import math


def lr_factor(schedule: str, pos: int, total: int, warmup: int) -> float:
    """Multiplier of the base learning rate at global step ``pos`` (0-based)."""
    if schedule == "noam":
        w = max(warmup, 1)
        return min((pos + 1) / w, math.sqrt(w / (pos + 1)))
    if warmup > 0 and pos < warmup:
        return (pos + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(max(pos - warmup, 0) / max(total - warmup, 1), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.schedule: unknown schedule {schedule!r}")

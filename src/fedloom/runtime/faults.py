"""Client faults: simulated ones (``[faults]``) and the server's check of every update.

Simulation. For each sampled client of a round (and retry ``attempt``), a generator
seeded by (seed, round, attempt, client) decides, in this order:

* **straggler**: a client of relative speed ``s`` needs ``1 / s`` nominal round times; it
  misses every round whose ``deadline`` is shorter, without training;
* **crash**: with probability ``crash`` its local training fails before it reports;
* **dropout**: with probability ``dropout`` it trains but never reports (it dropped out
  mid-round);
* **garbage**: a client in ``garbage`` sends :func:`corrupt` of its update instead.

A client that misses a round for any reason keeps the local state it had before it.

Checking. The server accepts an update only if :func:`update_problem` finds nothing: every
value finite; every tensor the dtype of the payload tensor of its name (a namespaced name
``ns/name`` is checked against ``name``; the method's own extra tensors, such as a task
vector, against the payload's dtypes), and the payload's shape; and the update no larger
than the limit (``federation.max_update_mb``). An encoding a compressing algorithm sends
(:func:`fedloom.comm.message.is_wire`) passes as bytes; the algorithm decodes it. This runs in every runtime, for simulated
and real garbage alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedloom.comm.message import is_wire
from fedloom.config import ExperimentConfig
from fedloom.params import Params

_SALT = 0xFA17


@dataclass(frozen=True)
class ClientFate:
    """What the fault simulation makes of one client in one round."""

    #: why it misses the round without an update ("straggler: ..."), or None
    missed: str | None = None
    crashes: bool = False
    drops_out: bool = False
    #: the kind of garbage it sends instead of its update, or None
    garbage: str | None = None


def fate(cfg: ExperimentConfig, round_: int, attempt: int, client_id: int) -> ClientFate:
    """Client ``client_id``'s faults in round ``round_`` (0-based), retry ``attempt``."""
    faults = cfg.faults
    speed = faults.speeds.get(client_id, 1.0)
    if faults.deadline > 0 and 1.0 / speed > faults.deadline:
        return ClientFate(
            missed=f"straggler: needs {1.0 / speed:g} round times, the "
            f"deadline is {faults.deadline:g}"
        )
    rng = np.random.default_rng([cfg.seed, round_, attempt, client_id, _SALT])
    crash_draw, dropout_draw = rng.random(), rng.random()
    return ClientFate(
        crashes=bool(crash_draw < faults.crash),
        drops_out=bool(dropout_draw < faults.dropout),
        garbage=faults.garbage.get(client_id),
    )


def corrupt(params: Params, kind: str) -> Params:
    """``params`` made into garbage of ``kind``: "nan", "shape", "dtype" or "oversize"."""
    out = dict(params)
    name = next(iter(sorted(out)))
    if kind == "nan":
        bad = out[name].clone()
        bad.view(-1)[0] = float("nan")
        out[name] = bad
    elif kind == "shape":
        out[name] = torch.cat([out[name], out[name][:1]])
    elif kind == "dtype":
        out = {n: t.double() for n, t in out.items()}
    elif kind == "oversize":
        size = sum(t.numel() for t in out.values())
        out["garbage/padding"] = torch.zeros(9 * size + 2**18)  # and 1 MiB more
    else:
        raise ValueError(f"unknown kind of garbage {kind!r}")
    return out


def byte_size(params: Params) -> int:
    return sum(t.numel() * t.element_size() for t in params.values())


def update_limit(cfg: ExperimentConfig, payload: Params) -> int | None:
    """The most bytes a client sent ``payload`` may send back (None: no limit)."""
    limit = cfg.federation.max_update_mb
    if limit is None:
        return 4 * byte_size(payload) + 2**20
    return None if limit == 0 else int(limit * 2**20)


def oversize(update: Params, limit: int | None) -> str | None:
    """Why ``update`` (as it arrived) is too big, or None."""
    if limit is not None and (size := byte_size(update)) > limit:
        return f"oversize update: {size} bytes, the limit is {limit}"
    return None


def update_problem(update: Params, payload: Params, limit: int | None) -> str | None:
    """Why the server must reject ``update`` (see the module docstring), or None."""
    if problem := oversize(update, limit):
        return problem
    dtypes = {t.dtype for t in payload.values()}
    for name, tensor in update.items():
        if is_wire(name, tensor):  # an encoding, decoded by the algorithm that sent it
            continue
        sent = payload.get(name, payload.get(name.rsplit("/", 1)[-1]))
        if sent is not None and tensor.dtype != sent.dtype:
            return f"{name}: dtype {tensor.dtype}, sent as {sent.dtype}"
        if sent is None and dtypes and tensor.dtype not in dtypes:
            return f"{name}: dtype {tensor.dtype}, the payload has {sorted(map(str, dtypes))}"
        if sent is not None and tensor.shape != sent.shape:
            return f"{name}: shape {tuple(tensor.shape)}, sent as {tuple(sent.shape)}"
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return f"{name}: non-finite values"
    return None

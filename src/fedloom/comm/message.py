"""A ``Params`` of floating-point tensors compressed into the ``Params`` that travels, and
back.

The sender and the receiver agree on the tensors' names and shapes (the receiver holds a
``like``: the payload it sent, or its own state), so only the operator's bytes travel:

* a vector operator (every one but PowerSGD) compresses the tensors as one vector, their
  concatenation in sorted name order, which is the vector the operators' bounds (ω, the
  top-k contraction) are stated for: one ``uint8`` tensor ``wire/flat``;
* a matrix operator compresses each 2-D tensor on its own (``wire/<name>``) and sends the
  other tensors as float32 through the identity (PowerSGD's own rule for vectors).

Error feedback, and any recursion x̂ ← x̂ + C(x − x̂), needs a contractive operator,
E‖C(x) − x‖² ≤ (1 − δ)‖x‖²; an unbiased operator of variance ω is not one when ω ≥ 1 (its
residual grows). ``contractive=True`` uses it as γC with γ = 1/(ω + 1), contractive with
δ = 1/(ω + 1) (Richtárik, Sokolov & Fatkhullin 2021, EF21, Lemma 8); γ travels with the
message (``wire/scale``), as ω of some operators depends on x.

Encoded tensors are named with the ``wire/`` segment, which the server's update checks
recognise (:func:`is_wire`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch

from fedloom.comm.compressors import Compressor, as_bytes, as_tensor
from fedloom.comm.compressors.base import unpack_header
from fedloom.comm.compressors.identity import Identity
from fedloom.params import Params, flatten, unflatten

WIRE = "wire/"
FLAT = WIRE + "flat"
#: γ = 1/(ω + 1), when an unbiased operator is made contractive (:func:`encode`)
SCALE = WIRE + "scale"


def is_wire(name: str, tensor: torch.Tensor) -> bool:
    """``tensor`` is an encoding (a 1-D ``uint8`` tensor named with the ``wire/`` segment)
    whose header reads: what the server's update checks accept in place of a float tensor."""
    if WIRE not in name or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        return False
    try:
        unpack_header(as_bytes(tensor[:256]))
    except ValueError:
        return False
    return True


def check(values: Params, names: Sequence[str], compressor: Compressor) -> None:
    """Refuse what ``compressor`` cannot do on the tensors ``names`` of ``values`` (a
    ``ValueError`` naming the operator's key): k larger than the values, a matrix operator
    that would compress none of them."""
    compressor.check(sizes(values, names, compressor))
    if compressor.matrix:
        compressor.check_matrices([tuple(values[n].shape) for n in names if values[n].dim() == 2])


def sizes(values: Params, names: Sequence[str], compressor: Compressor) -> int:
    """The number of values ``compressor`` will see as one vector (what ``k`` must not
    exceed); for a matrix operator, the smallest 2-D tensor's."""
    if compressor.matrix:
        return min((values[n].numel() for n in names if values[n].dim() == 2), default=0)
    return sum(values[n].numel() for n in names)


def encode(
    values: Params,
    compressor: Compressor,
    generator: torch.Generator | None = None,
    state: dict[str, Any] | None = None,
    prefix: str = "",
    contractive: bool = False,
) -> Params:
    """``values`` (all of its tensors, floating point) compressed: what travels, its names
    under ``prefix``. ``state`` is the encoder's own state (PowerSGD's Q per tensor);
    ``contractive`` scales an unbiased operator by 1/(ω + 1) (see the module docstring)."""
    names = sorted(values)
    if not names:
        return {}
    wire = _encode(values, names, compressor, generator, state, prefix)
    omega = compressor.omega(flatten(values, names)) if contractive else None
    if omega:
        wire[prefix + SCALE] = torch.tensor([1.0 / (1.0 + omega)], dtype=torch.float32)
    return wire


def _encode(
    values: Params,
    names: list[str],
    compressor: Compressor,
    generator: torch.Generator | None,
    state: dict[str, Any] | None,
    prefix: str,
) -> Params:
    if not compressor.matrix:
        flat = flatten(values, names)
        return {prefix + FLAT: as_tensor(compressor.encode(flat, generator, state))}
    out: Params = {}
    for n in names:
        if values[n].dim() == 2:
            own = None if state is None else state.setdefault(n, {})
            data = compressor.encode(values[n].float(), generator, own)
        else:
            data = Identity().encode(values[n].float())
        out[prefix + WIRE + n] = as_tensor(data)
    return out


def decode(wire: Params, like: Params, compressor: Compressor, prefix: str = "") -> Params:
    """The tensors :func:`encode` compressed, shaped and typed like ``like``'s tensors of
    the same names; a ``ValueError`` when the bytes are missing, malformed or do not fit
    them (what a faulty or hostile client may send)."""
    try:
        out = _decode(wire, like, compressor, prefix)
    except (KeyError, RuntimeError, IndexError, struct.error) as err:
        raise ValueError(f"undecodable {prefix}{WIRE} tensor ({type(err).__name__}: {err})")
    if prefix + SCALE not in wire:
        return out
    scale = wire[prefix + SCALE]
    if scale.dtype != torch.float32 or scale.shape != (1,) or not 0 < float(scale) <= 1:
        raise ValueError(f"{prefix + SCALE}: not a scale in (0, 1]")
    return {n: (t.float() * float(scale)).to(t.dtype) for n, t in out.items()}


def _decode(wire: Params, like: Params, compressor: Compressor, prefix: str) -> Params:
    names = sorted(like)
    if not names:
        return {}
    if not compressor.matrix:
        flat = compressor.decode(as_bytes(wire[prefix + FLAT]))
        if flat.numel() != sum(like[n].numel() for n in names):
            raise ValueError(f"{prefix + FLAT}: {flat.numel()} values, expected those of {names}")
        return unflatten(flat.reshape(-1), like, names)
    out: Params = {}
    for n in names:
        codec = compressor if like[n].dim() == 2 else Identity()
        tensor = codec.decode(as_bytes(wire[prefix + WIRE + n]))
        if tensor.shape != like[n].shape:
            raise ValueError(
                f"{prefix + WIRE + n}: shape {tuple(tensor.shape)}, expected {tuple(like[n].shape)}"
            )
        out[n] = tensor.to(like[n].dtype)
    return out

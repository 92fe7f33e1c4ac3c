"""Compression operators (``create(name, **hp)``), one module per operator.

Each encodes a tensor to the bytes that travel and decodes them back
(:class:`~fedloom.comm.compressors.base.Compressor`). Unbiased: ``qsgd``, ``terngrad``,
``randk``, ``natural``, ``ps_quant``; biased (used with error feedback): ``topk``,
``sign``, ``powersgd``; and the references ``identity``, ``fp16``, ``bf16``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

from fedloom.comm.compressors.base import Compressor, as_bytes, as_tensor
from fedloom.comm.compressors.identity import BFloat16, Float16, Identity
from fedloom.comm.compressors.natural import Natural
from fedloom.comm.compressors.powersgd import PowerSGD
from fedloom.comm.compressors.ps_quant import PSQuant
from fedloom.comm.compressors.qsgd import QSGD
from fedloom.comm.compressors.randk import RandK
from fedloom.comm.compressors.sign import Sign
from fedloom.comm.compressors.terngrad import TernGrad
from fedloom.comm.compressors.topk import TopK
from fedloom.config import STRICT, expected

COMPRESSORS: dict[str, type[Compressor]] = {
    c.name: c
    for c in (
        Identity,
        Float16,
        BFloat16,
        QSGD,
        TernGrad,
        RandK,
        Natural,
        PSQuant,
        TopK,
        Sign,
        PowerSGD,
    )
}


def create(name: str, **hp: Any) -> Compressor:
    """The compressor ``name`` with hyperparameters ``hp``, checked by name and type; a
    mistake is a ``ValueError`` starting with the key (``compressor: ...``, ``k: ...``)."""
    if name not in COMPRESSORS:
        raise ValueError(
            f"compressor: unknown compressor {name!r} (known: {', '.join(sorted(COMPRESSORS))})"
        )
    cls = COMPRESSORS[name]
    hints = typing.get_type_hints(cls, include_extras=True)
    known = {f.name for f in dataclasses.fields(cls)}
    for key, value in hp.items():
        if key not in known:
            raise ValueError(
                f"{key}: not a setting of compressor {name} (its settings: "
                f"{', '.join(sorted(known)) or 'none'})"
            )
        try:
            TypeAdapter(hints[key], config=STRICT).validate_python(value)
        except ValidationError as err:
            kind = expected(err, str(hints[key]))
            raise ValueError(f"{key}: expected {kind} for {name} (got {value!r})") from None
    return cls(**hp)


__all__ = ["COMPRESSORS", "Compressor", "as_bytes", "as_tensor", "create"]

"""Transforms on the ``Params`` that travel (``[[transforms]]`` in the config, in order):
:mod:`~fedloom.transforms.base` for the chain and where it runs, one module per transform.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from fedloom.transforms.base import Chain, Transform
from fedloom.transforms.clip_update import ClipUpdate
from fedloom.transforms.half_precision import HalfPrecision

TRANSFORMS: dict[str, type[Transform]] = {t.name: t for t in (ClipUpdate, HalfPrecision)}


def chain(specs: Sequence[Mapping[str, Any]]) -> Chain:
    """The chain of ``[[transforms]]`` tables (``name`` and the transform's fields); a
    mistake is a ``ValueError`` naming ``transforms[i].key``."""
    out = []
    for i, spec in enumerate(specs):
        values = dict(spec)
        name = values.pop("name", None)
        if name not in TRANSFORMS:
            raise ValueError(
                f"transforms[{i}].name: unknown transform {name!r} "
                f"(known: {', '.join(sorted(TRANSFORMS))})"
            )
        cls = TRANSFORMS[name]
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ValueError(
                    f"transforms[{i}].{key}: unknown setting of {name} "
                    f"(known: {', '.join(sorted(known)) or 'none'})"
                )
        hints = typing.get_type_hints(cls)
        for key, value in values.items():
            try:
                TypeAdapter(hints[key], config=ConfigDict(strict=True)).validate_python(value)
            except ValidationError:
                raise ValueError(
                    f"transforms[{i}].{key}: expected {hints[key].__name__} for "
                    f"{name} (got {value!r})"
                ) from None
        try:
            out.append(cls(**values))
        except ValueError as err:
            raise ValueError(f"transforms[{i}].{err}") from None
    return Chain(tuple(out))


__all__ = ["TRANSFORMS", "Chain", "ClipUpdate", "HalfPrecision", "Transform", "chain"]

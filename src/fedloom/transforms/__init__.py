"""Transforms on the ``Params`` that travel (``[[transforms]]`` in the config, in order):
:mod:`~fedloom.transforms.base` for the chain and where it runs, one module per transform.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from fedloom.transforms.base import STAGES, Chain, Served, Transform
from fedloom.transforms.clip_update import ClipUpdate
from fedloom.transforms.half_precision import HalfPrecision

TRANSFORMS: dict[str, type[Transform]] = {t.name: t for t in (ClipUpdate, HalfPrecision)}


def chain(specs: Sequence[Mapping[str, Any]], added: Sequence[Transform] = ()) -> Chain:
    """The chain of ``[[transforms]]`` tables (``name`` and the transform's fields), in the
    stages' order (:data:`~fedloom.transforms.base.STAGES`), with the transforms ``added``
    (the privacy section's) each placed at the end of its stage; a mistake is a
    ``ValueError`` naming ``transforms[i].key``."""
    out: list[Transform] = []
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
        if out and STAGES.index(cls.stage) < STAGES.index(out[-1].stage):
            raise ValueError(
                f"transforms[{i}].name: {name} ({cls.stage}) after {out[-1].name} "
                f"({out[-1].stage}); the chain runs {' ► '.join(STAGES)}"
            )
        if any(t.name == name for t in out):
            raise ValueError(f"transforms[{i}].name: {name} is already in the chain")
        try:
            out.append(cls(**values))
        except ValueError as err:
            raise ValueError(f"transforms[{i}].{err}") from None
    for t in added:
        after = [i for i, u in enumerate(out) if STAGES.index(u.stage) <= STAGES.index(t.stage)]
        out.insert(after[-1] + 1 if after else 0, t)
    return Chain(tuple(out))


__all__ = [
    "STAGES",
    "TRANSFORMS",
    "Chain",
    "ClipUpdate",
    "HalfPrecision",
    "Served",
    "Transform",
    "chain",
]

"""Transforms on the ``Params`` that travel (``[[transforms]]`` in the config, in order):
:mod:`~fedloom.transforms.base` for the chain and where it runs, one module per transform.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError

from fedloom.config import STRICT, expected
from fedloom.transforms.base import STAGES, Chain, Served, Transform
from fedloom.transforms.clip_update import ClipUpdate
from fedloom.transforms.compress import Compress
from fedloom.transforms.compress_down import CompressDown
from fedloom.transforms.half_precision import HalfPrecision

TRANSFORMS: dict[str, type[Transform]] = {
    t.name: t for t in (ClipUpdate, Compress, CompressDown, HalfPrecision)
}
#: fields the chain sets from the experiment, never keys of a ``[[transforms]]`` table
FROM_EXPERIMENT = ("seed",)


def chain(
    specs: Sequence[Mapping[str, Any]], added: Sequence[Transform] = (), seed: int = 0
) -> Chain:
    """The chain of ``[[transforms]]`` tables (``name`` and the transform's fields), in the
    stages' order (:data:`~fedloom.transforms.base.STAGES`), with the transforms ``added``
    (the privacy section's) each placed at the end of its stage; a transform with a
    ``seed`` field gets the experiment's ``seed``. A mistake is a ``ValueError`` naming
    ``transforms[i].key``; what the stages compose with is
    :func:`fedloom.composition.check_composition`'s."""
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
        known = {f.name for f in dataclasses.fields(cls)} - set(FROM_EXPERIMENT)
        for key in values:
            if key not in known:
                raise ValueError(
                    f"transforms[{i}].{key}: unknown setting of {name} "
                    f"(known: {', '.join(sorted(known)) or 'none'})"
                )
        hints = typing.get_type_hints(cls, include_extras=True)
        for key, value in values.items():
            try:
                TypeAdapter(hints[key], config=STRICT).validate_python(value)
            except ValidationError as err:
                kind = expected(err, getattr(hints[key], "__name__", str(hints[key])))
                raise ValueError(
                    f"transforms[{i}].{key}: expected {kind} for {name} (got {value!r})"
                ) from None
        if out and STAGES.index(cls.stage) < STAGES.index(out[-1].stage):
            raise ValueError(
                f"transforms[{i}].name: {name} ({cls.stage}) after {out[-1].name} "
                f"({out[-1].stage}); the chain runs {' ► '.join(STAGES)}"
            )
        if any(t.name == name for t in out):
            raise ValueError(f"transforms[{i}].name: {name} is already in the chain")
        if "seed" in {f.name for f in dataclasses.fields(cls)}:
            values["seed"] = seed
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
    "Compress",
    "CompressDown",
    "HalfPrecision",
    "Served",
    "Transform",
    "chain",
]

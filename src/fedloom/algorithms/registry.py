"""Name -> algorithm class; ``create(name, **hp)`` checks the hyperparameter names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from fedloom.algorithms.base import Algorithm

_REGISTRY: dict[str, type[Algorithm]] = {}
A = TypeVar("A", bound=type[Algorithm])


class AlgorithmError(ValueError):
    """Unknown algorithm or bad hyperparameter; the message names the config key."""


def register(name: str) -> Callable[[A], A]:
    def wrap(cls: A) -> A:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> list[str]:
    return sorted(_REGISTRY)


def create(name: str, **hyperparameters: Any) -> Algorithm:
    if name not in _REGISTRY:
        raise AlgorithmError(f"algorithm.name: unknown algorithm {name!r} (known: {', '.join(available())})")
    cls = _REGISTRY[name]
    known = {f.name for f in dataclasses.fields(cls)}
    for key in hyperparameters:
        if key not in known:
            raise AlgorithmError(
                f"algorithm.{key}: unknown hyperparameter for {name} "
                f"(known: {', '.join(sorted(known)) or 'none'})"
            )
    try:
        return cls(**hyperparameters)
    except (TypeError, ValueError) as err:
        raise AlgorithmError(str(err)) from None

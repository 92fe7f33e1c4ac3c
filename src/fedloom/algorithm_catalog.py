"""What ``fedloom algorithms`` lists, without importing torch: every registered algorithm's
one-line description and hyperparameters (name, default, expected type), read from
``algorithm_catalog.json`` beside this module. The command line also checks a config's
algorithm name and hyperparameter names against it (:func:`check`) before it imports the
registry, so that a misspelt name is refused in well under a second.

The file is generated from the live registry (:func:`generate`; ``python -m
fedloom.algorithm_catalog`` rewrites it) and a test fails when it differs from the
registry, so it cannot go stale unnoticed. Importing the registry itself pulls in torch
and every algorithm (about 9 s on a loaded 2-core machine); reading this file takes
milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedloom.config import ConfigError

CATALOG = Path(__file__).with_name("algorithm_catalog.json")


def shown(value: Any) -> str:
    """A default as the listing shows it: ``required``, ``unset``, else JSON."""
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "unset"
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def generate() -> dict[str, dict[str, Any]]:
    """The catalog of the live registry (imports every algorithm)."""
    from fedloom import algorithms
    from fedloom.algorithms.registry import description, hyperparameters

    return {
        name: {
            "description": description(name),
            "hyperparameters": [
                [h.name, shown(h.default), h.expected] for h in hyperparameters(name)
            ],
        }
        for name in algorithms.available()
    }


def load() -> dict[str, dict[str, Any]]:
    return json.loads(CATALOG.read_text(encoding="utf-8"))


def refusal(name: str, keys: Iterable[str]) -> str | None:
    """The registry's message refusing an unknown algorithm ``name`` or hyperparameter in
    ``keys`` (:func:`fedloom.algorithms.create`), from the catalog; None when both are
    known (values and types are left to the registry)."""
    catalog = load()
    if name not in catalog:
        return f"algorithm.name: unknown algorithm {name!r} (known: {', '.join(sorted(catalog))})"
    known = sorted(h[0] for h in catalog[name]["hyperparameters"])
    problems = [
        f"algorithm.{key}: unknown hyperparameter for {name} (known: {', '.join(known) or 'none'})"
        for key in keys
        if key not in known
    ]
    return "; ".join(problems) or None


def check(name: str, keys: Iterable[str]) -> None:
    """:func:`refusal` as a :class:`ConfigError`, while the registry is not imported. Once
    it is, it is the authority (it also knows algorithms registered in this process,
    which the catalog does not) and checking with it costs nothing more."""
    if "fedloom.algorithms.registry" in sys.modules:
        return
    message = refusal(name, keys)
    if message is not None:
        raise ConfigError(message)


if __name__ == "__main__":
    CATALOG.write_text(
        json.dumps(generate(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(f"wrote {CATALOG}")

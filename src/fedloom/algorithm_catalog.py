"""What ``fedloom algorithms`` lists, without importing torch: every registered algorithm's
one-line description and hyperparameters (name, default, expected type), read from
``algorithm_catalog.json`` beside this module.

The file is generated from the live registry (:func:`generate`; ``python -m
fedloom.algorithm_catalog`` rewrites it) and a test fails when it differs from the
registry, so it cannot go stale unnoticed. Importing the registry itself pulls in torch
and every algorithm (about 9 s on a loaded 2-core machine); reading this file takes
milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

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

    return {name: {"description": description(name),
                   "hyperparameters": [[h.name, shown(h.default), h.expected]
                                       for h in hyperparameters(name)]}
            for name in algorithms.available()}


def load() -> dict[str, dict[str, Any]]:
    return json.loads(CATALOG.read_text(encoding="utf-8"))


if __name__ == "__main__":
    CATALOG.write_text(json.dumps(generate(), indent=1, ensure_ascii=False) + "\n",
                       encoding="utf-8")
    print(f"wrote {CATALOG}")

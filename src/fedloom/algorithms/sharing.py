"""Which tensors are shared and which stay personal: name patterns, not code.

A pattern is a regular expression searched in a tensor's name (``lora_B`` matches every
LoRA B factor, ``layer\\.[0-2]\\.`` the first three layers), or the word ``head``: the task
head, i.e. every trainable tensor that is not a LoRA factor. Every partial-personalization
method (FedPer, LG-FedAvg, FedRep, FedSA-LoRA) reads its split from the
``[algorithm] personal = [...]`` list through these functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from fedloom.params import Params

#: the alias for the task head: every trainable tensor outside the LoRA factors
HEAD = "head"


def is_head(name: str) -> bool:
    return "lora_" not in name


def check_patterns(patterns: Sequence[str], key: str = "algorithm.personal") -> None:
    """Raise a ValueError naming ``key`` for a pattern that is not a valid regex."""
    for pattern in patterns:
        if pattern == HEAD:
            continue
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"{key}: {pattern!r} is not a regular expression ({err})") from None


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` is selected by any of ``patterns``."""
    return any(is_head(name) if p == HEAD else re.search(p, name) for p in patterns)


def select(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    return [n for n in names if matches(n, patterns)]


def split(params: Params, personal: Sequence[str]) -> tuple[Params, Params]:
    """(shared, personal) parts of ``params`` by the ``personal`` patterns."""
    mine = {n: t for n, t in params.items() if matches(n, personal)}
    return {n: t for n, t in params.items() if n not in mine}, mine


def merge(*parts: Params) -> Params:
    """One adapter from disjoint parts (later parts win on a shared name)."""
    out: Params = {}
    for part in parts:
        out.update(part)
    return out

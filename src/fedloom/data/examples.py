"""The unit of data every loader produces: one text (pair) with its label."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    """One labelled example.

    ``label`` is an ``int`` class id for classification tasks, a ``float`` for
    regression, and the reference response (``text_a`` the prompt) for generation. A chat
    record's ``chat`` holds the conversation before the response as (role, content) turns
    (``text_a`` is then its last turn's content). ``meta`` keeps the source's extra columns as strings (e.g. STS-B
    ``genre``, CoLA ``source``) so that feature-based partitions can use them; it does
    not take part in hashing.
    """

    text_a: str
    text_b: str | None
    label: int | float | str
    meta: Mapping[str, str] = field(default_factory=dict, hash=False)
    chat: tuple[tuple[str, str], ...] = field(default=(), hash=False)

"""A small prompt/response data set for generative-task tests: two topics (the field a
feature partition splits clients by) and short, learnable responses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOPICS = {"animal": ("cat", "dog", "horse", "cow"), "food": ("bread", "apple", "rice", "soup")}


def prompt_rows(n: int) -> list[dict[str, str]]:
    """``n`` records ``{prompt, response, topic}``, the topics alternating."""
    rows = []
    for i in range(n):
        topic = "animal" if i % 2 else "food"
        word = TOPICS[topic][i % 4]
        rows.append({"prompt": f"Describe the {word}.",
                     "response": f"The {word} is {topic} number {i % 3}.", "topic": topic})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as JSON lines at ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path

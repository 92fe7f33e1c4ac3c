"""A generative run's sample generations (``samples.jsonl``, written by
:mod:`fedloom.evaluation.samples`) read and checked for the report: one record per line,
``{"client": int, "prompt": str, "reference": str, "global": str | null, "personal": str |
null}``. The texts are whatever the data and the model made (markup, ampersands, quotes,
newlines), so the page escapes every one and shows it whole, or says how much it left out.
A file that cannot be read is reported as such (naming the line), never raised."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

#: the run directory's file (:data:`fedloom.evaluation.samples.SAMPLES_FILE`; not imported
#: from there, which would import torch with the report)
SAMPLES_FILE = "samples.jsonl"
#: the adapters whose answers a record holds, in the order the table shows them
ANSWERS = ("global", "personal")
#: a text longer than this many characters is shown as its first HEAD and last TAIL
#: characters with the number left out between them (a chat prompt's question is at its end)
MAX_CHARS = 2000
HEAD = 1400
TAIL = 400


@dataclass(frozen=True)
class Samples:
    """The records of samples.jsonl, or why it could not be read (``error``, one line
    naming the line of the file at fault)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def adapters(self) -> list[str]:
        """The adapters of :data:`ANSWERS` that answered at least one prompt."""
        return [a for a in ANSWERS if any(r[a] is not None for r in self.records)]


def read_samples(run_dir: Path) -> Samples | None:
    """``run_dir``'s samples.jsonl checked record by record; None when the run has none."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return Samples(error=str(err))
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            return Samples(error=f"line {number} is not JSON ({err})")
        problem = _problem(value)
        if problem:
            return Samples(error=f"line {number}: {problem}")
        records.append({k: value.get(k) for k in ("client", "prompt", "reference", *ANSWERS)})
    return Samples(records)


def _problem(value: Any) -> str | None:
    """What is wrong with one record, or None."""
    if not isinstance(value, dict):
        return f"not a JSON object (a {type(value).__name__})"
    client = value.get("client")
    if isinstance(client, bool) or not isinstance(client, int):
        return f"'client' must be an integer (got {json.dumps(client)[:40]})"
    for key in ("prompt", "reference"):
        if not isinstance(value.get(key), str):
            return f"{key!r} must be a string (got {json.dumps(value.get(key))[:40]})"
    for key in ANSWERS:
        if not isinstance(value.get(key), str | None):
            return f"{key!r} must be a string or null (got {json.dumps(value.get(key))[:40]})"
    return None


def shown_text(text: str | None, missing: str = "not generated") -> str:
    """``text`` as HTML: escaped, whole up to :data:`MAX_CHARS` characters, else its head
    and tail with what was left out said in the cell; None and "" each say what they are."""
    if text is None:
        return f'<span class="none">{escape(missing)}</span>'
    if not text:
        return '<span class="none">(empty)</span>'
    if len(text) <= MAX_CHARS:
        return escape(text)
    cut = len(text) - HEAD - TAIL
    return (
        f"{escape(text[:HEAD])}"
        f'<span class="none"> … ({cut:,} characters left out of {len(text):,}) … </span>'
        f"{escape(text[-TAIL:])}"
    )


def samples_table(samples: Samples) -> str:
    """One table, a row per record (grouped by client, in the file's order): the client,
    the prompt, the reference and each adapter's answer (an adapter that answered nothing
    has no column)."""
    adapters = samples.adapters()
    header = ["client", "prompt", "reference", *(f"{a} adapter" for a in adapters)]
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    rows = []
    previous = None
    for record in samples.records:
        cls = ' class="first"' if record["client"] != previous and previous is not None else ""
        previous = record["client"]
        cells = [
            f'<td class="num">{escape(str(record["client"]))}</td>',
            f'<td class="text">{shown_text(record["prompt"])}</td>',
            f'<td class="text">{shown_text(record["reference"])}</td>',
            *(f'<td class="text">{shown_text(record[a])}</td>' for a in adapters),
        ]
        rows.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return (
        f'<table class="samples"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def unreadable(samples: Samples) -> str:
    """The sentence a report shows instead of the table."""
    return f"{SAMPLES_FILE} could not be read, so no sample generations are shown: {samples.error}"


def description(samples: Samples) -> str:
    """The sentence above the table: what it shows."""
    clients = len({r["client"] for r in samples.records})
    adapters = samples.adapters()
    answers = " and ".join(
        {"global": "the global adapter", "personal": "the client's personal adapter"}[a]
        for a in adapters
    )
    return (
        f"The first test prompts of each client ({len(samples.records)} prompts, {clients} "
        f"clients), with the reference response"
        + (f" and the answers of {answers}, generated at the last evaluation" if answers else "")
        + f" ({SAMPLES_FILE}). Each text is shown as written; one over {MAX_CHARS:,} "
        "characters says how much of its middle is left out."
    )

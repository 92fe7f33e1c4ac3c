"""A command's docstring as the help its ``--help`` shows in a terminal.

The docstrings of the commands are written as that help: plain text (no reStructuredText),
paragraphs separated by blank lines, and indented lines (examples) kept as they are."""

from __future__ import annotations

import inspect

from rich.markup import escape


def terminal_help(docstring: str | None) -> str:
    """``docstring`` with each paragraph's lines joined, so that the terminal wraps it at
    its own width instead of where the source broke it; indented lines stay lines of
    their own, and square brackets stay text (Typer reads the help as rich markup)."""
    paragraphs = []
    for paragraph in inspect.cleandoc(docstring or "").split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            if lines and not line.startswith(" ") and not lines[-1].startswith(" "):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.rstrip())
        paragraphs.append("\n".join(lines))
    return escape("\n\n".join(paragraphs))

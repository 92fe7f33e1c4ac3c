"""``fedloom --help`` and every ``fedloom COMMAND --help`` in a terminal of 80 and of 120
columns: plain text (no reStructuredText), an example, prose wrapped by the terminal and
not where the docstring's source broke its lines, the whole docstring shown; and output
piped into a reader that stops early (``| head -1``) ends without a traceback.

The commands are enumerated from the Typer app, so a new command is checked as it is added.
"""

from __future__ import annotations

import inspect
import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fedloom.cli import HELP, app

WIDTHS = (80, 120)

#: every command as its arguments after ``fedloom``; () is ``fedloom`` itself
COMMANDS: list[tuple[str, ...]] = [(), *((str(info.name),) for info in app.registered_commands)]

#: reStructuredText that a terminal shows as is: inline literals and roles such as :func:
RST = re.compile(r"``|:(?:func|class|mod|meth|attr|obj|data|exc|ref|doc):`")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: a line of prose that ends with one of these may be followed by a line of its own
SENTENCE_ENDS = (".", ":", ";", "!", "?")
PANEL_LINE = ("╭", "│", "╰")
#: what overrides COLUMNS or forces colour, and PYTHONUNBUFFERED (a user's stdout is buffered)
NOT_A_USERS_TERMINAL = {
    "TERMINAL_WIDTH",
    "FORCE_COLOR",
    "PY_COLORS",
    "GITHUB_ACTIONS",
    "PYTHONUNBUFFERED",
}


def fedloom_command() -> list[str]:
    """The installed ``fedloom`` script beside this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name("fedloom")
    return [str(script)] if script.exists() else [sys.executable, "-m", "fedloom.cli"]


def terminal_env(**extra: str) -> dict[str, str]:
    """This environment as a user's terminal has it, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_A_USERS_TERMINAL}
    return {**env, "NO_COLOR": "1", **extra}


def prose_lines(help_text: str) -> list[str]:
    """The help's own text: every line outside the Usage line and the boxed panels of
    arguments, options and commands (those become empty lines, paragraph boundaries),
    without the one column of margin rich puts on each side."""
    lines = []
    for line in help_text.splitlines():
        if line.lstrip().startswith(("Usage:", *PANEL_LINE)):
            lines.append("")
        else:
            lines.append(line[1:].rstrip())
    return lines


def broken_mid_sentence(help_text: str, width: int) -> list[str]:
    """Lines of prose that end early in a sentence: the line does not end a sentence or
    introduce a block (``.`` ``:`` ``;`` ``!`` ``?``), the next line goes on with the same
    paragraph (not empty, not indented like an example), and that next line's first word
    would still have fit on this line, so the break is a line break of the docstring's
    source kept in the help, not one the terminal's wrapping made. Rich wraps the prose
    within ``width`` minus its two columns of margin."""
    room = width - 2
    found = []
    for line, after in itertools.pairwise(prose_lines(help_text)):
        if not line.strip() or not after.strip() or after.startswith(" "):
            continue
        if line.endswith(SENTENCE_ENDS):
            continue
        if len(line) + 1 + len(after.split()[0]) <= room:
            found.append(f"{line!r} / {after!r}")
    return found


def words(text: str) -> str:
    return " ".join(text.split())


def example_lines(text: str) -> list[str]:
    """The lines of the Example: block at the end of a docstring, stripped."""
    block = re.split(r"^Examples?:$", inspect.cleandoc(text), flags=re.MULTILINE)[-1]
    return [line.strip() for line in block.splitlines() if line.strip()]


def docstring(command: tuple[str, ...]) -> str:
    """The text a command's help shows: the command function's docstring; the app's HELP."""
    if not command:
        return HELP
    (info,) = [i for i in app.registered_commands if i.name == command[0]]
    assert info.callback is not None
    return inspect.getdoc(info.callback) or ""


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[tuple[str, ...], int], subprocess.CompletedProcess[str]]:
    """Every command's --help at every width, the processes run at once."""
    started = {
        (command, width): subprocess.Popen(
            [*fedloom_command(), *command, "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=terminal_env(COLUMNS=str(width)),
        )
        for command in COMMANDS
        for width in WIDTHS
    }
    done = {}
    for key, process in started.items():
        stdout, stderr = process.communicate(timeout=120)
        done[key] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


def test_every_command_is_covered() -> None:
    names = {c[0] for c in COMMANDS if c}
    assert {"run", "serve", "join", "eval", "partition", "diagnose", "sweep"} <= names


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "fedloom")
def test_help_is_plain_wrapped_text_with_an_example(
    rendered: dict[tuple[tuple[str, ...], int], subprocess.CompletedProcess[str]],
    command: tuple[str, ...],
    width: int,
) -> None:
    proc = rendered[command, width]
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    text = ANSI.sub("", proc.stdout)
    assert max(len(line) for line in text.splitlines()) == width, "COLUMNS not honoured"
    assert not RST.search(text), RST.findall(text)
    assert not broken_mid_sentence(text, width)
    prose = prose_lines(text)
    starts = [i for i, line in enumerate(prose) if re.fullmatch(r"Examples?:", line)]
    assert starts, "no Example: block"
    name = re.escape(command[0]) if command else r"\w+"
    example = re.compile(rf"\s+fedloom {name}\b")
    assert any(example.match(line) for line in prose[starts[0] + 1 :]), prose[starts[0] :]
    # all of the docstring, square brackets included (Typer reads help as rich markup)
    assert words(docstring(command)) in words("\n".join(prose))
    # each example on a line of its own, not wrapped: it can be copied as it is
    shown = {line.strip() for line in prose}
    assert not [line for line in example_lines(docstring(command)) if line not in shown]


@pytest.mark.parametrize("reader", ["head -n 1", "head -n 0"])
@pytest.mark.parametrize("args", [("serve", "--help"), ("--help",), ("algorithms",)], ids=" ".join)
def test_output_piped_into_a_reader_that_stops_early_ends_quietly(
    args: tuple[str, ...], reader: str
) -> None:
    """``head -n 0`` exits before fedloom writes anything, so the pipe is closed when it
    does; ``head -n 1`` after its first line. Exit status 1 (or 0 if every write got into
    the pipe before the reader left), and nothing on stderr."""
    pipeline = f"{shlex.join([*fedloom_command(), *args])} | {reader}; exit ${{PIPESTATUS[0]}}"
    proc = subprocess.run(
        ["bash", "-c", pipeline],
        capture_output=True,
        text=True,
        env=terminal_env(COLUMNS="80"),
        timeout=120,
        check=False,
    )
    assert proc.stderr == "", proc.stderr
    assert proc.returncode in (0, 1)

"""How a command ends when something goes wrong: ``fail`` (one line on stderr, exit status
2 for bad input), the group that turns every command's exceptions into those lines, and
the quiet end of output piped into a reader that stops early (``| head``)."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

import click
import typer
from typer.core import TyperGroup

from fedloom.cli.consoles import err_console, labelled
from fedloom.cli.version import installed_version
from fedloom.config import ConfigError


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: MESSAGE`` as one line on stderr and exit with ``code``."""
    one_line = " ".join(str(message).splitlines())
    err_console.print(labelled("error:", "bold red", one_line), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's input, not a bug: one line, exit status 2. Classes
    of modules not imported yet cannot have been raised, so they are not imported here."""
    found: list[type[BaseException]] = [
        ConfigError,
        FileNotFoundError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
    ]
    for module, name in (
        ("fedloom.data.errors", "DataError"),
        ("fedloom.algorithms.registry", "AlgorithmError"),
        ("fedloom.models.catalog", "BackboneError"),
        ("fedloom.runtime.rundir", "CheckpointError"),
        ("fedloom.report.rundata", "ReportError"),
    ):
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def describe_error(err: BaseException) -> str:
    """``err`` in one phrase: an OS error as ``FILE: what went wrong``."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    return str(err) or type(err).__name__


class ErrorHandlingGroup(TyperGroup):
    """Every command's errors: a user error is one line and exit status 2, Ctrl-C exit
    status 130, a closed stdout (``| head``) a quiet end, anything else a fedloom bug:
    its traceback, a line asking to report it, exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as err:  # a bad option or argument: one line, not a panel
            where = err.ctx.command_path if err.ctx is not None else "fedloom"
            fail(f"{err.format_message()} (see {where} --help)", code=err.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            err_console.print("interrupted", highlight=False)
            raise typer.Exit(130) from None
        except BrokenPipeError:  # the reader of stdout stopped reading (| head): not a bug
            _stdout_to_devnull()
            raise typer.Exit(1) from None
        except Exception as err:  # noqa: BLE001 - the CLI's last resort: one line, exit 2/1
            if isinstance(err, user_errors()):
                fail(describe_error(err))
            traceback.print_exception(err, file=sys.stderr)
            fail(
                f"this is a fedloom bug ({type(err).__name__}), please report it with the "
                f"traceback above, the command you ran and `fedloom --version` "
                f"({installed_version()})",
                code=1,
            )


@contextlib.contextmanager
def closed_pipe_ends_quietly() -> Iterator[None]:
    """Within the block, a reader of stdout that stops early (``fedloom algorithms | head
    -2``) ends the program quietly with exit status 1, as Python's documentation
    recommends. What is still buffered is flushed inside the block, so that a closed pipe
    is found here rather than by the interpreter's last flush."""
    try:
        try:
            yield
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        sys.exit(1)


def _stdout_to_devnull() -> None:
    """Point stdout at devnull: its reader is gone, and the interpreter's last flush of
    what is still buffered must not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())

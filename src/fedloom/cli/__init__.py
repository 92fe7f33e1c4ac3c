"""The ``fedloom`` command line: ``app``, the Typer application the ``fedloom`` script runs.

Each command is a function in a module of its own (``fedloom run`` in ``run.py``, ``fedloom
eval`` in ``evaluate.py``), registered below by one ``_add_command`` line; its docstring,
written as plain terminal text with an ``Example:`` block, is its ``--help``. What several
commands share: ``errors`` (``fail``, exit status 2; the group that turns exceptions into
one line), ``consoles``, ``options`` (arguments and options with one help text),
``config_file``, ``tables``, ``progress``, ``run_directory``, ``flower_run``,
``interrupts``, ``help_text`` and ``version``.

To add a command: write ``fedloom/cli/NAME.py`` with a function NAME(...) -> None whose
docstring is its help, and add ``_add_command("NAME", NAME.NAME)`` below (and the module to
the import line). tests/test_cli_help.py then checks its help like every other command's.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Annotated, Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# raised inside PEFT on every forward pass with transformers 5; not actionable for users
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

import typer

from fedloom.cli import (
    algorithms,
    backbones,
    compare,
    diagnose,
    evaluate,
    generate,
    join,
    partition,
    report,
    run,
    serve,
    sweep,
)
from fedloom.cli.errors import ErrorHandlingGroup, closed_pipe_ends_quietly
from fedloom.cli.help_text import terminal_help
from fedloom.cli.version import installed_version

HELP = """Personalized federated fine-tuning of transformers with LoRA adapters.

Each command's --help says what it does, with an example. Exit status: 0 success, 1 the
run failed, 2 bad input (config, data file, run directory), with one line on stderr
naming what is wrong, 130 interrupted (Ctrl-C). A traceback is only printed for a
fedloom bug, followed by a line asking to report it (exit status 1).

Example:
    fedloom run examples/quickstart.toml --set federation.rounds=8
"""


class FedloomApp(typer.Typer):
    """The ``fedloom`` application; called as a program, output piped into a reader that
    stops early (``fedloom algorithms | head -2``) ends it quietly."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with closed_pipe_ends_quietly():
            return super().__call__(*args, **kwargs)


app = FedloomApp(
    add_completion=False,
    no_args_is_help=True,
    help=terminal_help(HELP),
    cls=ErrorHandlingGroup,
    rich_markup_mode="rich",
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"fedloom {installed_version()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    pass


def _add_command(name: str, function: Callable[..., None]) -> None:
    """``function`` as ``fedloom NAME``, its docstring as its help."""
    app.command(name, help=terminal_help(function.__doc__))(function)


_add_command("run", run.run)
_add_command("serve", serve.serve)
_add_command("join", join.join)
_add_command("eval", evaluate.evaluate)
_add_command("generate", generate.generate)
_add_command("partition", partition.partition)
_add_command("diagnose", diagnose.diagnose)
_add_command("report", report.report)
_add_command("compare", compare.compare)
_add_command("algorithms", algorithms.algorithms)
_add_command("backbones", backbones.backbones)
_add_command("sweep", sweep.sweep)

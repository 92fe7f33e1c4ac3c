"""Where the commands print: results on stdout, everything else (progress, the run
directory, warnings, errors) on stderr through ``err_console``."""

from __future__ import annotations

from rich.console import Console

#: progress, notes, warnings and errors: stdout is kept for what a command produces
err_console = Console(stderr=True)

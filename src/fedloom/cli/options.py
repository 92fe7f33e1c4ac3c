"""Arguments and options that several commands take, with one help text each."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ConfigFile = Annotated[Path, typer.Argument(help="experiment TOML file")]
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", help="override a setting: section.key=value (repeatable)"),
]
DataDir = Annotated[Path | None, typer.Option(help="GLUE data directory")]
OutputDir = Annotated[Path | None, typer.Option(help="where run directories go")]
JsonSummary = Annotated[
    bool, typer.Option("--json", help="print summary.json on stdout (and nothing else there)")
]
WriteReport = Annotated[
    bool,
    typer.Option("--report/--no-report", help="write RUN_DIR/report/report.html when the run ends"),
]

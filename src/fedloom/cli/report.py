"""``fedloom report``: a run directory's report.html and its figures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedloom.cli.consoles import err_console


def report(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    out: Annotated[
        Path | None,
        typer.Option(help="where to write: a folder, or the page itself (a .html path)"),
    ] = None,
) -> None:
    """Write a run's report: one self-contained report.html and its PNG figures.

    The page shows the scores over rounds (the dev set and every client, with the mean
    and the 10th percentile), the final per-client scores, the bytes sent each round,
    epsilon when differential privacy is on, the relevance matrix or the clusters where
    the method has them, the partition of the data, the configuration and the versions
    that produced the run. It goes to RUN_DIR/report/ unless --out says otherwise, and
    opens in any browser without a network. fedloom run writes it at the end of every
    run (unless --no-report); this command writes it again, or for a run cut short.

    Example:
        fedloom report runs/quickstart-20261126-130000
    """
    from fedloom.report import write_report

    page = write_report(run_dir, out)
    typer.echo(str(page))
    err_console.print(f"figures: {page.parent}", highlight=False, soft_wrap=True)

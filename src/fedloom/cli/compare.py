"""``fedloom compare``: several runs (or a sweep's) side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedloom.cli.consoles import err_console, out_console


def compare(
    runs: Annotated[list[Path], typer.Argument(help="run directories, or a sweep directory")],
    metric: Annotated[
        list[str] | None,
        typer.Option(help="compare on this metric only (repeatable; default: every metric)"),
    ] = None,
    markdown: Annotated[
        Path | None, typer.Option(help="also write the table as Markdown to this file")
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="also draw the curves of the first --metric (default: the main one)"),
    ] = None,
) -> None:
    """Compare finished runs: a table of their final scores, curves side by side.

    RUNS are run directories, or a sweep directory (its points and replicates, the
    selected point marked with a star). Each run is labelled by its algorithm and the
    settings in which the runs differ. The table gives, per metric, the global adapter's
    dev score and the mean and 10th percentile over the clients of the global and the
    personal adapters, and the baselines and epsilon where a run has them. --markdown
    writes the same table for a results page; --plot draws one metric over rounds, a
    panel per score and a colour per run.

    Examples:
        fedloom compare runs/fedavg-20261126-130000 runs/ditto-20261126-131500
        fedloom compare runs/lr-sweep-20261126-140000 --markdown table.md
    """
    from fedloom.report import compare as compare_runs

    comparison = compare_runs(runs)
    out_console.print(comparison.rich_table(metric))
    if markdown is not None:
        markdown.write_text(comparison.markdown(metric), encoding="utf-8")
        err_console.print(f"markdown: {markdown}", highlight=False, soft_wrap=True)
    if plot is not None:
        drawn = comparison.plot(plot, metric[0] if metric else None)
        err_console.print(f"curves: {drawn}", highlight=False, soft_wrap=True)

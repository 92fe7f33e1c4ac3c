"""``fedloom run | eval``.

Exit status: 0 success, 1 the run failed, 2 bad input (config, data file, run directory),
with one line on stderr naming what is wrong.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, NoReturn

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# raised inside PEFT on every forward pass with transformers 5; not actionable for users
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedloom.config import ConfigError, load_config
from fedloom.data import DataError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="experiment TOML file")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override: section.key=value (repeatable)")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="GLUE data directory")] = None,
    output_dir: Annotated[Path | None, typer.Option(help="where run directories go")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Run a federated experiment and write its run directory."""
    from fedloom.experiment import Experiment
    from fedloom.runtime.local import simulate
    from fedloom.runtime.rundir import RunDir

    overrides = list(set_ or [])
    if data_dir is not None:
        overrides.append(f"data.data_dir={json.dumps(str(data_dir))}")
    if output_dir is not None:
        overrides.append(f"output_dir={json.dumps(str(output_dir))}")
    try:
        cfg = load_config(config, overrides)
        exp = Experiment.build(cfg)
    except (ConfigError, DataError) as err:
        fail(str(err))
    run_dir = RunDir.create(cfg.output_dir, cfg.name)
    console = Console(stderr=True)
    console.print(f"run directory: {run_dir.path}")
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=quiet, transient=False,
    ) as bar:
        rounds = bar.add_task("rounds", total=cfg.federation.rounds)
        clients = bar.add_task("clients", total=1)

        def hook(kind: str, done: int, total: int) -> None:
            bar.update(rounds if kind == "round" else clients, completed=done, total=total)

        try:
            summary = simulate(exp, run_dir, hook)
        except (FloatingPointError, RuntimeError) as err:
            fail(f"run failed: {err} (run directory kept: {run_dir.path})", code=1)
    Console().print(summary_table(summary))
    console.print(f"summary: {run_dir.path / 'summary.json'}")


def summary_table(summary: dict[str, Any]) -> Table:
    """Final numbers: dev scores, and mean / min / max / p10 over the clients' test splits."""
    table = Table(title=f"{summary['name']}: {summary['algorithm']} on {summary['task']}")
    for column in ("adapter", "scored on", "metric", "value / mean", "min", "max", "p10"):
        table.add_column(column, justify="left" if column in ("adapter", "scored on", "metric") else "right")
    for kind in ("global", "personal"):
        for scope, values in summary.get(kind, {}).items():
            if scope == "dev":
                for metric, value in values.items():
                    if metric != "n":
                        table.add_row(kind, f"dev (n={values['n']})", metric, f"{value:.4f}")
            else:
                for metric, stats in values.items():
                    cells = [f"{stats[k]:.4f}" for k in ("mean", "min", "max", "p10")]
                    table.add_row(kind, "client tests", metric, *cells)
    return table


@app.command("eval")
def eval_(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    data: Annotated[Path, typer.Option(help="GLUE directory, GLUE .tsv file, or .jsonl/.csv file")],
    task: Annotated[str | None, typer.Option(help="task (default: the run's)")] = None,
    split: Annotated[str, typer.Option(help="split inside a GLUE directory")] = "dev",
    personal: Annotated[bool, typer.Option(help="also score every client's personal adapter")] = False,
    batch_size: Annotated[int, typer.Option(min=1)] = 64,
    text_fields: Annotated[
        str | None, typer.Option(help="JSONL/CSV text field(s), comma-separated (default: the run's)")
    ] = None,
    label_field: Annotated[str | None, typer.Option(help="JSONL/CSV label field")] = None,
) -> None:
    """Score a run's saved adapters on labeled data; print the metrics as JSON."""
    from fedloom.scoring import score_run

    try:
        result = score_run(run_dir, data, task=task, split=split, personal=personal,
                           batch_size=batch_size, label_field=label_field,
                           text_fields=text_fields.split(",") if text_fields else None)
    except (ConfigError, DataError, FileNotFoundError) as err:
        fail(str(err))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    app()

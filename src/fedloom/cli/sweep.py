"""``fedloom sweep``: a hyperparameter grid, selected on validation splits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedloom.cli.config_file import config_overrides
from fedloom.cli.consoles import err_console, out_console
from fedloom.cli.errors import describe_error, fail
from fedloom.cli.options import DataDir, Overrides


def sweep(
    config: Annotated[Path | None, typer.Argument(help="experiment TOML file")] = None,
    grid: Annotated[
        list[str] | None,
        typer.Option(
            "--grid",
            help="section.key=v1,v2,... to sweep, values as TOML (repeatable: a grid)",
        ),
    ] = None,
    set_: Overrides = None,
    data_dir: DataDir = None,
    output_dir: Annotated[Path | None, typer.Option(help="where the sweep directory goes")] = None,
    select: Annotated[
        str,
        typer.Option(
            help="whose validation scores select: personal, global, or auto (personal adapters "
            "where the method has them)"
        ),
    ] = "auto",
    metric: Annotated[
        str | None, typer.Option(help="the metric that selects (default: the task's main metric)")
    ] = None,
    jobs: Annotated[int, typer.Option(min=1, help="points run at once, one process each")] = 1,
    seeds: Annotated[
        int,
        typer.Option(
            min=1,
            help="runs of the selected point: its own, then at seed+1 ... seed+N-1 "
            "(mean ± std of its clients' test mean and p10)",
        ),
    ] = 1,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="continue this sweep directory: finished points are kept, an interrupted one "
            "resumes, the rest run (no CONFIG, --grid or --set)"
        ),
    ] = None,
) -> None:
    """Run every point of a hyperparameter grid and select one on validation splits.

    Each --grid item names a setting and the values to try (section.key=v1,v2,...,
    values as TOML like --set); every combination of them is a point of the grid, run as
    a run of its own. The point with the best mean over the clients of --metric on their
    validation splits (partition.val_fraction > 0) is selected, never on their test
    splits, and then run again at --seeds N seeds. seed, data.* and partition.* are not
    grid keys: every point is scored on the same validation sets.

    Each point is a run directory inside OUTPUT_DIR/NAME-sweep-TIMESTAMP/, which also
    gets sweep.json (every point's validation and test scores, the selected point, its
    replicates) and sweep.md.

    Example:
        fedloom sweep examples/quickstart.toml --set partition.val_fraction=0.2 \\
            --grid train.lr=3e-4,1e-3,3e-3 --jobs 2 --seeds 3
    """
    from fedloom import sweep as sweeps

    if resume is not None:
        if config is not None or grid or set_ or output_dir is not None:
            fail(
                "--resume continues a sweep with the plan.toml in its directory: give no "
                "CONFIG, --grid, --set or --output-dir with it"
            )
        sweep_dir, plan = resume, sweeps.resumed_plan(resume)
    elif config is None:
        fail(
            "Missing argument 'CONFIG': give an experiment file, or --resume SWEEP_DIR "
            "(fedloom sweep --help)"
        )
    else:
        plan = sweeps.plan(
            config,
            sweeps.parse_grid(grid or []),
            config_overrides(set_, data_dir),
            select=select,
            metric=metric,
            seeds=seeds,
        )
        try:
            sweep_dir = sweeps.create_dir(output_dir or plan.base.output_dir, plan.base.name)
        except OSError as err:
            fail(f"output_dir: cannot create the sweep directory: {describe_error(err)}")
    total = len(plan.points)
    replicated = f", the selected one at {plan.seeds} seeds" if plan.seeds > 1 else ""
    err_console.print(
        f"sweep directory: {sweep_dir} ({total} points, {jobs} at a time{replicated})",
        highlight=False,
        soft_wrap=True,
    )
    result = sweeps.run(
        plan,
        sweep_dir,
        jobs=jobs,
        on_record=lambda record: err_console.print(
            sweeps.progress_line(record, total), highlight=False, soft_wrap=True
        ),
    )
    out_console.print(sweeps.rich_table(result))
    err_console.print(f"sweep: {sweep_dir / 'sweep.json'}", highlight=False, soft_wrap=True)
    if result.selected is None:
        fail(f"every point of the sweep failed (see {sweep_dir / 'sweep.md'})", code=1)

"""``fedloom eval``: a run's saved adapters scored on labeled data."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from fedloom.cli.consoles import notify
from fedloom.cli.errors import fail
from fedloom.config import ConfigError


def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    data: Annotated[
        Path,
        typer.Option(
            help="GLUE directory, a file in the run's GLUE layout (any name: dev.tsv, "
            "msr_paraphrase_test.txt), or a .jsonl/.csv/.tsv table with named fields"
        ),
    ],
    task: Annotated[
        str | None,
        typer.Option(help="task (default: the run's; a multi-task run: which of its tasks)"),
    ] = None,
    split: Annotated[str, typer.Option(help="split inside a GLUE directory")] = "dev",
    personal: Annotated[
        bool, typer.Option(help="also score every client's personal adapter")
    ] = False,
    batch_size: Annotated[int, typer.Option(min=1, help="examples per forward pass")] = 64,
    text_fields: Annotated[
        str | None,
        typer.Option(help="JSONL/CSV text field(s), comma-separated (default: the run's)"),
    ] = None,
    label_field: Annotated[str | None, typer.Option(help="JSONL/CSV label field")] = None,
    format_: Annotated[
        str | None,
        typer.Option(
            "--format", help="glue | jsonl | csv | tsv, when the file's extension does not say it"
        ),
    ] = None,
) -> None:
    """Score a run's saved adapters on labeled data; print the metrics as JSON.

    RUN_DIR is a run directory written by fedloom run or fedloom serve; its newest good
    checkpoint is scored, the global adapter and, with --personal, every client's
    personal one. Says on stderr which round the checkpoint is from and whether the run
    finished; data that do not fit the run and damaged checkpoints exit with status 2.

    Examples:
        fedloom eval runs/quickstart-20261122-130000 --data data/glue --task MRPC
        fedloom eval RUN_DIR --data my_test.jsonl --personal
    """
    from fedloom.data import DataError
    from fedloom.evaluation.finished_run import score_run
    from fedloom.runtime.rundir import CheckpointError, finite_json

    try:
        result = score_run(
            run_dir,
            data,
            task=task,
            split=split,
            personal=personal,
            batch_size=batch_size,
            label_field=label_field,
            fmt=format_,
            text_fields=text_fields.split(",") if text_fields else None,
            notify=notify,
        )
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as err:
        fail(str(err))
    result, non_finite = finite_json(result)
    if non_finite:
        notify(f"warning: non-finite values printed as null: {', '.join(non_finite)}")
    sys.stdout.write(json.dumps(result, allow_nan=False) + "\n")

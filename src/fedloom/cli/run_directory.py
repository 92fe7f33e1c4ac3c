"""What ``fedloom run`` and ``fedloom serve`` do with a run directory: create it, give
its status.json a final state when the run stops early, and report its summary."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from fedloom.cli.consoles import err_console, out_console
from fedloom.cli.errors import describe_error, fail
from fedloom.cli.tables import summary_table


def create_run_dir(cfg: Any) -> Any:
    """A new run directory for ``cfg`` in its output_dir (a RunDir), or exit status 2."""
    from fedloom.runtime.rundir import RunDir

    try:
        return RunDir.create(cfg.output_dir, cfg.name)
    except OSError as err:
        fail(
            f"output_dir: cannot create a run directory in {cfg.output_dir}: {describe_error(err)}"
        )


def settle(run_dir: Any, state: str, err: BaseException | None = None) -> None:
    """Give status.json its final state if the run stopped before simulate could."""
    if run_dir.status.get("state") == "running":
        with contextlib.suppress(OSError):
            run_dir.write_status(
                state, error=None if err is None else f"{type(err).__name__}: {err}"
            )


def report_summary(run_path: Path, json_out: bool, report: bool = True) -> None:
    """A finished run's summary.json: as is on stdout with --json, else as a table; with
    ``report``, its report.html written too (:func:`fedloom.report.write_report`)."""
    text = (run_path / "summary.json").read_text(encoding="utf-8")
    if json_out:
        sys.stdout.write(text)
    else:
        out_console.print(summary_table(json.loads(text)))
        err_console.print(f"summary: {run_path / 'summary.json'}", highlight=False, soft_wrap=True)
    if report:
        _write_report(run_path)


def _write_report(run_path: Path) -> None:
    """The run's report, or a warning: the run itself is complete either way."""
    from fedloom.report import write_report

    try:
        page = write_report(run_path)
    except Exception as err:  # noqa: BLE001 - the finished run must not be reported as failed
        err_console.print(
            f"warning: the report was not written ({describe_error(err)}); write it with "
            f"fedloom report {run_path}",
            highlight=False,
            soft_wrap=True,
        )
        return
    err_console.print(f"report: {page}", highlight=False, soft_wrap=True)

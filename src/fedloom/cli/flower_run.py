"""A run whose federation runs on Flower, for ``fedloom run`` (runtime.name = "flower",
on loopback) and ``fedloom serve`` (across machines)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from fedloom.cli.consoles import err_console
from fedloom.cli.errors import fail
from fedloom.cli.interrupts import interrupt_status, terminate_as_interrupt
from fedloom.cli.progress import progress_hook
from fedloom.cli.run_directory import create_run_dir, report_summary, settle


def run_on_flower(
    cfg: Any,
    quiet: bool,
    json_out: bool,
    report: bool,
    deploy: Callable[[Path, Callable[[int], None] | None], None],
) -> None:
    """A run on Flower (``fedloom.runtime.flower_deploy``): ``deploy(run_dir, on_round)``
    runs the federation; its ServerApp writes the run directory this process created, and
    this process reports it as ``fedloom run`` does."""
    from fedloom.runtime.flower_deploy import DeploymentError, require_flower, run_config
    from fedloom.runtime.rundir import read_status

    require_flower()

    run_dir = create_run_dir(cfg)
    rounds = cfg.federation.rounds
    run_dir.write_config(run_config(cfg))
    run_dir.write_status("running", rounds=rounds)
    err_console.print(f"run directory: {run_dir.path}", highlight=False, soft_wrap=True)
    try:
        with terminate_as_interrupt(), progress_hook(run_dir, rounds, quiet) as hook:
            deploy(run_dir.path, None if hook is None else (lambda r: hook("round", r, rounds)))
    except KeyboardInterrupt as err:
        settle(run_dir, "interrupted")
        err_console.print(f"interrupted (run directory: {run_dir.path})", highlight=False)
        raise typer.Exit(interrupt_status(err)) from None
    except DeploymentError as err:
        settle(run_dir, "failed", err)
        fail(f"run failed: {err} (run directory kept: {run_dir.path})", code=1)
    status = read_status(run_dir.path) or {}
    if status.get("state") != "finished":
        if status.get("state") == "running":
            settle(run_dir, "failed", RuntimeError("the ServerApp ended without finishing"))
        fail(
            f"run failed: {status.get('error') or 'the ServerApp ended without finishing'} "
            f"(run directory kept: {run_dir.path}; Flower's logs in {run_dir.path / 'flower'})",
            code=1,
        )
    report_summary(run_dir.path, json_out, report)

"""``fedloom run``: a federated experiment on this machine, or the continuation of one."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fedloom.cli.config_file import config_overrides, load_checked
from fedloom.cli.consoles import err_console
from fedloom.cli.errors import fail
from fedloom.cli.flower_run import run_on_flower
from fedloom.cli.options import DataDir, JsonSummary, OutputDir, Overrides, WriteReport
from fedloom.cli.progress import hide_library_bars, progress_hook, silence_progress
from fedloom.cli.run_directory import create_run_dir, report_summary, settle

if TYPE_CHECKING:
    from fedloom.experiment import Experiment


def run(
    config: Annotated[Path | None, typer.Argument(help="experiment TOML file")] = None,
    set_: Overrides = None,
    data_dir: DataDir = None,
    output_dir: OutputDir = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="continue this killed or interrupted run directory "
            "from its newest good checkpoint (no CONFIG)"
        ),
    ] = None,
    quiet: Annotated[
        bool, typer.Option(help="no progress output at all (rounds, model loading)")
    ] = False,
    json_out: JsonSummary = False,
    report: WriteReport = True,
) -> None:
    """Run a federated experiment and write its run directory.

    CONFIG is the experiment's TOML file; --set changes one of its settings for this
    run. The run directory (under output_dir, runs/ unless set) gets the config, the
    metrics of every round, the checkpoints and summary.json, whose numbers are printed
    as a table at the end, and report/report.html draws the run (--no-report skips it).
    Progress goes to stderr: bars on a terminal, else one line per round and evaluation. The run directory's status.json says running, finished, interrupted or
    failed; --resume continues an interrupted or killed run from its newest good
    checkpoint.

    Examples:
        fedloom run examples/quickstart.toml --set federation.rounds=8
        fedloom run --resume runs/quickstart-20261122-130000
    """
    if resume is not None:
        if config is not None or set_ or output_dir is not None:
            fail(
                "--resume continues a run with the config.toml in its run directory: "
                "give no CONFIG, --set or --output-dir with it"
            )
        run_dir = _resumable(resume)
        cfg = load_checked(run_dir.path / "config.toml", config_overrides(None, data_dir))
    elif config is None:
        fail(
            "Missing argument 'CONFIG': give an experiment file, or --resume RUN_DIR "
            "(fedloom run --help)"
        )
    else:
        overrides = config_overrides(set_, data_dir)
        if output_dir is not None:
            overrides.append(f"output_dir={json.dumps(str(output_dir))}")
        # everything that can be checked without data or a model, before loading them
        cfg = load_checked(config, overrides)
    from fedloom.experiment import Experiment, build_algorithm, pooled_party_ids
    from fedloom.runtime.checkpoint import ResumeError
    from fedloom.runtime.rundir import check_output_dir
    from fedloom.server import simulate

    algorithm = build_algorithm(cfg)
    if resume is None:
        check_output_dir(cfg.output_dir)
    elif cfg.runtime.name == "flower":
        fail(
            f'--resume: {resume} ran on Flower (runtime.name = "flower"), whose client '
            f"states live on its SuperNodes; start it again"
        )
    hide_library_bars()
    if quiet:
        silence_progress()
    if cfg.runtime.client_data == "nodes":
        fail(
            'runtime.client_data: "nodes" means each client\'s machine holds its data; run '
            "the server with fedloom serve CONFIG and each client with fedloom join CONFIG "
            "--client-id ID --data PATH (fedloom run starts every node here, on no data)"
        )
    if cfg.runtime.name == "flower":
        from fedloom.runtime.flower_deploy import run_loopback

        ids = (
            pooled_party_ids(cfg)
            if algorithm.pools_data
            else list(range(cfg.partition.num_clients))
        )
        run_on_flower(
            cfg,
            quiet,
            json_out,
            report,
            lambda run_dir, on_round: run_loopback(run_dir / "config.toml", run_dir, ids, on_round),
        )
        return
    # with --json, stdout carries the summary alone: stray prints go to stderr
    quiet_stdout = contextlib.redirect_stdout(sys.stderr) if json_out else contextlib.nullcontext()
    with quiet_stdout:
        exp = Experiment.build(cfg)
    err_console.print(_compute_line(exp), highlight=False, soft_wrap=True)
    if resume is None:
        run_dir = create_run_dir(cfg)
        run_dir.write_status("running", rounds=cfg.federation.rounds)
    err_console.print(f"run directory: {run_dir.path}", highlight=False, soft_wrap=True)
    try:
        with quiet_stdout, progress_hook(run_dir, cfg.federation.rounds, quiet) as hook:
            simulate(exp, run_dir, hook, resume=resume is not None)
    except ResumeError as err:
        fail(str(err))
    except KeyboardInterrupt:
        settle(run_dir, "interrupted")
        err_console.print(
            f"interrupted after round {run_dir.status.get('round', 0)} "
            f"(run directory: {run_dir.path}); continue it with: "
            f"fedloom run --resume {run_dir.path}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    except (FloatingPointError, RuntimeError) as err:
        settle(run_dir, "failed", err)
        fail(f"run failed: {err} (run directory kept: {run_dir.path})", code=1)
    except BaseException as err:
        settle(run_dir, "failed", err)
        raise
    report_summary(run_dir.path, json_out, report)


def _compute_line(exp: Experiment) -> str:
    """Where and how a run computes, as ``fedloom run`` prints it first: the device, each
    backbone's precision, TF32 on CUDA, and what a client costs in device memory."""
    compute = exp.compute()
    precision = ", ".join(f"{b} {p}" for b, p in compute["precision"].items())
    line = f"device: {compute['device']} | precision: {precision}"
    if compute["tf32"] is not None:
        line += f" | tf32 {'on' if compute['tf32'] else 'off'}"
    from fedloom.device import footprint

    costs = footprint(exp.model.head, exp.cfg.train.optimizer, exp.cfg.train.momentum)
    return (
        f"{line} | backbone {costs.backbone / 2**20:.1f} MiB, each client "
        f"{costs.per_client / 2**20:.2f} MiB (adapter + optimizer moments)"
    )


def _resumable(path: Path) -> Any:
    """The run directory ``path`` as a RunDir that may be resumed: it has a config.toml,
    did not finish, and no live process on this host is running it."""
    from fedloom.runtime.rundir import RunDir, read_status

    if not (path / "config.toml").is_file():
        fail(f"--resume: {path} is not a run directory (no config.toml)")
    status = read_status(path) or {}
    if status.get("state") == "finished":
        fail(f"--resume: {path} finished after round {status.get('round')}; nothing to resume")
    if (
        status.get("state") == "running"
        and status.get("host") == socket.gethostname()
        and _alive(status.get("pid"))
    ):
        fail(f"--resume: {path} is still being run by process {status['pid']}")
    run_dir = RunDir(path)
    run_dir.status = {k: v for k, v in status.items() if k in ("started", "rounds", "round")}
    return run_dir


def _alive(pid: Any) -> bool:
    """Whether ``pid`` (from a status file) is another process that runs."""
    from fedloom.runtime.processes import alive

    return isinstance(pid, int) and pid != os.getpid() and alive(pid)

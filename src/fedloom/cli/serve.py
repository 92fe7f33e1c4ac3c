"""``fedloom serve``: the server of a Flower federation across machines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fedloom.cli.config_file import config_overrides, load_checked
from fedloom.cli.consoles import err_console
from fedloom.cli.errors import fail
from fedloom.cli.flower_run import run_on_flower
from fedloom.cli.options import ConfigFile, JsonSummary, OutputDir, Overrides, WriteReport
from fedloom.cli.progress import silence_progress


def serve(
    config: ConfigFile,
    set_: Overrides = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="GLUE data directory (the server's: its dev set)")
    ] = None,
    output_dir: OutputDir = None,
    host: Annotated[
        str,
        typer.Option(
            help="address the SuperLink listens on (0.0.0.0: every interface); off this "
            "machine's loopback it needs --credentials, or --insecure"
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="the SuperLink's port (every API)")] = 9092,
    credentials: Annotated[
        Path | None,
        typer.Option(
            help="folder made by python -m fedloom.runtime.flower_credentials: TLS, and "
            "SuperNode authentication with its client_*.pub; without it, no TLS"
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            help="serve other machines without TLS and node authentication: anyone who "
            "reaches HOST:PORT can join as a client and read what the server sends"
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option(help="no progress output")] = False,
    json_out: JsonSummary = False,
    report: WriteReport = True,
) -> None:
    """Run a federated experiment as the server of a Flower federation across machines.

    Starts a SuperLink on HOST:PORT and the run's ServerApp for the experiment CONFIG;
    each client's machine joins with fedloom join CONFIG --client-id ID --superlink
    THIS_HOST:PORT. The run waits (runtime.nodes_timeout) until every client has joined,
    writes its run directory here, and stops the SuperLink when it ends.

    It listens on this machine's loopback unless --host says otherwise; off loopback it
    needs --credentials (TLS and node authentication), or --insecure. Other machines
    reach only the SuperLink's Fleet API (the nodes'), and the federation runs fedloom's
    apps only.

    Example:
        fedloom serve experiment.toml --host 0.0.0.0 --credentials creds
    """
    overrides = config_overrides(set_, data_dir)
    if output_dir is not None:
        overrides.append(f"output_dir={json.dumps(str(output_dir))}")
    cfg = load_checked(config, [*overrides, 'runtime.name="flower"'])
    check_exposure(host, credentials, insecure)
    if credentials is not None and not (credentials / "ca.crt").is_file():
        fail(
            f"--credentials: {credentials} has no ca.crt (make it with python -m "
            f"fedloom.runtime.flower_credentials {credentials} --clients K --host NAME)"
        )
    from fedloom.experiment import build_algorithm
    from fedloom.runtime.flower_deploy import run_served
    from fedloom.runtime.rundir import check_output_dir

    build_algorithm(cfg)
    check_output_dir(cfg.output_dir)
    if quiet:
        silence_progress()

    def announce(superlink: str) -> None:
        tls = " --credentials DIR" if credentials is not None else ""
        err_console.print(
            f"SuperLink listening on {host}:{port}; each client joins with: "
            f"fedloom join CONFIG --client-id ID --superlink THIS_HOST:{port}{tls}",
            highlight=False,
            soft_wrap=True,
        )

    run_on_flower(
        cfg,
        quiet,
        json_out,
        report,
        lambda run_dir, on_round: run_served(
            run_dir / "config.toml", run_dir, host, port, credentials, on_round, announce
        ),
    )


def check_exposure(host: str, credentials: Path | None, insecure: bool) -> None:
    """Refuse a SuperLink that other machines reach without TLS and node authentication
    unless ``--insecure`` says so (then warn); ``--insecure`` beside ``--credentials`` is
    a contradiction."""
    from fedloom.runtime.app_guard import is_loopback

    if insecure and credentials is not None:
        fail("--insecure: the server has --credentials (TLS and node authentication); drop one")
    if is_loopback(host) or credentials is not None:
        return
    if not insecure:
        fail(
            f"--host {host}: other machines would reach this server without TLS or node "
            f"authentication; give --credentials DIR (python -m "
            f"fedloom.runtime.flower_credentials DIR --clients K --host NAME), or --insecure"
        )
    err_console.print(
        f"warning: --insecure: the SuperLink on {host} has no TLS and no node "
        f"authentication; anyone who reaches it can join as a client",
        highlight=False,
        soft_wrap=True,
    )

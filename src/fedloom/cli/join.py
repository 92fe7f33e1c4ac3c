"""``fedloom join``: one client's machine in a Flower federation (a SuperNode)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from fedloom.cli.config_file import config_overrides, load_checked
from fedloom.cli.consoles import err_console
from fedloom.cli.errors import fail
from fedloom.cli.interrupts import interrupt_status, terminate_as_interrupt
from fedloom.config import ConfigError


def join(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="optional: this site's copy of the experiment TOML; the node refuses the "
            "server's experiment if a setting that must agree differs from it"
        ),
    ] = None,
    client_id: Annotated[
        int | None, typer.Option(help="which client this machine is (required)")
    ] = None,
    superlink: Annotated[
        str | None, typer.Option(help="the server's SuperLink, HOST:PORT (required)")
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="this machine's GLUE data directory (default: CONFIG's data.data_dir, "
            "else ../shared/data/glue where it exists, else the Hub; never the server's)"
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            help='this client\'s own examples (runtime.client_data = "nodes"): a JSONL/CSV/TSV '
            "file (its test split carved by partition.test_fraction) or a folder with "
            "train.* and test.*"
        ),
    ] = None,
    credentials: Annotated[
        Path | None,
        typer.Option(
            help="folder with the federation's ca.crt (TLS) and this client's client_ID.key "
            "(SuperNode authentication); without it, no TLS"
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            help="join a SuperLink on another machine without TLS (without --credentials): "
            "whoever sits between the two reads and changes what they say"
        ),
    ] = False,
    wait: Annotated[
        float,
        typer.Option(
            help="seconds to keep restarting a SuperNode that the SuperLink turned away (not up "
            "yet, or this node's key not registered yet)"
        ),
    ] = 300.0,
    device: Annotated[
        str | None,
        typer.Option(
            help="where this node trains: auto, cpu, cuda, cuda:N or mps (default: the "
            "config's train.device)"
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(min=1, help="torch threads for training (default: runtime.cpus_per_worker)"),
    ] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            help="where this node writes its client's personal adapter after each "
            "evaluation, as personal/client_NNN.safetensors (default: fedloom-node/client_NNN "
            "in the working directory)"
        ),
    ] = None,
) -> None:
    """Join a Flower federation as one client (a SuperNode), until stopped with Ctrl-C.

    The experiment is the server's: the node trains and scores this client's adapter with
    the config the server sends, on this machine, and keeps the client's local state here;
    with --data, on this client's own examples, which never leave the machine. A node
    sets only what is its machine's (--data-dir, --data, --device, --threads,
    --credentials, --checkpoint-dir). Evaluation sends the server scores only: a
    personalized client's adapter stays here, written into --checkpoint-dir.

    Given CONFIG, this site's copy of the experiment file, the node checks it now and
    refuses the server's experiment if a must-agree setting differs (the server then
    leaves this client out). A SuperNode the SuperLink turns away (Flower stops it when
    its key is not registered yet) is started again for --wait seconds.

    Examples:
        fedloom join --client-id 0 --superlink HOST:9092 --credentials creds
        fedloom join examples/flower/own_data.toml --client-id 0 \\
            --superlink HOST:9092 --data mine.jsonl
    """
    if client_id is None or client_id < 0:
        fail("--client-id: say which client this machine is (0, 1, ...)")
    if not superlink:
        fail("--superlink: say where the server's SuperLink is (HOST:PORT)")
    _check_transport(superlink, credentials, insecure)
    if config is None:
        _join_federation(
            client_id,
            superlink,
            data_dir,
            data,
            credentials,
            wait,
            device,
            threads,
            None,
            checkpoint_dir=checkpoint_dir,
        )
        return
    cfg = load_checked(config, [*config_overrides(None, data_dir), 'runtime.name="flower"'])
    if not 0 <= client_id < cfg.partition.num_clients:
        fail(
            f"--client-id {client_id}: the federation of {config} has clients 0 to "
            f"{cfg.partition.num_clients - 1} (partition.num_clients)"
        )
    own = cfg.runtime.client_data == "nodes"
    if own and data is None:
        fail(
            f'--data: {config} sets runtime.client_data = "nodes": name this client\'s '
            f"examples (a JSONL/CSV/TSV file, or a folder with train.* and test.*)"
        )
    if data is not None and not own:
        fail(
            f"--data: {config} partitions its dataset over the clients; for nodes with data "
            f'of their own set runtime.client_data = "nodes" there (the server\'s config too)'
        )
    if data is not None:
        _check_node_data(cfg, client_id, data)
    _join_federation(
        client_id,
        superlink,
        None if cfg.data.data_dir is None else Path(cfg.data.data_dir),
        data,
        credentials,
        wait,
        device,
        threads,
        config,
        checkpoint_dir=checkpoint_dir,
    )


def _join_federation(
    client_id: int,
    superlink: str,
    data_dir: Path | None,
    data: Path | None,
    credentials: Path | None,
    wait: float,
    device: str | None,
    threads: int | None,
    config: Path | None,
    *,
    checkpoint_dir: Path | None = None,
) -> None:
    """Start this client's SuperNode (again, while the SuperLink turns it away)."""
    if credentials is not None and not (credentials / "ca.crt").is_file():
        fail(f"--credentials: {credentials} has no ca.crt")
    if device is not None:
        from fedloom.device import DeviceError, resolve_device

        try:
            resolve_device(device)
        except DeviceError as err:
            fail(f"--device: {err}")
    from fedloom.runtime.flower_deploy import (
        require_flower,
        supernode_command,
        worker_command,
        worker_folder,
    )

    require_flower()

    folder = worker_folder()
    command = supernode_command(
        client_id,
        superlink,
        None if data_dir is None else str(data_dir.resolve()),
        credentials,
        None if data is None else str(data.resolve()),
        device,
        None if config is None else str(config.resolve()),
        threads,
        str(folder),
        # the node's own folder for its client's personal checkpoints (without it, the
        # node's default: fedloom-node/client_NNN in this working directory)
        checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir.resolve()),
    )
    from fedloom.runtime.app_guard import guarded_path

    # Flower's executables of this install, behind fedloom's guard: the node runs
    # fedloom's ClientApp only (app_guard)
    env = {**os.environ, "PATH": guarded_path(folder / "guard", os.environ.get("PATH", ""))}
    err_console.print(
        f"client {client_id}: joining the federation at {superlink}",
        highlight=False,
        soft_wrap=True,
    )
    # the node's worker keeps the experiment built between messages (and prints what the
    # node refuses); it exits with this process
    worker = subprocess.Popen(worker_command(folder, os.getpid()), env=env)
    deadline = time.monotonic() + wait
    try:
        with terminate_as_interrupt():
            while (status := _run_supernode(command, env)) != 0 and time.monotonic() < deadline:
                err_console.print(
                    f"client {client_id}: the SuperNode stopped (status "
                    f"{status}); starting it again in 5 s",
                    highlight=False,
                    soft_wrap=True,
                )
                time.sleep(5.0)
    except KeyboardInterrupt as err:
        raise typer.Exit(interrupt_status(err)) from None
    finally:
        worker.terminate()
        worker.wait()
        shutil.rmtree(folder, ignore_errors=True)
    raise typer.Exit(status)


def _check_transport(superlink: str, credentials: Path | None, insecure: bool) -> None:
    """Refuse a connection to another machine without TLS unless ``--insecure`` says so
    (then warn)."""
    from fedloom.runtime.app_guard import is_loopback

    if insecure and credentials is not None:
        fail("--insecure: the node has --credentials (TLS); drop one")
    host = superlink.rsplit(":", 1)[0].strip("[]")
    if credentials is not None or is_loopback(host):
        return
    if not insecure:
        fail(
            f"--superlink {superlink}: without --credentials the node would talk to "
            f"another machine without TLS; give --credentials DIR (the federation's "
            f"ca.crt and this client's key), or --insecure"
        )
    err_console.print(
        f"warning: --insecure: no TLS to {superlink}",
        highlight=False,
        soft_wrap=True,
    )


def _check_node_data(cfg: Any, client_id: int, data: Path) -> None:
    """Read this client's own examples once before joining: a mistake in them is named
    here, not in the first round's reply."""
    from fedloom.data import DataError
    from fedloom.federation import resolve_task
    from fedloom.node_data import NodeData, read_node_data

    try:
        task = resolve_task(cfg.data, on_nodes=True)
        train, test = read_node_data(
            NodeData(client_id, data), cfg.data, task, cfg.partition.test_fraction, cfg.seed
        )
    except (ConfigError, DataError) as err:
        fail(str(err))
    err_console.print(
        f"client {client_id}: {len(train)} training and {len(test)} test examples in {data}",
        highlight=False,
        soft_wrap=True,
    )


def _run_supernode(command: list[str], env: dict[str, str]) -> int:
    """Run a SuperNode to its end; stopped (SIGTERM, then SIGKILL after 10 s) if this
    process is interrupted, so that it can stop the ClientApps it started."""
    process = subprocess.Popen(command, env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        try:
            process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise

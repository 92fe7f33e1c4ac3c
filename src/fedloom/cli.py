"""``fedloom run | serve | join | eval | sweep | partition | diagnose | algorithms | backbones``.

Exit status: 0 success, 1 the run failed, 2 bad input (config, data file, run directory),
with one line on stderr naming what is wrong, 130 interrupted (Ctrl-C). A traceback is
only printed for a fedloom bug, followed by a line asking to report it (exit status 1).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# raised inside PEFT on every forward pass with transformers 5; not actionable for users
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.core import TyperGroup

from fedloom import algorithm_catalog
from fedloom.config import ConfigError, load_config

if TYPE_CHECKING:
    from fedloom.experiment import Experiment

err_console = Console(stderr=True)


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


def fail(message: str, code: int = 2) -> NoReturn:
    one_line = " ".join(str(message).splitlines())
    err_console.print(f"[bold red]error:[/] {escape(one_line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's input, not a bug: one line, exit status 2. Classes
    of modules not imported yet cannot have been raised, so they are not imported here."""
    found: list[type[BaseException]] = [
        ConfigError,
        FileNotFoundError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
    ]
    for module, name in (
        ("fedloom.data.errors", "DataError"),
        ("fedloom.algorithms.registry", "AlgorithmError"),
        ("fedloom.models.catalog", "BackboneError"),
        ("fedloom.runtime.rundir", "CheckpointError"),
    ):
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def _describe_error(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    return str(err) or type(err).__name__


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedloom")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _Commands(TyperGroup):
    """Every command's errors: a user error is one line and exit status 2, Ctrl-C exit
    status 130, anything else a fedloom bug: its traceback, a line asking to report it,
    exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as err:  # a bad option or argument: one line, not a panel
            where = err.ctx.command_path if err.ctx is not None else "fedloom"
            fail(f"{err.format_message()} (see {where} --help)", code=err.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            err_console.print("interrupted", highlight=False)
            raise typer.Exit(130) from None
        except Exception as err:  # noqa: BLE001 - the CLI's last resort: one line, exit 2/1
            if isinstance(err, _user_errors()):
                fail(_describe_error(err))
            traceback.print_exception(err, file=sys.stderr)
            fail(
                f"this is a fedloom bug ({type(err).__name__}), please report it with the "
                f"traceback above, the command you ran and `fedloom --version` ({_version()})",
                code=1,
            )


app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, cls=_Commands)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"fedloom {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    pass


@app.command()
def run(
    config: Annotated[Path | None, typer.Argument(help="experiment TOML file")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override: section.key=value (repeatable)")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="GLUE data directory")] = None,
    output_dir: Annotated[Path | None, typer.Option(help="where run directories go")] = None,
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
    json_out: Annotated[
        bool, typer.Option("--json", help="print summary.json on stdout (and nothing else there)")
    ] = False,
) -> None:
    """Run a federated experiment and write its run directory, or continue one (--resume).

    Progress goes to stderr: a bar on a terminal, else one line per round. The run
    directory's status.json says running / finished / interrupted / failed."""
    if resume is not None:
        if config is not None or set_ or output_dir is not None:
            fail(
                "--resume continues a run with the config.toml in its run directory: "
                "give no CONFIG, --set or --output-dir with it"
            )
        run_dir = _resumable(resume)
        cfg = _load_checked(run_dir.path / "config.toml", _overrides(None, data_dir))
    elif config is None:
        fail(
            "Missing argument 'CONFIG': give an experiment file, or --resume RUN_DIR "
            "(fedloom run --help)"
        )
    else:
        overrides = _overrides(set_, data_dir)
        if output_dir is not None:
            overrides.append(f"output_dir={json.dumps(str(output_dir))}")
        # everything that can be checked without data or a model, before loading them
        cfg = _load_checked(config, overrides)
    from fedloom.experiment import Experiment, build_algorithm, pooled_party_ids
    from fedloom.runtime.checkpoint import ResumeError
    from fedloom.runtime.local import simulate
    from fedloom.runtime.rundir import RunDir, check_output_dir

    algorithm = build_algorithm(cfg)
    if resume is None:
        check_output_dir(cfg.output_dir)
    elif cfg.runtime.name == "flower":
        fail(
            f'--resume: {resume} ran on Flower (runtime.name = "flower"), whose client '
            f"states live on its SuperNodes; start it again"
        )
    if quiet:
        _silence_progress()
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
        _run_on_flower(
            cfg,
            quiet,
            json_out,
            lambda run_dir, on_round: run_loopback(run_dir / "config.toml", run_dir, ids, on_round),
        )
        return
    # with --json, stdout carries the summary alone: stray prints go to stderr
    quiet_stdout = contextlib.redirect_stdout(sys.stderr) if json_out else contextlib.nullcontext()
    with quiet_stdout:
        exp = Experiment.build(cfg)
    err_console.print(_compute_line(exp), highlight=False, soft_wrap=True)
    if resume is None:
        try:
            run_dir = RunDir.create(cfg.output_dir, cfg.name)
        except OSError as err:
            fail(
                f"output_dir: cannot create a run directory in {cfg.output_dir}: "
                f"{_describe_error(err)}"
            )
        run_dir.write_status("running", rounds=cfg.federation.rounds)
    err_console.print(f"run directory: {run_dir.path}", highlight=False, soft_wrap=True)
    try:
        with quiet_stdout, _progress(run_dir, cfg.federation.rounds, quiet) as hook:
            simulate(exp, run_dir, hook, resume=resume is not None)
    except ResumeError as err:
        fail(str(err))
    except KeyboardInterrupt:
        _settle(run_dir, "interrupted")
        err_console.print(
            f"interrupted after round {run_dir.status.get('round', 0)} "
            f"(run directory: {run_dir.path}); continue it with: "
            f"fedloom run --resume {run_dir.path}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    except (FloatingPointError, RuntimeError) as err:
        _settle(run_dir, "failed", err)
        fail(f"run failed: {err} (run directory kept: {run_dir.path})", code=1)
    except BaseException as err:
        _settle(run_dir, "failed", err)
        raise
    _report(run_dir.path, json_out)


class _Terminated(KeyboardInterrupt):
    """SIGTERM received while this process holds Flower processes (exit status 143)."""


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM (``kill``, a job scheduler, a container stop) unwinds as
    Ctrl-C does, so that the Flower processes this process started (each in a session of
    its own, out of reach of a signal to this process's group) are stopped with it
    instead of orphaned; Python's default on SIGTERM is to exit on the spot."""

    def terminate(_signum: int, _frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt_status(err: KeyboardInterrupt) -> int:
    """The exit status of a run stopped by ``err``: 143 for SIGTERM, 130 for Ctrl-C."""
    return 143 if isinstance(err, _Terminated) else 130


def _run_on_flower(
    cfg: Any,
    quiet: bool,
    json_out: bool,
    deploy: Callable[[Path, Callable[[int], None] | None], None],
) -> None:
    """A run on Flower (:mod:`fedloom.runtime.flower_deploy`): ``deploy(run_dir,
    on_round)`` runs the federation; its ServerApp writes the run directory this process
    created, and this process reports it as ``fedloom run`` does."""
    from fedloom.runtime.flower_deploy import DeploymentError, require_flower, run_config
    from fedloom.runtime.rundir import RunDir, read_status

    require_flower()

    try:
        run_dir = RunDir.create(cfg.output_dir, cfg.name)
    except OSError as err:
        fail(
            f"output_dir: cannot create a run directory in {cfg.output_dir}: {_describe_error(err)}"
        )
    rounds = cfg.federation.rounds
    run_dir.write_config(run_config(cfg))
    run_dir.write_status("running", rounds=rounds)
    err_console.print(f"run directory: {run_dir.path}", highlight=False, soft_wrap=True)
    try:
        with _terminate_as_interrupt(), _progress(run_dir, rounds, quiet) as hook:
            deploy(run_dir.path, None if hook is None else (lambda r: hook("round", r, rounds)))
    except KeyboardInterrupt as err:
        _settle(run_dir, "interrupted")
        err_console.print(f"interrupted (run directory: {run_dir.path})", highlight=False)
        raise typer.Exit(_interrupt_status(err)) from None
    except DeploymentError as err:
        _settle(run_dir, "failed", err)
        fail(f"run failed: {err} (run directory kept: {run_dir.path})", code=1)
    status = read_status(run_dir.path) or {}
    if status.get("state") != "finished":
        if status.get("state") == "running":
            _settle(run_dir, "failed", RuntimeError("the ServerApp ended without finishing"))
        fail(
            f"run failed: {status.get('error') or 'the ServerApp ended without finishing'} "
            f"(run directory kept: {run_dir.path}; Flower's logs in {run_dir.path / 'flower'})",
            code=1,
        )
    _report(run_dir.path, json_out)


def _report(run_path: Path, json_out: bool) -> None:
    """A finished run's summary.json: as is on stdout with --json, else as a table."""
    text = (run_path / "summary.json").read_text(encoding="utf-8")
    if json_out:
        sys.stdout.write(text)
        return
    Console().print(summary_table(json.loads(text)))
    err_console.print(f"summary: {run_path / 'summary.json'}", highlight=False, soft_wrap=True)


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


def _settle(run_dir: Any, state: str, err: BaseException | None = None) -> None:
    """Give status.json its final state if the run stopped before simulate could."""
    if run_dir.status.get("state") == "running":
        with contextlib.suppress(OSError):
            run_dir.write_status(
                state, error=None if err is None else f"{type(err).__name__}: {err}"
            )


def _silence_progress() -> None:
    """No progress bars or info logging from transformers, huggingface_hub or datasets."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    with contextlib.suppress(ImportError):
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


@contextlib.contextmanager
def _progress(run_dir: Any, total: int, quiet: bool) -> Iterator[Any]:
    """The progress hook for simulate: none with --quiet; a live bar on a terminal; one
    plain line per round otherwise (``round 3/8: train_loss 0.4123, 12.3 s``)."""
    if quiet:
        yield None
        return
    if not err_console.is_terminal:
        last = [time.perf_counter()]

        def line(kind: str, done: int, of: int) -> None:
            if kind != "round":
                return
            now = time.perf_counter()
            loss = run_dir.latest.get("train", {}).get("train_loss")
            shown = f"train_loss {loss:.4f}, " if isinstance(loss, (int, float)) else ""
            err_console.print(
                f"round {done}/{of}: {shown}{now - last[0]:.1f} s", highlight=False, soft_wrap=True
            )
            err_console.file.flush()
            last[0] = now

        yield line
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=False,
    ) as bar:
        rounds = bar.add_task("rounds", total=total)
        clients = bar.add_task("clients", total=1)

        def hook(kind: str, done: int, of: int) -> None:
            bar.update(rounds if kind == "round" else clients, completed=done, total=of)

        yield hook


#: how summary_table names what a client scope scored, by eval.client_mode
_CLIENT_SCOPES = {
    "clients": {"split": "client tests", "dev_weighted": "client tests (dev-w)"},
    "val": {"split": "client val", "dev_weighted": "client val"},
    "clients_split": {"split": "client tests", "dev_weighted": "client tests (own)"},
}


def _stat(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def summary_table(summary: dict[str, Any]) -> Table:
    """Final numbers: dev scores, and mean / min / p10 over the clients (``clients``: how
    many clients the metric is defined on and summarized over; the max is in summary.json)."""
    table = Table(title=f"{summary['name']}: {summary['algorithm']} on {summary['task']}")
    mode = summary.get("client_mode", "split")
    notes = []
    if "label_names" in summary:
        notes.append(
            "labels: " + escape(", ".join(summary["label_names"]))
            if summary["label_names"]
            else "label: a number"
        )
    if mode == "dev_weighted":
        notes.append("dev-w: the dev set weighted to each client's label mix; own: its test split")
    table.caption = "\n".join(notes) or None
    for column in ("adapter", "scored on", "metric", "value / mean", "min", "p10", "clients"):
        table.add_column(
            column, justify="left" if column in ("adapter", "scored on", "metric") else "right"
        )
    for kind in ("global", "personal"):
        for scope, values in summary.get(kind, {}).items():
            if scope == "dev":
                for metric, value in values.items():
                    if metric != "n":
                        table.add_row(kind, f"dev (n={values['n']})", metric, _stat(value))
            else:
                where = _CLIENT_SCOPES.get(scope, {}).get(mode, scope)
                for metric, stats in values.items():
                    cells = [_stat(stats[k]) for k in ("mean", "min", "p10")]
                    table.add_row(kind, where, metric, *cells, str(stats.get("n", "")))
    return table


@app.command()
def serve(
    config: Annotated[Path, typer.Argument(help="experiment TOML file")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override: section.key=value (repeatable)")
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="GLUE data directory (the server's: its dev set)")
    ] = None,
    output_dir: Annotated[Path | None, typer.Option(help="where run directories go")] = None,
    host: Annotated[str, typer.Option(help="address the SuperLink listens on")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="the SuperLink's port (every API)")] = 9092,
    credentials: Annotated[
        Path | None,
        typer.Option(
            help="folder of python -m fedloom.runtime.flower_credentials: TLS, and SuperNode "
            "authentication with its client_*.pub; without it, no TLS"
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option(help="no progress output")] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="print summary.json on stdout (and nothing else there)")
    ] = False,
) -> None:
    """Run a federated experiment as the server of a Flower federation across machines.

    Starts a SuperLink on HOST:PORT and the run's ServerApp; each client's machine joins
    with ``fedloom join CONFIG --client-id ID --superlink THIS_HOST:PORT``. The run waits
    (runtime.nodes_timeout) until every client has joined, writes its run directory here,
    and stops the SuperLink when it ends."""
    overrides = _overrides(set_, data_dir)
    if output_dir is not None:
        overrides.append(f"output_dir={json.dumps(str(output_dir))}")
    cfg = _load_checked(config, [*overrides, 'runtime.name="flower"'])
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
        _silence_progress()

    def announce(superlink: str) -> None:
        tls = " --credentials DIR" if credentials is not None else ""
        err_console.print(
            f"SuperLink listening on {host}:{port}; each client joins with: "
            f"fedloom join CONFIG --client-id ID --superlink THIS_HOST:{port}{tls}",
            highlight=False,
            soft_wrap=True,
        )

    _run_on_flower(
        cfg,
        quiet,
        json_out,
        lambda run_dir, on_round: run_served(
            run_dir / "config.toml", run_dir, host, port, credentials, on_round, announce
        ),
    )


def _supernode(command: list[str], env: dict[str, str]) -> int:
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


@app.command()
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
            "else the server's)"
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
) -> None:
    """Join a Flower federation as one client (a SuperNode), until stopped with Ctrl-C.

    The experiment is the server's: the node trains and scores this client's adapter with
    the config the server sends, on this machine, and keeps the client's local state here;
    with --data, on this client's own examples, which never leave the machine. A node
    sets only what is its machine's (--data-dir, --data, --device, --threads,
    --credentials). Given CONFIG, the node checks it now and refuses the server's
    experiment if a must-agree setting differs (the server then leaves this client out).
    A SuperNode the SuperLink turns away (Flower stops it when its key is not registered
    yet) is started again for --wait seconds."""
    if client_id is None or client_id < 0:
        fail("--client-id: say which client this machine is (0, 1, ...)")
    if not superlink:
        fail("--superlink: say where the server's SuperLink is (HOST:PORT)")
    if config is None:
        _join(client_id, superlink, data_dir, data, credentials, wait, device, threads, None)
        return
    cfg = _load_checked(config, [*_overrides(None, data_dir), 'runtime.name="flower"'])
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
    _join(
        client_id,
        superlink,
        Path(cfg.data.data_dir),
        data,
        credentials,
        wait,
        device,
        threads,
        config,
    )


def _join(
    client_id: int,
    superlink: str,
    data_dir: Path | None,
    data: Path | None,
    credentials: Path | None,
    wait: float,
    device: str | None,
    threads: int | None,
    config: Path | None,
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
    )
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
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
        with _terminate_as_interrupt():
            while (status := _supernode(command, env)) != 0 and time.monotonic() < deadline:
                err_console.print(
                    f"client {client_id}: the SuperNode stopped (status "
                    f"{status}); starting it again in 5 s",
                    highlight=False,
                    soft_wrap=True,
                )
                time.sleep(5.0)
    except KeyboardInterrupt as err:
        raise typer.Exit(_interrupt_status(err)) from None
    finally:
        worker.terminate()
        worker.wait()
        shutil.rmtree(folder, ignore_errors=True)
    raise typer.Exit(status)


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


@app.command("eval")
def eval_(
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
    batch_size: Annotated[int, typer.Option(min=1)] = 64,
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

    Says on stderr which round the checkpoint is from and whether the run finished;
    data that do not fit the run and damaged checkpoints exit with status 2."""
    from rich.markup import escape as escape_markup

    from fedloom.data import DataError
    from fedloom.runtime.rundir import CheckpointError, finite_json
    from fedloom.scoring import score_run

    def notify(message: str) -> None:
        if message.startswith("warning: "):
            text = escape_markup(message.removeprefix("warning: "))
            err_console.print(f"[bold yellow]warning:[/] {text}", highlight=False, soft_wrap=True)
        else:
            err_console.print(escape_markup(message), highlight=False, soft_wrap=True)

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


def _load_checked(config: Path, overrides: list[str]) -> Any:
    """``config`` with ``overrides``, its algorithm name and hyperparameter names checked
    against the catalog before anything imports torch (a misspelt name answers at once)."""
    cfg = load_config(config, overrides)
    algorithm_catalog.check(cfg.algorithm.name, cfg.algorithm.hyperparameters)
    return cfg


def _overrides(set_: list[str] | None, data_dir: Path | None) -> list[str]:
    overrides = list(set_ or [])
    if data_dir is not None:
        overrides.append(f"data.data_dir={json.dumps(str(data_dir))}")
    return overrides


#: above this many labels the table lists each client's most frequent ones instead
_MAX_LABEL_COLUMNS = 6


def partition_table(stats: dict[str, Any], clusters: dict[str, int] | None = None) -> Table:
    """Per-client sizes, label histogram, divergence to the global label mix, task mix;
    with ``clusters`` (a run's discovered assignment) each client's true group beside it."""
    labels = stats["label_names"]
    wide = len(labels) > _MAX_LABEL_COLUMNS
    parts = [stats["scheme"], *(s for s in stats["skews"] if s != stats["scheme"])]
    table = Table(title=f"{stats['num_clients']} clients: {' + '.join(map(str, parts))}")
    for column in ("client", "train", "test", *(["top labels"] if wide else labels), "JS to mix"):
        table.add_column(column, justify="left" if column == "top labels" else "right")
    has_tasks = any(c.get("task_counts") for c in stats["clients"])
    if has_tasks:
        table.add_column("tasks", no_wrap=True)
    notes = any(c.get("label_map") is not None or c.get("drift") for c in stats["clients"])
    if notes:
        table.add_column("shift", no_wrap=True)
    from fedloom.diagnostics.clusters import true_groups

    groups = true_groups(stats) if clusters is not None else {}
    if clusters is not None:
        table.add_column("true group", no_wrap=True)
        table.add_column("cluster found", justify="right")
    for c in stats["clients"]:
        counts = c["label_counts"]
        if wide:
            top = sorted(range(len(counts)), key=lambda i: -counts[i])[:3]
            label_cells = [", ".join(f"{labels[i]} {counts[i]}" for i in top if counts[i])]
        else:
            label_cells = [str(n) for n in counts]
        row = [
            str(c["client_id"]),
            str(c["train"]),
            str(c["test"]),
            *label_cells,
            f"{c['js_to_global']:.3f}",
        ]
        if has_tasks:
            row.append(" · ".join(f"{t} {n}" for t, n in (c.get("task_counts") or {}).items()))
        if notes:
            shift = []
            if c.get("label_map") is not None:
                shift.append(f"labels → {c['label_map']}")
            if c.get("drift"):
                shift.append(
                    f"drifts in rounds {c['drift']['start_round']}–{c['drift']['end_round']}"
                )
            row.append("; ".join(shift))
        if clusters is not None:
            found = clusters.get(str(c["client_id"]))
            row += [groups[int(c["client_id"])], "—" if found is None else str(found)]
        table.add_row(*row)
    return table


@app.command()
def partition(
    config: Annotated[
        Path,
        typer.Argument(
            help="experiment TOML file, or a run directory (its config; its clusters, if any)"
        ),
    ],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override: section.key=value (repeatable)")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="GLUE data directory")] = None,
    clusters: Annotated[
        Path | None,
        typer.Option(help="a clustered run's directory: overlay its clusters on the true grouping"),
    ] = None,
    heatmap: Annotated[
        Path | None, typer.Option(help="clients x labels PNG (default: <name>-partition.png)")
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="also write the statistics")
    ] = None,
    round_: Annotated[
        int, typer.Option("--round", min=0, help="show drifting clients at this round")
    ] = 0,
    export: Annotated[
        Path | None,
        typer.Option(
            help="also write each client's examples to DIR/client_ID/{train,test}.jsonl, for "
            "nodes that hold their own data (fedloom join --data DIR/client_ID)"
        ),
    ] = None,
) -> None:
    """Partition the training data as CONFIG says and show who holds what (no model, no
    training); with a clustered run, which cluster each client was put in and the adjusted
    Rand index against the true grouping."""
    from fedloom.data import DataError, plot_label_heatmap
    from fedloom.federation import FederatedData

    if config.is_dir():
        if not (config / "config.toml").is_file():
            fail(f"{config}: a directory but not a run directory (no config.toml)")
        clusters = clusters or (config if _found_clusters(config, required=False) else None)
        config = config / "config.toml"
    found = _found_clusters(clusters, required=True) if clusters is not None else None
    try:
        cfg = _load_checked(config, _overrides(set_, data_dir))
        if round_ > cfg.federation.rounds:
            fail(
                f"--round: {round_} is past the last round (federation.rounds = "
                f"{cfg.federation.rounds})"
            )
        if cfg.runtime.client_data == "nodes":
            fail(
                'runtime.client_data: "nodes": each node holds its own data; there is no '
                "dataset here to partition"
            )
        if export is not None and (cfg.partition.tasks or cfg.partition.temporal):
            key = "tasks" if cfg.partition.tasks else "temporal"
            fail(
                f"--export: partition.{key} is a simulation of several tasks or of drift; "
                f"nodes with their own data hold one task's examples that do not move"
            )
        data = FederatedData.build(cfg)
        if export is not None:
            from fedloom.node_data import export_partition

            folders = export_partition(
                {
                    s.client_id: (data.examples(s, s.train), data.examples(s, s.test))
                    for s in data.splits
                },
                cfg.data,
                data.task,
                export,
            )
    except (ConfigError, DataError) as err:
        fail(str(err))
    if export is not None:
        err_console.print(f"{len(folders)} clients' examples: {export}/client_*/")
    stats = data.stats(round_)
    Console().print(partition_table(stats, found))
    if found is not None:
        from fedloom.diagnostics.clusters import adjusted_rand, true_groups

        ari = adjusted_rand(found, true_groups(stats))
        Console().print(
            "adjusted Rand index of the clusters found: "
            + ("— (the federation has a single true group)" if ari is None else f"{ari:.3f}")
        )
    path = plot_label_heatmap(
        data.label_counts(round_),
        data.label_names,
        heatmap or Path(f"{cfg.name}-partition.png"),
        title=f"{cfg.name}: training labels per client" + (f" (round {round_})" if round_ else ""),
    )
    err_console.print(f"heatmap: {path}")
    if json_out is not None:
        from fedloom.runtime.rundir import atomic_write

        atomic_write(json_out, json.dumps(stats, indent=1).encode())
        err_console.print(f"statistics: {json_out}")


def _found_clusters(run_dir: Path, *, required: bool) -> dict[str, int] | None:
    """The final ``clusters`` of a run's summary.json (None, or an error when required)."""
    summary = run_dir / "summary.json"
    try:
        found = json.loads(summary.read_text(encoding="utf-8")).get("clusters")
    except (OSError, ValueError) as err:
        if not required:
            return None
        fail(f"--clusters: {summary}: cannot read it ({err})")
    if found is None and required:
        fail(
            f"--clusters: {summary}: the run found no clusters (a clustered method such "
            "as ifca, cfl or fedem writes them)"
        )
    return found


def diagnosis_table(result: dict[str, Any]) -> Table:
    """Per client: size, label divergence, gradient distance, feature shift, label agreement."""
    clients = result["partition"]["clients"]
    grad = result["gradient"]["per_client"]
    shift = result["feature_shift"]["per_client"]
    cons = (result["label_consistency"] or {}).get("per_client", {})
    table = Table(title="heterogeneity at the initial model")
    for column in (
        "client",
        "train",
        "JS to label mix",
        "‖∇F_k − ∇F‖²",
        "feature shift",
        "label agreement (own / others)",
    ):
        table.add_column(column, justify="right")
    for c in clients:
        cid = str(c["client_id"])
        agree = cons.get(cid)
        table.add_row(
            cid,
            str(c["train"]),
            f"{c['js_to_global']:.3f}",
            f"{grad[cid]:.3g}" if cid in grad else "—",
            f"{shift[cid]:.4f}" if cid in shift else "—",
            f"{agree['within']:.2f} / {agree['cross']:.2f}" if agree else "—",
        )
    return table


@app.command()
def diagnose(
    config: Annotated[Path, typer.Argument(help="experiment TOML file")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override: section.key=value (repeatable)")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="GLUE data directory")] = None,
    batches: Annotated[int, typer.Option(min=1, help="gradient batches per client")] = 8,
    examples: Annotated[
        int, typer.Option(min=2, help="examples per client for the embedding probes")
    ] = 128,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write every number")] = None,
) -> None:
    """Measure CONFIG's federation at the initial model (no training) and advise on methods."""
    from fedloom.data import DataError

    try:
        cfg = _load_checked(config, _overrides(set_, data_dir))
    except ConfigError as err:
        fail(str(err))
    # the model and the diagnostics load torch: only once the config's names are checked
    from fedloom.diagnose import diagnose as run_diagnosis
    from fedloom.experiment import Experiment
    from fedloom.runtime.rundir import atomic_write

    try:
        exp = Experiment.build(cfg)
        diagnosis = run_diagnosis(exp, batches=batches, examples_per_client=examples)
    except (ConfigError, DataError) as err:
        fail(str(err))
    except ValueError as err:
        fail(f"diagnose: {err}")
    result = diagnosis.to_dict()
    out = Console()
    out.print(diagnosis_table(result))
    g = result["gradient"]

    def b2(value: float | None) -> str:
        return "undefined (mean gradient 0)" if value is None else f"{value:.3f}"

    out.print(
        f"gradient dissimilarity G² = {g['g2']:.4g}, B² = {b2(g['b2'])}, "
        f"‖∇F‖ = {g['mean_gradient_norm']:.4g}"
    )
    if g.get("g2_debiased") is not None:
        out.print(
            f"without minibatch noise: G² = {g['g2_debiased']:.4g}, "
            f"B² = {b2(g['b2_debiased'])} (noise share of G² {g['noise_share']:.2f})"
        )
    out.print(diagnosis.advice.render(), highlight=False)
    if json_out is not None:
        atomic_write(json_out, json.dumps(result, indent=1).encode())
        err_console.print(f"measurements: {json_out}")


@app.command("algorithms")
def algorithms_(
    name: Annotated[str | None, typer.Argument(help="show this algorithm only")] = None,
) -> None:
    """List the algorithms ([algorithm] name = ...) with their hyperparameters and defaults."""
    catalog = algorithm_catalog.load()
    if name is not None and name not in catalog:
        fail(algorithm_catalog.refusal(name, []) or "")
    for i, algorithm in enumerate(catalog if name is None else [name]):
        entry = catalog[algorithm]
        hps = entry["hyperparameters"]
        typer.echo(("\n" if i else "") + f"{algorithm}: {entry['description']}")
        if not hps:
            typer.echo("    (no hyperparameters)")
        width = max((len(h[0]) for h in hps), default=0)
        for hp, default, expected in hps:
            typer.echo(f"    {hp:<{width}}  {default:<10}  {expected}")


@app.command()
def backbones() -> None:
    """List the named backbones (model.backbone) and the heads (model.head)."""
    import ast
    import importlib.util
    import typing

    from fedloom.config import ModelConfig
    from fedloom.models.catalog import PACKAGED, BackboneError, resolve_backbone

    typer.echo("backbones (model.backbone = ...):")
    width = max(len(n) for n in PACKAGED)
    for backbone, what in PACKAGED.items():
        try:
            spec = resolve_backbone(backbone)
            where = f"{spec.kind}; {'random weights, tokenizer from ' if spec.tiny else ''}{spec.source}"
        except BackboneError as err:
            where = f"not installed: {err}"
        typer.echo(f"    {backbone:<{width}}  {what} ({where})")
    typer.echo(f"    {'<id or path>':<{width}}  any Hugging Face model id or local model directory")
    # the heads' docstrings, read from their module's source: importing it loads torch
    heads_module = importlib.util.find_spec("fedloom.models.heads")
    source = heads_module.origin if heads_module is not None else None
    if source is None:
        raise RuntimeError("fedloom.models.heads has no source file to read")
    docs = {
        node.name: ast.get_docstring(node) or ""
        for node in ast.parse(Path(source).read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
    }
    heads = {"classifier": docs["ClassifierHead"], "verbalizer": docs["VerbalizerHead"]}
    typer.echo("heads (model.head = ...):")
    for head in typing.get_args(ModelConfig.model_fields["head"].annotation):
        what = (
            " ".join(heads[head].split())
            if head in heads
            else "classifier on an encoder, verbalizer on a causal LM"
        )
        typer.echo(f"    {head:<{width}}  {what}")


@app.command()
def sweep(
    config: Annotated[Path | None, typer.Argument(help="experiment TOML file")] = None,
    grid: Annotated[
        list[str] | None,
        typer.Option(
            "--grid",
            help="section.key=v1,v2,... to sweep, values as TOML (repeatable: a grid)",
        ),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override: section.key=value (repeatable)")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="GLUE data directory")] = None,
    output_dir: Annotated[Path | None, typer.Option(help="where the sweep directory goes")] = None,
    select: Annotated[
        str,
        typer.Option(
            help="whose validation scores select: personal, global, or auto (personal adapters "
            "where the method has them)"
        ),
    ] = "auto",
    metric: Annotated[str | None, typer.Option(help="default: the task's main metric")] = None,
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
    """Run every point of a hyperparameter grid and select one on the clients' validation
    splits (partition.val_fraction > 0), never on their test splits; then re-run the
    selected point at --seeds N seeds (seed, data.* and partition.* are not grid keys).

    Each point is a run directory inside <output>/<name>-sweep-<timestamp>/, which also
    gets sweep.json (every point's val and test scores, the selected point, its replicates)
    and sweep.md."""
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
            _overrides(set_, data_dir),
            select=select,
            metric=metric,
            seeds=seeds,
        )
        try:
            sweep_dir = sweeps.create_dir(output_dir or plan.base.output_dir, plan.base.name)
        except OSError as err:
            fail(f"output_dir: cannot create the sweep directory: {_describe_error(err)}")
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
    Console().print(sweeps.rich_table(result))
    err_console.print(f"sweep: {sweep_dir / 'sweep.json'}", highlight=False, soft_wrap=True)
    if result.selected is None:
        fail(f"every point of the sweep failed (see {sweep_dir / 'sweep.md'})", code=1)


if __name__ == "__main__":
    app()

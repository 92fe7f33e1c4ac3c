"""Flower's deployment engine driven from fedloom: the processes of a federation and the
Flower app project that names fedloom's apps.

:class:`Federation` starts ``flower-superlink`` and ``flower-supernode`` processes (each
in its own process group, logs in ``<home>/logs/``) and stops every one of them, with the
``flwr-serverapp`` / ``flwr-clientapp`` processes they spawned, when its ``with`` block
ends, also on an error or Ctrl-C. :meth:`Federation.submit` is ``flwr run`` with fedloom's
app project (:func:`write_app`) and the run's config and run directory as run config.
``fedloom run`` with ``runtime.name = "flower"`` runs a loopback federation
(:func:`run_loopback`): a SuperLink and one SuperNode per client on 127.0.0.1, without
TLS, as Flower's local deployment guide does. Every process runs behind
:mod:`fedloom.runtime.app_guard` (fedloom's apps only).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import tomli_w

from fedloom.config import ConfigError
from fedloom.runtime.app_guard import APP_PROJECT, PINNED_RUN, guarded_path
from fedloom.runtime.rundir import read_status

if TYPE_CHECKING:
    from fedloom.config import ExperimentConfig

#: the SuperLink connection name ``flwr`` is given
CONNECTION = "fedloom"


class DeploymentError(RuntimeError):
    """A Flower process could not be started or the run could not be submitted."""


def require_flower() -> None:
    """Refuse, in one line naming the extra, when Flower is not installed."""
    if importlib.util.find_spec("flwr") is None:
        raise ConfigError('runtime.name = "flower" needs Flower: pip install "fedloom[flower]"')


def run_config(cfg: ExperimentConfig) -> dict[str, Any]:
    """The config.toml a Flower run's ServerApp and nodes load: every setting named, the
    adapter structure the algorithm builds by itself included (fedmosaic: the mosaic
    model), as the local runtime's run directory has it."""
    from fedloom.config import to_toml_dict
    from fedloom.experiment import build_algorithm, with_model_for

    return to_toml_dict(with_model_for(build_algorithm(cfg), cfg))


def write_app(folder: Path) -> Path:
    """fedloom's Flower app project (a ``pyproject.toml``) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(tomli_w.dumps(APP_PROJECT), encoding="utf-8")
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DeploymentError(f"{what} exited with status {process.returncode} on start")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise DeploymentError(f"{what} did not listen on port {port} within {timeout:g} s")


class Federation:
    """Flower processes sharing the Flower home ``home`` (apps, logs, the ``flwr``
    connection); a context manager that stops them all on exit. They run behind
    :mod:`fedloom.runtime.app_guard`: fedloom's apps only, the SuperLink's Control and
    Runtime APIs to this machine only and, with ``pinned`` (a config and a run
    directory), the ServerApp of that run only."""

    def __init__(self, home: Path, pinned: tuple[Path, Path] | None = None) -> None:
        self.home = home
        self.logs = home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.processes: list[subprocess.Popen[bytes]] = []
        #: the folders of the nodes' worker sockets, removed by :meth:`stop`
        self.folders: list[Path] = []
        # the flwr executables of this install, behind fedloom's guard: its processes run
        # fedloom's apps only (app_guard)
        self.env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "PATH": guarded_path(home / "guard", os.environ.get("PATH", "")),
        }
        if pinned is not None:  # the one run (config, run directory) its ServerApp runs
            config, run_dir = pinned
            self.env[PINNED_RUN] = json.dumps(
                {"config": str(config.resolve()), "run-dir": str(run_dir.resolve())}
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as out:
            process = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def start_superlink(
        self, port: int, host: str = "127.0.0.1", credentials: Path | None = None
    ) -> str:
        """A SuperLink on ``host:port`` (all its APIs). With ``credentials`` (a folder of
        :mod:`fedloom.runtime.flower_credentials`): TLS, and SuperNode authentication
        when it holds node public keys (register them with :meth:`register_nodes`);
        else ``--insecure``. Returns the address to reach it from this machine."""
        security = ["--insecure"]
        if credentials is not None:
            security = [
                "--ssl-ca-certfile",
                str(credentials / "ca.crt"),
                "--ssl-certfile",
                str(credentials / "server.pem"),
                "--ssl-keyfile",
                str(credentials / "server.key"),
            ]
            if list(credentials.glob("client_*.pub")):
                security.append("--enable-supernode-auth")
        process = self._start(
            "superlink",
            [
                sys.executable,
                "-m",
                "fedloom.runtime.app_guard",
                "superlink",
                *security,
                "--host",
                host,
                "--port",
                str(port),
                "--disable-runtime-dependency-installation",
            ],
        )
        _wait_for_port(port, process, 60.0, "flower-superlink")
        return f"127.0.0.1:{port}"

    def register_nodes(self, credentials: Path) -> None:
        """``flwr supernode register`` of every ``client_*.pub`` in ``credentials`` (after
        :meth:`connect`)."""
        for key in sorted(credentials.glob("client_*.pub")):
            done = subprocess.run(
                ["flwr", "supernode", "register", str(key), CONNECTION],
                env=self.env,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise DeploymentError(
                    f"flwr supernode register {key}: {(done.stderr or done.stdout).strip()}"
                )

    def start_supernode(
        self,
        client_id: int,
        superlink: str,
        data_dir: str | None = None,
        credentials: Path | None = None,
        worker: bool = True,
        config_file: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """The SuperNode of client ``client_id``, connecting to ``superlink``
        (:func:`supernode_command`; ``config_file``: the node's own copy of the
        experiment, whose paths it reads), and, with ``worker``, the node's worker beside it
        (:mod:`fedloom.runtime.node_worker`: it keeps the experiment built between
        messages, and exits with the SuperNode). The node's own folder, where it writes
        its client's personal checkpoints, is ``<home>/nodes/client_NNN``."""
        folder = worker_folder() if worker else None
        node = self._start(
            f"supernode-{client_id}",
            supernode_command(
                client_id,
                superlink,
                data_dir,
                credentials,
                config_file=None if config_file is None else str(config_file.resolve()),
                worker=None if folder is None else str(folder),
                checkpoint_dir=str(self.home.resolve() / "nodes" / f"client_{client_id:03d}"),
            ),
        )
        if folder is not None:
            self._start(f"worker-{client_id}", worker_command(folder, node.pid))
            self.folders.append(folder)
        return node

    def kill_after_replies(
        self, client_id: int, node: subprocess.Popen[bytes], message_type: str, count: int
    ) -> threading.Event:
        """A fault drill: SIGKILL the SuperNode ``node`` of client ``client_id`` (its
        process group; its worker follows) as soon as it has sent, from now on, its
        ``count``-th reply to a ``message_type`` message, as its log tells (Flower's
        "Sending: ... message" and "Sent successfully" lines, checked every 20 ms on a
        thread of its own): the reply has reached the SuperLink, and the node answers
        nothing after it. The event is set once it killed."""
        killed = threading.Event()
        log = self.logs / f"supernode-{client_id}.log"

        def sent() -> int:
            done, last = 0, ""
            for line in log.read_text(errors="replace").splitlines():
                if "Sending: " in line:
                    last = line.split("Sending: ", 1)[1].split(" message", 1)[0]
                elif "Sent successfully" in line and last == message_type:
                    done += 1
            return done

        before = sent() if log.is_file() else 0

        def watch() -> None:
            while node.poll() is None:
                if log.is_file() and sent() - before >= count:
                    _signal_group(node, signal.SIGKILL)
                    node.wait()
                    killed.set()
                    return
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()
        return killed

    def connect(self, superlink: str, credentials: Path | None = None) -> None:
        """The ``flwr`` connection :data:`CONNECTION` to ``superlink`` (TLS with the CA
        of ``credentials``, if given)."""
        entry: dict[str, object] = {"address": superlink}
        if credentials is None:
            entry["insecure"] = True
        else:
            entry["root-certificates"] = str((credentials / "ca.crt").resolve())
        (self.home / "config.toml").write_text(
            tomli_w.dumps({"superlink": {"default": CONNECTION, CONNECTION: entry}}),
            encoding="utf-8",
        )

    def submit(self, config: Path, run_dir: Path, watch: Callable[[], None] | None = None) -> None:
        """``flwr run`` of fedloom's app with ``config`` writing ``run_dir``; returns when
        the run ended (``watch`` is called about every second meanwhile)."""
        app = write_app(self.home / "app")
        overrides = f'config="{config.resolve()}" run-dir="{run_dir.resolve()}"'
        with (self.logs / "flwr-run.log").open("ab") as out:
            process = subprocess.Popen(
                ["flwr", "run", str(app), CONNECTION, "--run-config", overrides, "--stream"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        self.processes.append(process)
        while process.poll() is None:
            if watch:
                watch()
            time.sleep(1.0)
        if process.returncode != 0:
            raise DeploymentError(
                f"flwr run exited with status {process.returncode} "
                f"(see {self.logs / 'flwr-run.log'})"
            )

    def stop(self, grace: float = 10.0) -> None:
        """Stop every process started, and every process they spawned: SIGTERM first,
        SIGKILL after ``grace`` s. Flower's ``flower-superexec`` starts the ServerApp and
        ClientApp processes in sessions of their own, so these are found by the
        ``FLWR_HOME`` they inherited (:func:`processes_of`), not by process group."""
        for process in self.processes:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(process, signal.SIGKILL)
            process.wait()
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)
        self.folders.clear()
        deadline = time.monotonic() + grace
        while (left := processes_of(self.home)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        self.processes.clear()


def processes_of(home: Path) -> list[int]:
    """Live processes (not zombies) of this user whose environment has ``FLWR_HOME`` =
    ``home``: everything a :class:`Federation` started, however it was spawned (Linux
    ``/proc``; elsewhere none are found)."""
    marker = f"FLWR_HOME={home}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(") ", 1)[-1][:1]
        except OSError:
            continue
        if state != "Z" and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def supernode_command(
    client_id: int,
    superlink: str,
    data_dir: str | None = None,
    credentials: Path | None = None,
    data_file: str | None = None,
    device: str | None = None,
    config_file: str | None = None,
    threads: int | None = None,
    worker: str | None = None,
    *,
    checkpoint_dir: str | None = None,
) -> list[str]:
    """``flower-supernode`` for client ``client_id`` (node config ``client-id`` and, if
    given, ``data-dir``, ``data-file``, the client's own examples, ``device``, where it
    trains instead of the config's ``train.device``, ``config-file``, the node's own
    config that the server's must agree with, and ``threads``, its torch threads instead of
    ``runtime.cpus_per_worker``, and ``worker``, the folder of the node's worker socket,
    and ``checkpoint-dir``, the node's folder for its client's personal checkpoints);
    with ``credentials``, TLS against its ``ca.crt`` and, when it holds
    ``client_<id>.key``, that key for SuperNode authentication."""
    node_config = f"client-id={client_id}" + (f' data-dir="{data_dir}"' if data_dir else "")
    node_config += f' data-file="{data_file}"' if data_file else ""
    node_config += f' device="{device}"' if device else ""
    node_config += f' config-file="{config_file}"' if config_file else ""
    node_config += f" threads={threads}" if threads else ""
    node_config += f' checkpoint-dir="{checkpoint_dir}"' if checkpoint_dir else ""
    if worker:
        from fedloom.runtime.node_worker import SOCKET

        node_config += f' worker="{Path(worker) / SOCKET}"'
    security = ["--insecure"]
    if credentials is not None:
        security = ["--root-certificates", str(credentials / "ca.crt")]
        key = credentials / f"client_{client_id}.key"
        if key.is_file():
            security += ["--auth-supernode-private-key", str(key)]
    return [
        "flower-supernode",
        *security,
        "--superlink",
        superlink,
        "--port",
        str(free_port()),
        "--node-config",
        node_config,
    ]


def worker_folder() -> Path:
    """A new private folder (mode 0700) for a node worker's socket: under the system's
    temporary directory, as a Unix socket's path must stay short (about 100 bytes)."""
    return Path(tempfile.mkdtemp(prefix="fedloom-node-"))


def worker_command(folder: Path, watched: int) -> list[str]:
    """The node worker serving on ``folder`` until process ``watched`` is gone."""
    return [sys.executable, "-m", "fedloom.runtime.node_worker", str(folder), str(watched)]


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _round_watch(run_dir: Path, on_round: Callable[[int], None] | None) -> Callable[[], None]:
    """Calls ``on_round(k)`` when status.json first says round k is done."""
    seen = [0]

    def watch() -> None:
        done = int((read_status(run_dir) or {}).get("round", 0) or 0)
        if on_round and done > seen[0]:
            seen[0] = done
            on_round(done)

    return watch


def run_loopback(
    config: Path,
    run_dir: Path,
    client_ids: Sequence[int],
    on_round: Callable[[int], None] | None = None,
    workers: bool = True,
) -> None:
    """The run of ``config`` on a loopback federation: a SuperLink and one SuperNode per
    client on 127.0.0.1 (with its worker, unless ``workers`` is False), all stopped when
    the run ends (logs in ``run_dir/flower/logs``)."""
    with Federation(run_dir / "flower", (config, run_dir)) as federation:
        superlink = federation.start_superlink(free_port())
        for cid in client_ids:  # each node reads the run's config as its own: its paths
            federation.start_supernode(cid, superlink, worker=workers, config_file=config)
        federation.connect(superlink)
        federation.submit(config, run_dir, _round_watch(run_dir, on_round))


def run_served(
    config: Path,
    run_dir: Path,
    host: str,
    port: int,
    credentials: Path | None,
    on_round: Callable[[int], None] | None = None,
    announce: Callable[[str], None] | None = None,
) -> None:
    """The run of ``config`` with a SuperLink on ``host:port`` that SuperNodes on other
    machines join (``fedloom join``); TLS and SuperNode authentication with
    ``credentials``. The SuperLink stops when the run ends."""
    with Federation(run_dir / "flower", (config, run_dir)) as federation:
        superlink = federation.start_superlink(port, host, credentials)
        federation.connect(superlink, credentials)
        if credentials is not None:
            federation.register_nodes(credentials)
        if announce:
            announce(superlink)
        federation.submit(config, run_dir, _round_watch(run_dir, on_round))

"""fedloom's guard around Flower's processes: a federation fedloom starts runs fedloom's
apps only, and keeps the SuperLink's Control and Runtime APIs to its own machine.

Flower 1.42 runs whatever app a run names. Its SuperLink serves the Fleet, Control and
Runtime (ServerAppIo) APIs on one HTTP address, and its open-source edition has no
authentication on the Control API: anyone who reaches the address can ``flwr run`` an app
of their own, and its ``ServerApp`` runs on the server while its ``ClientApp`` runs on
every SuperNode. Flower's own answer on the node, ``flower-supernode --trusted-entities``,
verifies an app by the signature Flower Hub attaches to it; a FAB submitted by ``flwr
run`` from a folder carries none, so a node with trusted entities refuses fedloom's app
too. fedloom therefore guards the processes it starts itself, in three places:

- **The apps** (:func:`check_fab`, :func:`run_task`). Flower's SuperExec starts every app
  process by its command name on ``PATH`` (``flwr-serverapp``, ``flwr-clientapp``, ...).
  fedloom puts a folder of its own first on the ``PATH`` of the SuperLink and SuperNodes
  it starts (:func:`write_shims`): there, ``flwr-serverapp`` and ``flwr-clientapp`` are
  Flower's own programs with one check before the app is installed: the FAB must be
  fedloom's app project (:data:`APP_PROJECT`'s components,
  no dependencies, no file but its ``pyproject.toml``), so that the code that runs is the
  fedloom installed on the machine. A foreign FAB is refused before anything in it is
  unpacked: the node answers with Flower's error reply and the server's run fails.
  Every other kind of app process (agent, model, connector, simulation) is refused.
- **The SuperLink's APIs** (:class:`LoopbackOnly`). The SuperLink runs through
  :func:`main` (``python -m fedloom.runtime.app_guard superlink ARGS``), which adds, through
  Flower's extension hook for middleware, one rule before Flower's own: a request to the
  Control API (``/v1/control/``) or the Runtime API (``/v1/runtime/``) from an address
  other than the machine's loopback gets 403. Only the Fleet API, which SuperNodes use, is
  served to other machines.
- **The run** (:func:`check_pinned_run`). ``fedloom serve`` pins the one run it starts:
  the SuperLink's environment names its config and run directory, and fedloom's
  ``ServerApp`` refuses a run config naming others. Someone on the server machine who
  submits fedloom's app cannot make the server read a config or write a folder of theirs.

What it does not do: a user of the server machine can still list runs, read their logs
or stop them through the Control API on loopback (Flower's account authentication is in
its enterprise edition only); and behind a reverse proxy on the server machine every
request comes from loopback, so such a proxy must forward ``/v1/fleet/`` only.
"""

from __future__ import annotations

import importlib
import io
import ipaddress
import json
import os
import stat
import sys
import tomllib
import zipfile
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

#: fedloom's apps as a Flower app project: ``flwr run`` builds it into a FAB; the apps'
#: code is the installed fedloom on every machine (its dependencies are not installed at
#: run time)
APP_PROJECT = {
    "build-system": {"requires": ["setuptools>=68"], "build-backend": "setuptools.build_meta"},
    "project": {
        "name": "fedloom-app",
        "version": "1.0.0",
        "license": "Apache-2.0",
        "description": "fedloom's ServerApp and ClientApp",
        "dependencies": [],
    },
    "tool": {
        "flwr": {
            "app": {
                "publisher": "fedloom",
                "components": {
                    "serverapp": "fedloom.runtime.flower_app:server_app",
                    "clientapp": "fedloom.runtime.flower_client:client_app",
                },
                "config": {"config": "", "run-dir": ""},
            }
        }
    },
}
#: the FAB members of fedloom's app project (``flwr build`` adds the manifest)
APP_FILES = frozenset({"pyproject.toml", ".info/CONTENT"})
#: the app processes that run fedloom's app (the rest are refused) and the module whose
#: ``install_from_fab`` unpacks the FAB there
GUARDED_TASKS = {
    "flwr-serverapp": "flwr.superlink.runtime.run_serverapp",
    "flwr-clientapp": "flwr.supernode.runtime.run_clientapp",
}
#: every app process Flower's SuperExec starts by name (Flower 1.42's task types)
TASK_COMMANDS = (
    "flwr-serverapp",
    "flwr-clientapp",
    "flwr-agentapp",
    "flwr-model",
    "flwr-connector",
    "flwr-simulation",
)
#: the environment variable with the run ``fedloom serve`` pins: ``{"config", "run-dir"}``
PINNED_RUN = "FEDLOOM_PINNED_RUN"
#: the URL prefixes of the SuperLink's APIs that only its own machine may use
LOOPBACK_APIS = ("/v1/control/", "/v1/runtime/")


class ForeignAppError(RuntimeError):
    """A FAB that is not fedloom's app project."""


def check_fab(content: bytes) -> None:
    """Raise :class:`ForeignAppError` unless the FAB ``content`` is fedloom's app project:
    no file but its ``pyproject.toml`` (and Flower's manifest), fedloom's components and
    no dependencies to install."""
    try:
        with zipfile.ZipFile(io.BytesIO(content)) as fab:
            names = set(fab.namelist())
            extra = sorted(names - APP_FILES)
            if extra:
                raise ForeignAppError(f"the app is not fedloom's: it holds {', '.join(extra)}")
            project = tomllib.loads(fab.read("pyproject.toml").decode())
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ForeignAppError(f"the app is not fedloom's: {err}") from None
    app = project.get("tool", {}).get("flwr", {}).get("app", {})
    ours = APP_PROJECT["tool"]["flwr"]["app"]  # type: ignore[index]
    if app.get("components") != ours["components"]:
        raise ForeignAppError(
            f"the app is not fedloom's: its components are {app.get('components')}"
        )
    if project.get("project", {}).get("dependencies"):
        raise ForeignAppError("the app is not fedloom's: it asks for dependencies")


def _checked(install: Callable[..., Any]) -> Callable[..., Any]:
    def install_checked(content: bytes, *args: Any, **kwargs: Any) -> Any:
        check_fab(content)
        return install(content, *args, **kwargs)

    return install_checked


def run_task(command: str, argv: list[str]) -> int:
    """Run Flower's ``command`` (an app process) with ``argv``, refusing foreign apps;
    an app process fedloom never uses is refused outright (status 1)."""
    if command not in GUARDED_TASKS:
        print(f"fedloom: {command} refused: this machine runs fedloom's apps only", file=sys.stderr)
        return 1
    module = importlib.import_module(GUARDED_TASKS[command])
    module.install_from_fab = _checked(module.install_from_fab)  # type: ignore[attr-defined]
    sys.argv = [command, *argv]
    result = _entry_point(command)()
    return int(result or 0)


def _entry_point(command: str) -> Callable[[], Any]:
    (found,) = entry_points(group="console_scripts", name=command)
    loaded: Callable[[], Any] = found.load()
    return loaded


def write_shims(folder: Path) -> Path:
    """``folder`` (created, mode 0700) with an executable for every app process Flower
    starts by name, each running :func:`run_task`; put it first on ``PATH``."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for command in TASK_COMMANDS:
        path = folder / command
        path.write_text(
            f"#!{sys.executable}\n"
            "import sys\n"
            "from fedloom.runtime.app_guard import run_task\n"
            f"sys.exit(run_task({command!r}, sys.argv[1:]))\n",
            encoding="utf-8",
        )
        path.chmod(stat.S_IRWXU)
    return folder


def guarded_path(folder: Path, path: str) -> str:
    """``PATH`` with the shims of :func:`write_shims` in ``folder`` first, then this
    Python's executables."""
    bin_dir = str(Path(sys.executable).parent)
    return os.pathsep.join([str(write_shims(folder)), bin_dir, path])


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a peer's address) is this machine's loopback."""
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class LoopbackOnly:
    """ASGI middleware: 403 for a request to :data:`LOOPBACK_APIS` from a peer that is
    not on loopback."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(LOOPBACK_APIS):
            client = scope.get("client")
            if not is_loopback(client[0] if client else None):
                body = b"fedloom: this API is served to the SuperLink's own machine only"
                await send(
                    {
                        "type": "http.response.start",
                        "status": 403,
                        "headers": [(b"content-type", b"text/plain")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def check_pinned_run(config: str, run_dir: str) -> None:
    """Refuse (ValueError) a run whose ``config`` or ``run_dir`` is not the one pinned in
    :data:`PINNED_RUN` (``fedloom serve`` sets it; absent, nothing is pinned)."""
    pinned = os.environ.get(PINNED_RUN)
    if not pinned:
        return
    want = json.loads(pinned)
    got = {"config": str(Path(config).resolve()), "run-dir": str(Path(run_dir).resolve())}
    for key, value in got.items():
        if value != want[key]:
            raise ValueError(
                f"run config {key} = {value!r}: this SuperLink serves the run of {want[key]!r} only"
            )


def _superlink(argv: list[str]) -> int:
    from starlette.middleware import Middleware

    extensions = importlib.import_module("flwr.superlink.extensions")
    flower_middleware = extensions.get_middleware
    # Flower's hook for extension middleware (its enterprise edition's): ours goes first
    setattr(  # noqa: B010 - a module attribute mypy does not know of
        extensions, "get_middleware", lambda: (Middleware(LoopbackOnly), *flower_middleware())
    )
    sys.argv = ["flower-superlink", *argv]
    return int(_entry_point("flower-superlink")() or 0)


def main(argv: list[str] | None = None) -> None:
    """``python -m fedloom.runtime.app_guard superlink ARGS``: Flower's SuperLink with
    :class:`LoopbackOnly` in front of its APIs."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "superlink":
        raise SystemExit("usage: python -m fedloom.runtime.app_guard superlink ARGS")
    sys.exit(_superlink(args[1:]))


if __name__ == "__main__":
    main()

"""fedloom's federations run fedloom's apps only (:mod:`fedloom.runtime.app_guard`).

A foreign Flower app submitted with plain ``flwr run``: against fedloom's SuperLink its
ServerApp never runs; against an attacker's plain SuperLink (the malicious server), its
ClientApp never runs on fedloom's SuperNode. Each app leaves a marker file when its code
is imported, so "never runs" is checked, not inferred from a status.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import tomli_w

from fedloom.runtime.app_guard import (
    ForeignAppError,
    LoopbackOnly,
    check_fab,
    check_pinned_run,
    is_loopback,
)
from fedloom.runtime.flower_deploy import (
    APP_PROJECT,
    Federation,
    _wait_for_port,
    free_port,
    write_app,
)

pytest.importorskip("flwr")

FOREIGN_CODE = """
from pathlib import Path
from flwr.app import Message, RecordDict, ConfigRecord
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

MARKERS = Path({markers!r})

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def _main(grid, context):
    (MARKERS / "server-ran").write_text("foreign ServerApp code ran")
    nodes = []
    for _ in range(600):
        nodes = list(grid.get_node_ids())
        if nodes:
            break
        import time
        time.sleep(0.1)
    msgs = [Message(RecordDict({{"x": ConfigRecord({{"a": 1}})}}), dst_node_id=n,
                    message_type="query") for n in nodes]
    replies = list(grid.send_and_receive(msgs, timeout=60))
    (MARKERS / "server-replies").write_text(
        "\\n".join("error" if r.has_error() else "content" for r in replies)
    )


@client_app.query()
def _query(msg, context):
    (MARKERS / "client-ran").write_text("foreign ClientApp code ran")
    return Message(RecordDict(), reply_to=msg)
"""


def _foreign_app(folder: Path, markers: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "foreign.py").write_text(FOREIGN_CODE.format(markers=str(markers)))
    project = {
        "build-system": {"requires": ["setuptools>=68"], "build-backend": "setuptools.build_meta"},
        "project": {"name": "foreign", "version": "1.0.0", "dependencies": []},
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "mallory",
                    "components": {
                        "serverapp": "foreign:server_app",
                        "clientapp": "foreign:client_app",
                    },
                    "config": {},
                }
            }
        },
    }
    (folder / "pyproject.toml").write_text(tomli_w.dumps(project))
    return folder


def _fab(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as fab:
        for name, text in files.items():
            fab.writestr(name, text)
    return buffer.getvalue()


def _flwr_run(app: Path, superlink: str, home: Path, timeout: float = 120.0) -> str:
    """``flwr run`` of ``app`` as a stranger would: plain Flower, its own FLWR_HOME."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        tomli_w.dumps(
            {"superlink": {"default": "x", "x": {"address": superlink, "insecure": True}}}
        )
    )
    env = {**os.environ, "FLWR_HOME": str(home)}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    done = subprocess.run(
        ["flwr", "run", str(app), "x", "--stream"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.stdout


def test_fedlooms_own_app_passes_and_foreign_fabs_do_not(tmp_path: Path) -> None:
    app = write_app(tmp_path / "app")
    project = (app / "pyproject.toml").read_text()
    check_fab(_fab({"pyproject.toml": project, ".info/CONTENT": "x"}))
    with pytest.raises(ForeignAppError, match="evil.py"):
        check_fab(_fab({"pyproject.toml": project, "evil.py": "import os"}))
    other = {**APP_PROJECT, "tool": {"flwr": {"app": {"components": {"clientapp": "x:app"}}}}}
    with pytest.raises(ForeignAppError, match="components"):
        check_fab(_fab({"pyproject.toml": tomli_w.dumps(other)}))
    needy = {**APP_PROJECT, "project": {**APP_PROJECT["project"], "dependencies": ["evil"]}}
    with pytest.raises(ForeignAppError, match="dependencies"):
        check_fab(_fab({"pyproject.toml": tomli_w.dumps(needy)}))
    with pytest.raises(ForeignAppError):
        check_fab(b"not a zip")


def test_control_and_runtime_apis_answer_loopback_only() -> None:
    seen: list[str] = []

    async def flower(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = LoopbackOnly(flower)

    def status(path: str, peer: str) -> int:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "path": path, "client": (peer, 5000)}
        asyncio.run(guard(scope, None, send))
        return int(sent[0]["status"])

    assert status("/v1/control/start-run", "203.0.113.9") == 403
    assert status("/v1/runtime/pull-messages", "203.0.113.9") == 403
    assert status("/v1/control/start-run", "127.0.0.1") == 200
    assert status("/v1/control/start-run", "::1") == 200
    assert status("/v1/fleet/pull-messages", "203.0.113.9") == 200
    assert seen == ["/v1/control/start-run", "/v1/control/start-run", "/v1/fleet/pull-messages"]
    assert is_loopback("127.0.0.2") and not is_loopback("0.0.0.0") and not is_loopback(None)


def test_a_pinned_run_refuses_another_config(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(
        "FEDLOOM_PINNED_RUN",
        f'{{"config": "{tmp_path / "run/config.toml"}", "run-dir": "{tmp_path / "run"}"}}',
    )
    check_pinned_run(str(tmp_path / "run/config.toml"), str(tmp_path / "run"))
    with pytest.raises(ValueError, match="run config config"):
        check_pinned_run(str(tmp_path / "mine.toml"), str(tmp_path / "run"))
    with pytest.raises(ValueError, match="run config run-dir"):
        check_pinned_run(str(tmp_path / "run/config.toml"), "/etc")


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.2)
    return False


def test_a_foreign_app_is_refused_by_fedlooms_server(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    app = _foreign_app(tmp_path / "foreign", markers)
    with Federation(tmp_path / "fedloom") as federation:
        superlink = federation.start_superlink(free_port())
        _flwr_run(app, superlink, tmp_path / "mallory")
    assert not (markers / "server-ran").exists(), "the foreign ServerApp ran"


def test_a_foreign_app_is_refused_by_fedlooms_node(tmp_path: Path) -> None:
    """The malicious server: a plain Flower SuperLink, not fedloom's, runs a foreign app
    whose ServerApp queries fedloom's SuperNode; the node answers with Flower's error
    reply and the foreign ClientApp's code never runs there."""
    markers = tmp_path / "markers"
    markers.mkdir()
    app = _foreign_app(tmp_path / "foreign", markers)
    port = free_port()
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "mallory-link")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    link = subprocess.Popen(
        [
            "flower-superlink",
            "--insecure",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        ],
        env=env,
        stdout=(tmp_path / "mallory-link.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_for_port(port, link, 60.0, "the malicious SuperLink")
        with Federation(tmp_path / "fedloom") as federation:
            federation.start_supernode(0, f"127.0.0.1:{port}", worker=False)
            out = _flwr_run(app, f"127.0.0.1:{port}", tmp_path / "mallory")
            assert (markers / "server-ran").exists(), f"the malicious server did not run: {out}"
            assert _wait_for(markers / "server-replies", 5.0)
            node_log = (federation.logs / "supernode-0.log").read_text(errors="replace")
    finally:
        os.killpg(link.pid, 15)
        link.wait()
    assert not (markers / "client-ran").exists(), "the foreign ClientApp ran on the node"
    assert (markers / "server-replies").read_text().split() == ["error"]
    assert "not fedloom's" in node_log or "refused" in node_log


def test_a_server_or_node_off_loopback_needs_credentials_or_insecure(tmp_path: Path) -> None:
    from conftest import tiny_raw
    from typer.testing import CliRunner

    from fedloom.cli import app

    config = tmp_path / "tiny.toml"
    config.write_text(tomli_w.dumps(tiny_raw()))
    runner = CliRunner()
    open_server = runner.invoke(app, ["serve", str(config), "--host", "0.0.0.0"])
    assert open_server.exit_code == 2
    (line,) = open_server.stderr.strip().splitlines()
    assert "--host 0.0.0.0" in line and "--credentials" in line and "--insecure" in line
    both = runner.invoke(
        app, ["serve", str(config), "--insecure", "--credentials", str(tmp_path)]
    )
    assert both.exit_code == 2 and "--insecure" in both.stderr
    plain_node = runner.invoke(app, ["join", "--client-id", "0", "--superlink", "10.1.2.3:9092"])
    assert plain_node.exit_code == 2
    assert "--credentials" in plain_node.stderr and "--insecure" in plain_node.stderr
    assert not list(tmp_path.glob("runs*"))  # nothing started, nothing written

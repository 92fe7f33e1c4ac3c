"""A node's worker answers what the ClientApp would answer in its own process, carries the
node's state there and back, reports its failures as the node's, and exits with the
process it watches (issue 36). Whole deployments through workers: test_flower_runtime."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tomli_w
from conftest import tiny_raw

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, RecordDict

from fedloom.runtime import flower_node, node_worker
from fedloom.runtime.flower_node import PENDING, STATE, Hosts, apply_verdict
from fedloom.runtime.node_worker import SOCKET, WorkerError, ask


@pytest.fixture
def worker(tmp_path: Path):
    """A worker serving on a thread of this process; yields its socket's address."""
    done = threading.Event()
    folder = tmp_path / "w"
    thread = threading.Thread(
        target=node_worker.serve, args=(folder, os.getpid(), done.is_set),
        daemon=True)
    thread.start()
    yield str(folder / SOCKET)
    done.set()
    thread.join(timeout=10)


def _context(state: RecordDict | None = None, **node) -> Context:
    return Context(7, 9, {"client-id": 1, **node}, state or RecordDict(), {})


def _greeting(*overrides: str) -> RecordDict:
    return RecordDict({"fedloom": ConfigRecord({"config": tomli_w.dumps(tiny_raw(*overrides))})})


def test_a_greeting_through_the_worker_is_the_in_process_answer(worker: str, tmp_path) -> None:
    own = tmp_path / "site.toml"
    own.write_text(tomli_w.dumps(tiny_raw()))
    for content in (_greeting(), _greeting("train.lr=0.1")):
        context = _context(**{"config-file": str(own)})
        here = flower_node.answer("query", content, _context(**{"config-file": str(own)}), Hosts())
        there = ask(worker, "query", content, context)
        assert dict(there["fedloom"]) == dict(here["fedloom"])
    assert "train.lr: the server's 0.1, site.toml's 0.005" in there["fedloom"]["refusal"]


def test_the_nodes_state_travels_to_the_worker_and_back(worker: str, monkeypatch) -> None:
    def answer(kind, content, context, hosts):  # what a train message does to the state
        apply_verdict(context, str(content["fedloom"]["verdict"]))
        context.state[PENDING] = ConfigRecord({"blob": b"reached"})
        return RecordDict({"fedloom": ConfigRecord({"had": STATE in context.state})})

    monkeypatch.setattr(flower_node, "answer", answer)
    # the patched answer is taken when the worker starts: restart it
    state = RecordDict({PENDING: ConfigRecord({"blob": b"earlier"})})
    context = _context(state)
    done = threading.Event()
    folder = Path(worker).parent.parent / "w2"
    thread = threading.Thread(target=node_worker.serve, args=(folder, os.getpid(), done.is_set), daemon=True)
    thread.start()
    try:
        content = RecordDict({"fedloom": ConfigRecord({"verdict": "keep"})})
        reply = ask(str(folder / SOCKET), "train", content, context)
    finally:
        done.set()
        thread.join(timeout=10)
    assert reply["fedloom"]["had"] is True
    assert context.state[STATE]["blob"] == b"earlier"
    assert context.state[PENDING]["blob"] == b"reached"


def test_a_failure_in_the_worker_is_the_nodes_failure(worker: str) -> None:
    with pytest.raises(WorkerError, match="a node answers query, train, evaluate and secagg messages"):
        ask(worker, "fit", _greeting(), _context())


def test_without_a_worker_the_message_fails_naming_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(node_worker, "CONNECT_SECONDS", 0.3)
    with pytest.raises(WorkerError, match="the node's worker at .* is not there"):
        ask(str(tmp_path / "none.sock"), "query", _greeting(), _context())


def test_the_worker_exits_with_the_process_it_watches(tmp_path: Path) -> None:
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    folder = tmp_path / "w"
    worker = subprocess.Popen(
        [sys.executable, "-m", "fedloom.runtime.node_worker", str(folder), str(watched.pid)])
    try:
        deadline = time.monotonic() + 60
        while not (folder / SOCKET).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.poll() is None and folder.stat().st_mode & 0o777 == 0o700
        watched.kill()
        watched.wait()
        assert worker.wait(timeout=30) == 0
        assert not (folder / SOCKET).exists()
    finally:
        watched.kill()
        worker.kill()


def test_a_frame_above_its_limit_is_cut_off_unread(worker: str) -> None:
    """A peer announcing a 4 GiB header gets the connection closed: the worker neither
    reads nor allocates it, and goes on answering."""
    import socket
    import struct

    deadline = time.monotonic() + 30.0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        while True:  # the worker may still be starting, as ask() allows for
            try:
                sock.connect(worker)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        sock.sendall(struct.pack(">I", 0xFFFFFFFF) + b"x" * 64)
        sock.settimeout(10.0)
        try:
            answer = sock.recv(1)
        except ConnectionResetError:  # closed with our unread bytes in its buffer
            answer = b""
        assert answer == b""  # closed, no answer
    context = Context(1, 1, {"client-id": 0}, RecordDict(), {})
    with pytest.raises(WorkerError, match="ValueError"):  # still serving: an unknown kind
        ask(worker, "nonsense", RecordDict(), context)


def test_frames_are_bounded_in_both_directions() -> None:
    import socket
    import struct

    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack(">I", node_worker.MAX_HEADER + 1))
        with pytest.raises(ConnectionError, match="above the limit"):
            node_worker._receive(right, node_worker.FRAMES)
        left.sendall(struct.pack(">I", 2) + b"{}" + struct.pack(">I", node_worker.MAX_RECORDS + 1))
        with pytest.raises(ConnectionError, match="above the limit"):
            node_worker._receive(right, node_worker.FRAMES)

"""A node's long-lived worker: it answers the node's messages with the experiment built
once, so a Flower round costs training, not start-up.

Flower runs a ClientApp in a new process for every message (``flwr-clientapp``: start,
import, answer, exit); fedloom's answer needs torch, transformers and the built experiment
(data read, partitioned and tokenized, the backbone loaded), several seconds before any
training. ``fedloom join`` (and the loopback deployment) therefore starts, beside each
SuperNode, a worker process (:func:`serve`) that keeps the built hosts
(:class:`~fedloom.runtime.flower_node.Hosts`); the ClientApp, importing nothing heavy,
hands it the message (:func:`ask`) over a Unix socket in a private folder (mode 0700)
and returns its reply. The node's state stays in Flower's ``context.state``: it travels
to the worker with each message and back with each reply.

The wire: frames of a 4-byte big-endian length and that many bytes, in this order: a JSON
header (the message kind and the node config; back: an error or null), the content and
the node's state, each a Flower ``RecordDict`` in Flower's own protobuf serialization
(``flwr.common.serde``; no pickle). A frame longer than its limit (:data:`FRAMES`) ends the
connection before it is read. Flower has no long-lived ClientApp process to use
instead (``flwr-clientapp`` answers one message and exits).

The worker serves one message at a time (a node is one client) and exits when the
process it watches (the SuperNode, or ``fedloom join``) is gone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from fedloom.runtime.processes import alive

#: the socket's file name inside the worker's folder
SOCKET = "worker.sock"
#: seconds a ClientApp waits for a worker that is still starting
CONNECT_SECONDS = 60.0
#: seconds between the worker's checks that the watched process is alive
WATCH_SECONDS = 0.5
#: the largest JSON header and the largest record dict a frame may carry, in bytes: a
#: peer announcing more is cut off before anything is read or allocated (a record dict
#: holds one adapter payload or update: a rank-16 LoRA of an 8B decoder is ~170 MB)
MAX_HEADER, MAX_RECORDS = 1 << 20, 1 << 30
#: the limits of a message's three frames: header, content, state (both directions)
FRAMES = (MAX_HEADER, MAX_RECORDS, MAX_RECORDS)


class WorkerError(RuntimeError):
    """The node's worker is unreachable or failed to answer."""


def _send(sock: socket.socket, *frames: bytes) -> None:
    sock.sendall(b"".join(struct.pack(">I", len(f)) + f for f in frames))


def _receive(sock: socket.socket, limits: tuple[int, ...]) -> list[bytes]:
    """One frame for each entry of ``limits``, each at most that many bytes (a larger
    length is a ConnectionError, raised before its bytes are read)."""

    def exactly(n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = sock.recv(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError("the other end closed the connection mid-frame")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def frame(limit: int) -> bytes:
        size = int(struct.unpack(">I", exactly(4))[0])
        if size > limit:
            raise ConnectionError(f"a frame of {size} bytes, above the limit of {limit}")
        return exactly(size)

    return [frame(limit) for limit in limits]


def _to_bytes(records: RecordDict) -> bytes:
    return recorddict_to_proto(records).SerializeToString()


def _from_bytes(data: bytes) -> RecordDict:
    return recorddict_from_proto(ProtoRecordDict.FromString(data))


def ask(address: str, kind: str, content: RecordDict, context: Context) -> RecordDict:
    """The worker's reply to a message of ``kind`` with ``content``; ``context.state``
    becomes the state the worker returns. Raises WorkerError if it cannot be reached
    within :data:`CONNECT_SECONDS` or its answer failed."""
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
            break
        except (FileNotFoundError, ConnectionRefusedError) as err:
            sock.close()
            if time.monotonic() > deadline:
                raise WorkerError(f"the node's worker at {address} is not there: {err}") from None
            time.sleep(0.1)
    with sock:
        header: dict[str, Any] = {
            "kind": kind,
            "node_config": dict(context.node_config),
            "run_id": context.run_id,
            "node_id": context.node_id,
        }
        _send(sock, json.dumps(header).encode(), _to_bytes(content), _to_bytes(context.state))
        try:
            status, reply, state = _receive(sock, FRAMES)
        except ConnectionError as err:
            raise WorkerError(f"the node's worker at {address} stopped answering: {err}") from None
    error = json.loads(status)["error"]
    if error is not None:
        raise WorkerError(f"the node's worker failed: {error}")
    context.state = _from_bytes(state)
    return _from_bytes(reply)


def serve(folder: Path, watched: int, stop: Callable[[], bool] | None = None) -> None:
    """Answer the node's messages on ``folder``/:data:`SOCKET` until process ``watched``
    is gone (or ``stop()`` says so)."""
    from fedloom.runtime.flower_node import Hosts, answer

    hosts = Hosts()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    address = folder / SOCKET
    address.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(address))
        server.listen()
        server.settimeout(WATCH_SECONDS)
        while alive(watched) and not (stop and stop()):
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(None)
                _answer_one(conn, hosts, answer)
    address.unlink(missing_ok=True)


def _answer_one(conn: socket.socket, hosts: Any, answer: Callable[..., RecordDict]) -> None:
    try:
        head, content, state = _receive(conn, FRAMES)
    except ConnectionError:
        return
    header = json.loads(head)
    context = Context(
        header["run_id"], header["node_id"], header["node_config"], _from_bytes(state), {}
    )
    try:
        reply = answer(header["kind"], _from_bytes(content), context, hosts)
    except Exception as err:  # noqa: BLE001 - the ClientApp reports it as the node's failure
        traceback.print_exc(file=sys.stderr)
        _send(conn, json.dumps({"error": f"{type(err).__name__}: {err}"}).encode(), b"", b"")
        return
    _send(conn, json.dumps({"error": None}).encode(), _to_bytes(reply), _to_bytes(context.state))


def main(argv: list[str] | None = None) -> None:
    """``python -m fedloom.runtime.node_worker FOLDER WATCHED_PID``"""
    folder, watched = (argv or sys.argv[1:])[:2]
    # the node's log lines (e.g. each stage of secure aggregation it answered) in the
    # worker's log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        serve(Path(folder), int(watched))
    except KeyboardInterrupt:  # Ctrl-C in the terminal of `fedloom join`, which stops too
        sys.exit(130)


if __name__ == "__main__":
    main()

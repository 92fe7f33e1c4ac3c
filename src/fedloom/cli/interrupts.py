"""Stopping a command that holds Flower processes: SIGTERM unwinds as Ctrl-C does, and
the exit status says which of the two stopped it."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM received while this process holds Flower processes (exit status 143)."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM (``kill``, a job scheduler, a container stop) unwinds as
    Ctrl-C does, so that the Flower processes this process started (each in a session of
    its own, out of reach of a signal to this process's group) are stopped with it
    instead of orphaned; Python's default on SIGTERM is to exit on the spot."""

    def terminate(_signum: int, _frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt_status(err: KeyboardInterrupt) -> int:
    """The exit status of a run stopped by ``err``: 143 for SIGTERM, 130 for Ctrl-C."""
    return 143 if isinstance(err, Terminated) else 130

"""Whether a process runs: for a run directory's owner and a node worker's watched
process (a zombie, killed but not yet reaped by its parent, does not)."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs; on Linux a zombie does not (``/proc/PID/stat``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    stat = Path(f"/proc/{pid}/stat")  # the state follows the parenthesized name
    try:
        return stat.read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True

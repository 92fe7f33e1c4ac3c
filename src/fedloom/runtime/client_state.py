"""A client's persistent local state on disk: ``ctx.state`` as one safetensors file
(:mod:`fedloom.runtime.state_file`), with its round and client id in the metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedloom.runtime.state_file import load_state, save_state


def save_client_state(path: Path, state: dict[str, Any], round_: int, client_id: int) -> None:
    """Atomically write client ``client_id``'s ``state`` after round ``round_``."""
    save_state(path, state, {"round": str(round_), "client_id": str(client_id)})


def load_client_state(path: Path) -> dict[str, Any]:
    """The state :func:`save_client_state` wrote."""
    return load_state(path)[0]

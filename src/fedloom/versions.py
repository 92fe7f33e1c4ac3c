"""What made a run: the versions every run directory records in ``versions.json``.

A published number is reproducible only with the software that produced it: Python, the
platform, torch (and the CUDA it was built for), transformers, PEFT, Flower, Ray and
fedloom itself, with the git commit of a source checkout. ``constraints.txt`` pins what
``make`` installs; this file says what a given run actually had.
"""

from __future__ import annotations

import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

#: the distributions recorded (None where one is not installed)
PACKAGES = ("fedloom", "torch", "transformers", "peft", "safetensors", "flwr", "ray", "numpy")


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _commit() -> str | None:
    """The git commit of the source checkout fedloom runs from, with ``+dirty`` when it has
    uncommitted changes; None for an installed wheel or without git."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "src"],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def versions() -> dict[str, str | None]:
    """Python, the platform, the :data:`PACKAGES` and the source commit, for versions.json."""
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        **{name: _version(name) for name in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "fedloom_commit": _commit(),
    }

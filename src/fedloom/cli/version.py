"""The installed fedloom's version, as ``fedloom --version`` and a bug report show it."""

from __future__ import annotations


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedloom")
    except PackageNotFoundError:
        return "unknown (not installed)"

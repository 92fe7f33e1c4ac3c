"""``python -m fedloom.cli``: the ``fedloom`` command."""

from fedloom.cli import app

app()

"""``fedloom algorithms``: the algorithms and their hyperparameters, from the catalog."""

from __future__ import annotations

from typing import Annotated

import typer

from fedloom import algorithm_catalog
from fedloom.cli.errors import fail


def algorithms(
    name: Annotated[str | None, typer.Argument(help="show this algorithm only")] = None,
) -> None:
    """List the algorithms with their hyperparameters and defaults.

    An algorithm is chosen in the experiment file with [algorithm] name = "NAME", and
    its hyperparameters are set in the same section. Each line gives a hyperparameter,
    its default and what it accepts. Reads the packaged catalog only: fast, no model.

    Examples:
        fedloom algorithms
        fedloom algorithms fedprox
    """
    catalog = algorithm_catalog.load()
    if name is not None and name not in catalog:
        fail(algorithm_catalog.refusal(name, []) or "")
    for i, algorithm in enumerate(catalog if name is None else [name]):
        entry = catalog[algorithm]
        hps = entry["hyperparameters"]
        typer.echo(("\n" if i else "") + f"{algorithm}: {entry['description']}")
        if not hps:
            typer.echo("    (no hyperparameters)")
        width = max((len(h[0]) for h in hps), default=0)
        for hp, default, expected in hps:
            typer.echo(f"    {hp:<{width}}  {default:<10}  {expected}")

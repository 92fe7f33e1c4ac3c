"""``fedloom partition``: who holds what in a federation, before any training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fedloom.cli.config_file import config_overrides, load_checked
from fedloom.cli.consoles import err_console, out_console
from fedloom.cli.errors import fail
from fedloom.cli.options import DataDir, Overrides
from fedloom.cli.tables import partition_table
from fedloom.config import ConfigError


def partition(
    config: Annotated[
        Path,
        typer.Argument(
            help="experiment TOML file, or a run directory (its config; its clusters, if any)"
        ),
    ],
    set_: Overrides = None,
    data_dir: DataDir = None,
    clusters: Annotated[
        Path | None,
        typer.Option(help="a clustered run's directory: overlay its clusters on the true grouping"),
    ] = None,
    heatmap: Annotated[
        Path | None, typer.Option(help="clients x labels PNG (default: <name>-partition.png)")
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="also write the statistics")
    ] = None,
    round_: Annotated[
        int, typer.Option("--round", min=0, help="show drifting clients at this round")
    ] = 0,
    export: Annotated[
        Path | None,
        typer.Option(
            help="also write each client's examples to DIR/client_ID/{train,test}.jsonl, for "
            "nodes that hold their own data (fedloom join --data DIR/client_ID)"
        ),
    ] = None,
) -> None:
    """Partition the training data as CONFIG says and show who holds what.

    CONFIG is an experiment file, or a run directory (its config, and its clusters if a
    clustered method found some). No model is built and nothing is trained. The table
    gives each client's train and test sizes, its label histogram, how far its label mix
    is from the federation's (Jensen-Shannon divergence) and any task mix or concept
    shift; a heatmap of clients x labels is written as a PNG. With a clustered run, the
    table also shows which cluster each client was put in, and the adjusted Rand index
    of those clusters against the true grouping is printed.

    Examples:
        fedloom partition examples/noniid/label_quantity.toml
        fedloom partition examples/noniid/temporal.toml --round 6
        fedloom partition runs/ifca-20261122-130000
    """
    from fedloom.data import DataError, plot_label_heatmap
    from fedloom.federation import FederatedData

    if config.is_dir():
        if not (config / "config.toml").is_file():
            fail(f"{config}: a directory but not a run directory (no config.toml)")
        clusters = clusters or (config if _found_clusters(config, required=False) else None)
        config = config / "config.toml"
    found = _found_clusters(clusters, required=True) if clusters is not None else None
    try:
        cfg = load_checked(config, config_overrides(set_, data_dir))
        if round_ > cfg.federation.rounds:
            fail(
                f"--round: {round_} is past the last round (federation.rounds = "
                f"{cfg.federation.rounds})"
            )
        if cfg.runtime.client_data == "nodes":
            fail(
                'runtime.client_data: "nodes": each node holds its own data; there is no '
                "dataset here to partition"
            )
        if export is not None and (cfg.partition.tasks or cfg.partition.temporal):
            key = "tasks" if cfg.partition.tasks else "temporal"
            fail(
                f"--export: partition.{key} is a simulation of several tasks or of drift; "
                f"nodes with their own data hold one task's examples that do not move"
            )
        data = FederatedData.build(cfg)
        if export is not None:
            from fedloom.node_data import export_partition

            folders = export_partition(
                {
                    s.client_id: (data.examples(s, s.train), data.examples(s, s.test))
                    for s in data.splits
                },
                cfg.data,
                data.task,
                export,
            )
    except (ConfigError, DataError) as err:
        fail(str(err))
    if export is not None:
        err_console.print(f"{len(folders)} clients' examples: {export}/client_*/")
    stats = data.stats(round_)
    out_console.print(partition_table(stats, found))
    if found is not None:
        from fedloom.diagnostics.clusters import adjusted_rand, true_groups

        ari = adjusted_rand(found, true_groups(stats))
        out_console.print(
            "adjusted Rand index of the clusters found: "
            + ("— (the federation has a single true group)" if ari is None else f"{ari:.3f}")
        )
    path = plot_label_heatmap(
        data.label_counts(round_),
        data.label_names,
        heatmap or Path(f"{cfg.name}-partition.png"),
        title=f"{cfg.name}: training labels per client" + (f" (round {round_})" if round_ else ""),
    )
    err_console.print(f"heatmap: {path}")
    if json_out is not None:
        from fedloom.runtime.rundir import atomic_write

        atomic_write(json_out, json.dumps(stats, indent=1).encode())
        err_console.print(f"statistics: {json_out}")


def _found_clusters(run_dir: Path, *, required: bool) -> dict[str, int] | None:
    """The final ``clusters`` of a run's summary.json (None, or an error when required)."""
    summary = run_dir / "summary.json"
    try:
        found = json.loads(summary.read_text(encoding="utf-8")).get("clusters")
    except (OSError, ValueError) as err:
        if not required:
            return None
        fail(f"--clusters: {summary}: cannot read it ({err})")
    if found is None and required:
        fail(
            f"--clusters: {summary}: the run found no clusters (a clustered method such "
            "as ifca, cfl or fedem writes them)"
        )
    return found

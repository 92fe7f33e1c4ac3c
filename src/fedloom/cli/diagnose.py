"""``fedloom diagnose``: how heterogeneous a federation is, measured before training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fedloom.cli.config_file import config_overrides, load_checked
from fedloom.cli.consoles import err_console, out_console
from fedloom.cli.errors import fail
from fedloom.cli.options import ConfigFile, DataDir, Overrides
from fedloom.cli.tables import diagnosis_table
from fedloom.config import ConfigError


def diagnose(
    config: ConfigFile,
    set_: Overrides = None,
    data_dir: DataDir = None,
    batches: Annotated[int, typer.Option(min=1, help="gradient batches per client")] = 8,
    examples: Annotated[
        int, typer.Option(min=2, help="examples per client for the embedding probes")
    ] = 128,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write every number")] = None,
) -> None:
    """Measure CONFIG's federation at the initial model and advise on methods.

    No training: at the model as built, fedloom measures each client's label skew, the
    spread of the client sizes, the tasks they hold, how far each client's gradient is
    from the mean gradient (G² and B²), each client's feature shift and how well its
    labels agree with the other clients' (concept shift), then names the heterogeneity it
    sees and the methods that fit it.

    Example:
        fedloom diagnose examples/noniid/concept_shift.toml --json diagnosis.json
    """
    from fedloom.data import DataError

    try:
        cfg = load_checked(config, config_overrides(set_, data_dir))
    except ConfigError as err:
        fail(str(err))
    # the model and the diagnostics load torch: only once the config's names are checked
    from fedloom.diagnose import diagnose as run_diagnosis
    from fedloom.experiment import Experiment
    from fedloom.runtime.rundir import atomic_write

    try:
        exp = Experiment.build(cfg)
        diagnosis = run_diagnosis(exp, batches=batches, examples_per_client=examples)
    except (ConfigError, DataError) as err:
        fail(str(err))
    except ValueError as err:
        fail(f"diagnose: {err}")
    result = diagnosis.to_dict()
    out_console.print(diagnosis_table(result))
    g = result["gradient"]

    def b2(value: float | None) -> str:
        return "undefined (mean gradient 0)" if value is None else f"{value:.3f}"

    out_console.print(
        f"gradient dissimilarity G² = {g['g2']:.4g}, B² = {b2(g['b2'])}, "
        f"‖∇F‖ = {g['mean_gradient_norm']:.4g}"
    )
    if g.get("g2_debiased") is not None:
        out_console.print(
            f"without minibatch noise: G² = {g['g2_debiased']:.4g}, "
            f"B² = {b2(g['b2_debiased'])} (noise share of G² {g['noise_share']:.2f})"
        )
    out_console.print(diagnosis.advice.render(), highlight=False)
    if json_out is not None:
        atomic_write(json_out, json.dumps(result, indent=1).encode())
        err_console.print(f"measurements: {json_out}")

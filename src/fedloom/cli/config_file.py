"""An experiment file as the commands read it: the command line's overrides applied and
its names checked against the algorithm catalog, before anything imports torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedloom import algorithm_catalog
from fedloom.config import load_config


def load_checked(config: Path, overrides: list[str]) -> Any:
    """``config`` with ``overrides``, its algorithm name and hyperparameter names checked
    against the catalog before anything imports torch (a misspelt name answers at once)."""
    cfg = load_config(config, overrides)
    algorithm_catalog.check(cfg.algorithm.name, cfg.algorithm.hyperparameters)
    return cfg


def config_overrides(set_: list[str] | None, data_dir: Path | None) -> list[str]:
    """The ``--set`` items, then ``--data-dir`` as ``data.data_dir``."""
    overrides = list(set_ or [])
    if data_dir is not None:
        overrides.append(f"data.data_dir={json.dumps(str(data_dir))}")
    return overrides

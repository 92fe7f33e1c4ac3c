"""The ``local`` baseline: every client of the run trains alone, nothing shared.

The run's configuration with ``algorithm.name = "local"`` and everything that only a
sharing algorithm uses taken out (the algorithm's hyperparameters, ``[aggregation]``,
``[[transforms]]``, client-level privacy): the same federation, seed, model, local
training (``[train]``, DP-SGD included) and number of rounds. Each client therefore
trains ``rounds`` times the run's local steps on its own data, the budget its local
training had in the run (a method that fine-tunes at the end, like FedAvg-FT, spends a
few passes more). It runs after the run's last round, as a run directory of its own
(``RUN_DIR/baselines/local/``), and its clients' scores (the ``personal`` entry of its
summary) become the ``local`` entry of the run's summary.json.
"""

from __future__ import annotations

from typing import Any

from fedloom.attacks import create
from fedloom.config import ExperimentConfig, to_toml_dict, validate

#: the sections only an algorithm that shares something reads
_SHARING_SECTIONS = ("aggregation", "transforms")


def local_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with every client training alone (see the module docstring); no baselines
    of its own, and no Self / Others scores."""
    raw: dict[str, Any] = to_toml_dict(cfg)
    raw["name"] = f"{cfg.name}-local"
    raw["algorithm"] = {"name": "local"}
    for section in _SHARING_SECTIONS:
        raw.pop(section, None)
    if cfg.privacy.level == "client":
        raw.pop("privacy", None)
    if cfg.attack.name != "none":
        # a boost of the shared update has none to boost; an attack that still forges
        # updates without it has nothing to act on, and data poisoning stays
        raw["attack"].pop("boost", None)
        unboosted = {k: v for k, v in cfg.attack.hyperparameters.items() if k != "boost"}
        if create(cfg.attack.name, **unboosted).forges_updates:
            raw.pop("attack")
    raw["eval"] = {**raw.get("eval", {}), "baselines": [], "others": "never"}
    return validate(raw)

"""Every shipped example config is valid: schema, algorithm and hyperparameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedloom.config import load_config
from fedloom.experiment import build_algorithm

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
#: experiment files (examples/flower/pyproject.toml is a Flower app project, tested below)
EXAMPLES = sorted(p for p in EXAMPLES_DIR.rglob("*.toml") if p.name != "pyproject.toml")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path: Path) -> None:
    cfg = load_config(path)
    build_algorithm(cfg)


def test_the_main_job_is_personalized() -> None:
    """`make run` must show global and personal adapters side by side."""
    alg = build_algorithm(load_config(EXAMPLES_DIR / "quickstart.toml"))
    assert alg.personalized and alg.has_global


def test_the_flower_app_project_is_fedlooms() -> None:
    """`flwr run examples/flower` runs the apps `fedloom run` deploys."""
    import tomllib

    from fedloom.runtime.flower_deploy import APP_PROJECT

    project = tomllib.loads((EXAMPLES_DIR / "flower" / "pyproject.toml").read_text())
    assert project == APP_PROJECT

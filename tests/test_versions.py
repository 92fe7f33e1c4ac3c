"""versions.json: every run directory records what made it."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch
from conftest import needs_glue, tiny_config

from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate
from fedloom.versions import PACKAGES, versions


def test_versions_name_python_torch_and_every_recorded_package() -> None:
    found = versions()
    assert found["python"] == platform.python_version()
    assert found["torch"] is not None and found["torch"].startswith(torch.__version__[:4])
    assert set(PACKAGES) <= set(found) and found["torch_cuda"] == torch.version.cuda


@needs_glue
def test_a_run_directory_records_its_versions(tmp_path: Path) -> None:
    cfg = tiny_config("federation.rounds=1", output_dir=tmp_path)
    run = RunDir.create(cfg.output_dir, cfg.name)
    simulate(Experiment.build(cfg), run)
    recorded = json.loads((run.path / "versions.json").read_text())
    assert recorded == json.loads(json.dumps(versions()))

"""Checkpoint and resume: a run stopped anywhere and resumed ends with exactly the
metrics.jsonl and summary.json of an uninterrupted run (wall_seconds aside), for a server
optimizer with persistent client optimizer state, personalized, clustered and mixed-rank
methods, and compression's error-feedback residuals; damaged checkpoints are detected and
the previous one is used; server states round-trip through their file bit for bit and type
for type."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import identical, needs_glue, tiny_raw

from fedloom.algorithms import ServerState
from fedloom.algorithms.cfl import Split
from fedloom.config import validate
from fedloom.experiment import Experiment
from fedloom.runtime.checkpoint import RESUME_DIR, ResumeError, load_point
from fedloom.runtime.rundir import RunDir
from fedloom.runtime.state_file import load_state, save_state
from fedloom.server import simulate

ROUNDS = 4
FEDADAM = ["algorithm.name=fedadam", "algorithm.eta=0.01", "train.optimizer_state=persist"]
CASES = {
    # with DP-SGD: each client's count of its steps, behind the epsilon it reports, is
    # client state (the Ray runtime's resume test has DP-FedAvg's server state). Accounted
    # by RDP: its epsilon grows with the steps as PLD's does, and a run takes a quarter of
    # the time (PLD's composition of Poisson-sampled steps is checked in test_privacy)
    "fedadam": [*FEDADAM, "privacy.level=sample", "privacy.noise_multiplier=1.0",
                "privacy.accountant=rdp"],
    "scaffold": ["algorithm.name=scaffold"],
    "ditto": ["algorithm.name=ditto", "train.optimizer_state=persist"],
    "ifca": ["algorithm.name=ifca", "algorithm.num_clusters=2"],
    "cfl": ["algorithm.name=cfl"],
    "fedmosaic": ["algorithm.name=fedmosaic"],
    # which clients hold their adapter (and are sent nothing) is server state
    "local (half the clients a round)": ["algorithm.name=local", "federation.fraction=0.5"],
    "hetlora (ranks 2 / 4 / 8)": ["algorithm.name=hetlora", "algorithm.gamma=0.9",
                                  "model.lora.r=4", "model.lora.alpha=8"],
    # the error-feedback residual is client state: lost on resume, the outputs would differ
    "top-k with error feedback": [],
    # the downlink's per-client references are the chain's server state (and client state)
    "downlink compression": ["federation.fraction=0.5"],
    # a generative task: the personal adapters' generated samples and scores resume too
    "generative (ditto, mrpc-generate)": [
        "algorithm.name=ditto", 'data.task="mrpc-generate"', 'model.backbone="tiny-llama"',
        "eval.generation.max_new_tokens=3", 'eval.others="never"'],
    # centered clipping's v (the last aggregate update) is server state, next to FedAvgM's
    "centered clipping (fedavgm)": ["algorithm.name=fedavgm", "algorithm.server_momentum=0.5",
                                    "aggregation.rule=centered_clipping"],
}
#: the [[transforms]] of a case
TRANSFORMS = {
    "top-k with error feedback": [{"name": "compress", "compressor": "topk", "ratio": 0.05}],
    "downlink compression": [{"name": "compress_down", "compressor": "qsgd", "levels": 8}],
}
RANKS = [{"clients": [0], "r": 2}, {"clients": [1], "r": 8}]


class Stop(Exception):
    """Stands for a crash at a chosen point."""


def _config(tmp: Path, *overrides: str, transforms: list | None = None):
    raw = tiny_raw(f"federation.rounds={ROUNDS}", "eval.every=2", "partition.num_clients=4",
                   "data.max_train_examples=80", *overrides, output_dir=tmp)
    raw["transforms"] = transforms or []
    if raw["algorithm"]["name"] == "hetlora":
        raw["model"]["ranks"] = RANKS
    return validate(raw)


def _outputs(run: Path) -> tuple[list[str], dict, str | None]:
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("wall_seconds")
    samples = run / "samples.jsonl"  # a generative run's sample generations
    return (run / "metrics.jsonl").read_text().splitlines(), summary, (
        samples.read_text() if samples.exists() else None)


def _stop_at(round_: int, client: int):
    def hook(kind: str, done: int, total: int) -> None:
        if kind == "client" and done == client and hook.rounds == round_ - 1:
            raise Stop
        if kind == "round":
            hook.rounds = done
    hook.rounds = 0
    return hook


@needs_glue
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_run_stopped_mid_round_resumes_to_the_uninterrupted_outputs(
        name: str, tmp_path: Path) -> None:
    cfg = _config(tmp_path, *CASES[name], transforms=TRANSFORMS.get(name))
    whole = RunDir.create(tmp_path / "whole", cfg.name)
    simulate(Experiment.build(cfg), whole)
    broken = RunDir.create(tmp_path / "broken", cfg.name)
    with pytest.raises(Stop):  # in round 3, after its first client trained
        simulate(Experiment.build(cfg), broken, _stop_at(3, 1))
    assert not (broken.path / "summary.json").exists()
    # a fresh experiment and run directory object, as a new process has them
    simulate(Experiment.build(cfg), RunDir(broken.path), resume=True)
    assert _outputs(broken.path) == _outputs(whole.path)
    assert json.loads((broken.path / "status.json").read_text())["state"] == "finished"


@needs_glue
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path) -> None:
    cfg = _config(tmp_path, *FEDADAM)
    whole = RunDir.create(tmp_path / "whole", cfg.name)
    simulate(Experiment.build(cfg), whole)
    broken = RunDir.create(tmp_path / "broken", cfg.name)
    with pytest.raises(Stop):
        simulate(Experiment.build(cfg), broken, _stop_at(4, 2))
    root = broken.checkpoints / RESUME_DIR
    assert sorted(p.name for p in root.iterdir()) == ["round_0002", "round_0003"]
    server = root / "round_0003" / "server.safetensors"
    blob = bytearray(server.read_bytes())
    blob[-3] ^= 0xFF  # one flipped bit in the tensor bytes
    server.write_bytes(bytes(blob))
    point, skipped = load_point(RunDir(broken.path))
    assert point.round == 2 and len(skipped) == 1 and "round_0003" in skipped[0]
    assert "checksum" in skipped[0]
    simulate(Experiment.build(cfg), RunDir(broken.path), resume=True)
    assert _outputs(broken.path) == _outputs(whole.path)
    assert "round_0003: not used" in (broken.path / "run.log").read_text()


def test_a_run_without_checkpoints_cannot_resume(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "x")
    with pytest.raises(ResumeError, match="no checkpoints/resume/round_"):
        load_point(run)


def _same_types(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_types(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return all(_same_types(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return all(_same_types(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return True


def test_server_states_round_trip_bit_for_bit_and_type_for_type(tmp_path: Path) -> None:
    shared = torch.randn(3, 4)
    split = Split(cluster=0, child=1, start={"w": shared},
                  directions=(torch.randn(5), torch.randn(5)))
    state = {"": ServerState(round=3, global_params={"w": shared, "v": shared[1]}, extra={
        "splits": [split], "assignment": {0: 1, 7: 0}, "seeded": True,
        "similarity": np.eye(2), "lam": np.float64(0.25), "ids": (3, 5), "none": None})}
    save_state(tmp_path / "s.safetensors", state, {"round": "3"})
    back, meta = load_state(tmp_path / "s.safetensors")
    assert meta == {"round": "3"}
    assert _same_types(state, back)
    restored = back[""]
    assert identical(restored.global_params, state[""].global_params)
    assert identical(restored.extra["splits"][0].directions, split.directions)
    assert np.array_equal(restored.extra["similarity"], np.eye(2))
    # one tensor reached twice is stored once and comes back as one tensor
    assert restored.extra["splits"][0].start["w"] is restored.global_params["w"]


def test_only_fedloom_dataclasses_are_rebuilt(tmp_path: Path) -> None:
    import dataclasses

    @dataclasses.dataclass
    class Outside:
        x: int

    Outside.__module__ = "os"
    save_state(tmp_path / "s.safetensors", {"a": Outside(1)})
    with pytest.raises(ValueError, match="not fedloom's"):
        load_state(tmp_path / "s.safetensors")


@needs_glue
@pytest.mark.slow
def test_sigkill_at_a_random_point_then_resume_from_the_command_line(tmp_path: Path) -> None:
    """A real process killed with SIGKILL after a random number of finished rounds (so
    somewhere inside the next one), resumed with ``fedloom run --resume``."""
    raw = tiny_raw(f"federation.rounds={ROUNDS}", "partition.num_clients=4",
                   "data.max_train_examples=80", *FEDADAM, output_dir=tmp_path / "runs")
    import tomli_w

    config = tmp_path / "exp.toml"
    config.write_text(tomli_w.dumps(raw))
    whole = RunDir.create(tmp_path / "whole", "tiny")
    simulate(Experiment.build(validate(raw)), whole)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "fedloom.cli"]
    proc = subprocess.Popen([*cli, "run", "--no-report", str(config), "--quiet"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after = int(np.random.default_rng().integers(1, ROUNDS))
    deadline = time.monotonic() + 300
    run_dir = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((tmp_path / "runs").glob("tiny-*/status.json"))
        if found:
            run_dir = found[0].parent
            status = json.loads(found[0].read_text() or "{}")
            if status.get("round", 0) >= kill_after:
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert run_dir is not None
    done = subprocess.run([*cli, "run", "--no-report", "--resume", str(run_dir), "--quiet"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert _outputs(run_dir) == _outputs(whole.path)


@needs_glue
def test_resume_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fedloom.cli import app

    def invoke(*args: object):
        return CliRunner().invoke(app, ["run", *map(str, args)], catch_exceptions=False)

    cfg = _config(tmp_path / "runs", "federation.rounds=1")
    finished = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(Experiment.build(cfg), finished)
    result = invoke("--resume", finished.path)
    assert result.exit_code == 2 and "finished after round 1; nothing to resume" in result.stderr
    result = invoke("--resume", tmp_path)
    assert result.exit_code == 2 and "is not a run directory (no config.toml)" in result.stderr
    result = invoke(finished.path / "config.toml", "--resume", finished.path)
    assert result.exit_code == 2 and "give no CONFIG, --set or --output-dir" in result.stderr
    (finished.path / "status.json").write_text(json.dumps({"state": "failed", "round": 0}))
    shutil.rmtree(finished.checkpoints / RESUME_DIR)
    result = invoke("--resume", finished.path)
    assert result.exit_code == 2 and "cannot resume: it has no checkpoints/resume" in result.stderr

"""Checkpoints carry a checksum; a damaged one is reported, never used, and ``fedloom eval``
falls back to the previous good checkpoint where there is one (issue 8)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import tomli_w
import torch
from conftest import GLUE_DIR, require_glue, tiny_raw
from safetensors.torch import save
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.config import load_config
from fedloom.data import get_task, load_glue
from fedloom.evaluation.score import evaluate
from fedloom.models.fedmodel import FedModel
from fedloom.runtime.rundir import (
    CHECKSUM_KEY,
    CheckpointError,
    RunDir,
    load_checkpoint,
    load_params,
    previous_checkpoint,
    save_params,
)

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lora_A": torch.randn(4, 8, generator=g), "head.bias": torch.randn(3, generator=g)}


def flip(offset: Callable[[bytes], int]) -> Callable[[bytes], bytes]:
    def damage(blob: bytes) -> bytes:
        i = offset(blob)
        return blob[:i] + bytes([blob[i] ^ 0x01]) + blob[i + 1:]

    return damage


def header_end(blob: bytes) -> int:
    return 8 + int.from_bytes(blob[:8], "little")


DAMAGE = {
    "emptied": lambda blob: b"",
    "truncated-to-5-bytes": lambda blob: blob[:5],
    "truncated-in-header": lambda blob: blob[:header_end(blob) // 2],
    "truncated-in-tensors": lambda blob: blob[:-10],
    "bit-flip-in-length": flip(lambda blob: 0),
    "bit-flip-in-header": flip(lambda blob: 20),
    "bit-flip-in-round": flip(lambda blob: blob.index(b'"round":"') + 9),
    "bit-flip-in-tensors": flip(lambda blob: header_end(blob) + 13),
    "bit-flip-in-last-byte": flip(lambda blob: len(blob) - 1),
}


def test_round_trip_with_metadata(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    save_params(path, params(), {"round": "3"})
    tensors, meta = load_checkpoint(path)
    assert meta == {"round": "3"}  # the checksum is not part of what a caller sees
    assert all(torch.equal(tensors[k], v) for k, v in params().items())
    assert CHECKSUM_KEY in json.loads(path.read_bytes()[8:header_end(path.read_bytes())])["__metadata__"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_is_reported_in_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "global.safetensors"
    save_params(path, params(), {"round": "3"})
    path.write_bytes(DAMAGE[kind](path.read_bytes()))
    with pytest.raises(CheckpointError) as err:
        load_params(path)
    message = str(err.value)
    assert message.startswith(f"{path}: damaged checkpoint") and "\n" not in message


def test_a_checkpoint_without_checksum_still_loads(tmp_path: Path) -> None:
    """Run directories from before checksums: safetensors' own checks only."""
    path = tmp_path / "old.safetensors"
    path.write_bytes(save(params(), metadata={"round": "1"}))
    tensors, meta = load_checkpoint(path)
    assert meta == {"round": "1"} and torch.equal(tensors["lora_A"], params()["lora_A"])
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="damaged checkpoint"):
        load_params(path)


def test_the_previous_good_checkpoint_is_kept(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.save_global(params(1), 1)
    assert not previous_checkpoint(run.checkpoints / "global.safetensors").exists()
    run.save_global(params(2), 2)
    prev = run.checkpoints / "global.prev.safetensors"
    tensors, meta = load_checkpoint(prev)
    assert meta["round"] == "1" and torch.equal(tensors["lora_A"], params(1)["lora_A"])
    # a damaged newest file never becomes the fallback
    current = run.checkpoints / "global.safetensors"
    current.write_bytes(current.read_bytes()[:-1])
    run.save_global(params(3), 3)
    assert load_checkpoint(prev)[1]["round"] == "1"
    assert load_checkpoint(current)[1]["round"] == "3"
    # personal adapters keep theirs in personal.prev/, out of personal/'s listing
    run.save_personal(4, params(4), 1)
    run.save_personal(4, params(5), 2)
    assert [p.name for p in (run.checkpoints / "personal").iterdir()] == ["client_004.safetensors"]
    assert load_checkpoint(run.checkpoints / "personal.prev" / "client_004.safetensors")[1] == {
        "round": "1", "client_id": "4"}
    assert not [p for p in run.checkpoints.rglob("*") if p.name.endswith(".tmp")]


# --- fedloom eval on damaged checkpoints ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_glue()
    tmp = tmp_path_factory.mktemp("ckpt_eval")
    config = tmp / "tiny.toml"
    config.write_text(tomli_w.dumps(tiny_raw()))
    result = invoke("run", "--no-report", config, "--output-dir", tmp / "runs", "--quiet")
    assert result.exit_code == 0, result.stderr
    (run,) = [p for p in (tmp / "runs").iterdir() if p.is_dir()]
    assert (run / "checkpoints" / "global.prev.safetensors").is_file()  # round 1's
    return run


@pytest.fixture(scope="module")
def prev_scores(tiny_run: Path) -> dict:
    """The previous (round-1) checkpoint's scores on MRPC dev, computed without the CLI."""
    cfg = load_config(tiny_run / "config.toml")
    model = FedModel.build(cfg.model, get_task("MRPC"), cfg.data.max_length, cfg.seed)
    features = model.encode(load_glue("MRPC", "dev", GLUE_DIR))
    return evaluate(model, load_params(tiny_run / "checkpoints" / "global.prev.safetensors"),
                    features, 64)


@pytest.mark.parametrize("kind", ["emptied", "truncated-in-tensors", "bit-flip-in-tensors"])
def test_eval_falls_back_to_the_previous_good_checkpoint(
    tiny_run: Path, prev_scores: dict, tmp_path: Path, kind: str
) -> None:
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    newest = run / "checkpoints" / "global.safetensors"
    newest.write_bytes(DAMAGE[kind](newest.read_bytes()))
    result = invoke("eval", run, "--data", GLUE_DIR)
    assert result.exit_code == 0, result.stderr
    scores = json.loads(result.stdout)["global"]
    assert scores["accuracy"] == prev_scores["accuracy"] and scores["n"] == 408
    assert scores["loss"] == pytest.approx(prev_scores["loss"], rel=1e-6)
    warning = next(line for line in result.stderr.splitlines() if line.startswith("warning:"))
    assert str(newest) in warning and "damaged checkpoint" in warning
    assert f"{run / 'checkpoints' / 'global.prev.safetensors'} (round 1)" in warning
    damaged_round = "unknown" if kind == "emptied" else "2"
    assert f"instead of global.safetensors (round {damaged_round})" in warning
    assert "global.prev.safetensors from round 1 of 2" in result.stderr


@pytest.mark.parametrize("kind", ["emptied", "truncated-in-header", "bit-flip-in-tensors"])
def test_eval_without_a_good_checkpoint_exits_2_in_one_line(
    tiny_run: Path, tmp_path: Path, kind: str
) -> None:
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    newest = run / "checkpoints" / "global.safetensors"
    newest.write_bytes(DAMAGE[kind](newest.read_bytes()))
    (run / "checkpoints" / "global.prev.safetensors").unlink()
    result = invoke("eval", run, "--data", GLUE_DIR)
    assert result.exit_code == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {newest}: damaged checkpoint"), lines
    assert "no previous checkpoint to fall back on" in lines[0]
    assert "Traceback" not in result.stderr


def test_eval_when_both_checkpoints_are_damaged(tiny_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    for name in ("global.safetensors", "global.prev.safetensors"):
        path = run / "checkpoints" / name
        path.write_bytes(DAMAGE["bit-flip-in-last-byte"](path.read_bytes()))
    result = invoke("eval", run, "--data", GLUE_DIR)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "global.safetensors" in lines[0]
    assert "the previous one is damaged too" in lines[0] and "global.prev.safetensors" in lines[0]


def test_eval_of_a_checkpoint_that_does_not_fit_the_model(tiny_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    save_params(run / "checkpoints" / "global.safetensors", params(), {"round": "2"})
    result = invoke("eval", run, "--data", GLUE_DIR)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "does not fit the run's model" in lines[-1]
    assert "Traceback" not in result.stderr

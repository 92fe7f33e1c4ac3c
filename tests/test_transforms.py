"""The transform chain (``[[transforms]]``): update clipping and half-precision upload
against their definitions, the chain's order (up in order, back in reverse), config
mistakes named by key, and a real run where the chain sits between clients and server:
half precision halves ``bytes_up``, clipping bounds every client's drift."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from conftest import needs_glue, tiny_raw

from fedloom.config import ConfigError, validate
from fedloom.experiment import Experiment, build_algorithm
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate
from fedloom.transforms import Chain, ClipUpdate, HalfPrecision, Served, Transform, chain


def test_clip_update_scales_the_update_to_the_norm_bound() -> None:
    payload = {"a": torch.zeros(3), "b": torch.ones(2), "head": torch.zeros(1)}
    update = {"a": torch.tensor([3.0, 0.0, 0.0]), "b": torch.tensor([1.0, 5.0]),
              "extra": torch.full((2,), 7.0)}  # ‖Δ‖ = ‖(3, 0, 0, 0, 4)‖ = 5
    out = ClipUpdate(max_norm=1.0).up(update, payload, 0, 0, {})
    delta = torch.cat([out["a"] - payload["a"], out["b"] - payload["b"]])
    assert torch.allclose(delta, torch.tensor([0.6, 0.0, 0.0, 0.0, 0.8]))
    assert torch.equal(out["extra"], update["extra"])  # no reference point: not clipped
    assert out["a"].dtype == torch.float32
    inside = ClipUpdate(max_norm=5.5).up(update, payload, 0, 0, {})
    assert all(torch.equal(inside[n], update[n]) for n in update)


def test_half_precision_halves_the_bytes_and_restores_the_dtype() -> None:
    payload = {"w": torch.zeros(4, 4), "step": torch.zeros(1, dtype=torch.int64)}
    update = {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(0)),
              "step": torch.ones(1, dtype=torch.int64)}
    wire = HalfPrecision().up(update, payload, 0, 0, {})
    assert wire["w"].dtype == torch.float16 and wire["step"].dtype == torch.int64
    back = HalfPrecision().server({0: wire}, {0: payload}, 0, {}).updates[0]
    assert back["w"].dtype == torch.float32 and torch.equal(back["step"], update["step"])
    assert ((back["w"] - update["w"]).abs() <= update["w"].abs() * 2.0**-11).all()


@dataclass(frozen=True)
class _Tag(Transform):
    """Appends its tag to a log on each hook, to see the order."""

    name: ClassVar[str] = "tag"
    tag: str = ""
    log: list = None  # type: ignore[assignment]

    def down(self, payload, client_id, round_, state):
        self.log.append(("down", self.tag))
        return payload

    def up(self, update, payload, client_id, round_, state):
        self.log.append(("up", self.tag))
        state["seen"] = state.get("seen", 0) + 1  # a client state of its own
        return update

    def init_state(self):
        return {"rounds": 0}

    def server(self, updates, payloads, round_, state):
        self.log.append(("server", self.tag))
        return Served(updates, {"rounds": state["rounds"] + 1}, {"tag": self.tag})


@dataclass(frozen=True)
class _OtherTag(_Tag):
    name: ClassVar[str] = "other_tag"


def test_the_chain_runs_up_in_order_and_back_in_reverse() -> None:
    log: list = []
    c = Chain((_Tag(tag="clip", log=log), _OtherTag(tag="compress", log=log)))
    p = {"w": torch.zeros(1)}
    c.down(p, 0, 0)
    local: dict = {}
    c.up(p, p, 0, 0, local)
    c.up(p, p, 0, 1, local)
    served = c.server({0: p}, {0: p}, 0)
    assert log == [("down", "compress"), ("down", "clip"), ("up", "clip"), ("up", "compress"),
                   ("up", "clip"), ("up", "compress"), ("server", "compress"), ("server", "clip")]
    assert Chain().up(p, p, 0, 0) is p  # the empty chain is the identity
    # each transform keeps its own client state across rounds, and its own server state
    assert local == {"transforms": {"tag": {"seen": 2}, "other_tag": {"seen": 2}}}
    assert served.state == {"states": [{"rounds": 1}, {"rounds": 1}]}
    assert served.measurements == {"tag": {"tag": "clip"}, "other_tag": {"tag": "compress"}}
    again = c.server({0: p}, {0: p}, 1, served.state["states"])
    assert again.state == {"states": [{"rounds": 2}, {"rounds": 2}]}


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([{"name": "gzip"}], "transforms[0].name: unknown transform 'gzip'"),
        ([{"name": "half_precision"}, {"name": "clip_update", "norm": 1.0}],
         "transforms[1].norm: unknown setting of clip_update"),
        ([{"name": "clip_update", "max_norm": "1"}], "transforms[0].max_norm: expected float"),
        ([{"name": "clip_update", "max_norm": 0.0}], "transforms[0].max_norm: must be > 0"),
        ([{"name": "half_precision"}, {"name": "clip_update"}],
         "transforms[1].name: clip_update (clip) after half_precision (compress)"),
        ([{"name": "half_precision"}, {"name": "half_precision"}],
         "transforms[1].name: half_precision is already in the chain"),
    ],
)
def test_a_bad_transform_names_its_key(specs: list, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}".replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        chain(specs)
    with pytest.raises(ConfigError):
        build_algorithm(validate({"transforms": specs}))


def _run(tmp_path: Path, name: str, transforms: list[dict]) -> list[dict]:
    raw = tiny_raw("federation.rounds=2", output_dir=tmp_path)
    run = RunDir.create(tmp_path, name)
    simulate(Experiment.build(validate({**raw, "transforms": transforms})), run)
    return [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]


@needs_glue
def test_in_a_run_half_precision_halves_bytes_up_and_clipping_bounds_drift(
        tmp_path: Path) -> None:
    plain = _run(tmp_path, "plain", [])
    half = _run(tmp_path, "half", [{"name": "half_precision"}])
    clipped = _run(tmp_path, "clipped", [{"name": "clip_update", "max_norm": 0.01}])
    up = {name: [r["bytes_up"] for r in rows if r["scope"] == "train"]
          for name, rows in (("plain", plain), ("half", half))}
    assert up["half"] == [b // 2 for b in up["plain"]] and up["plain"][0] > 0
    drifts = [r["drift"]["max"] for r in clipped if r["scope"] == "diagnostics"]
    free = [r["drift"]["max"] for r in plain if r["scope"] == "diagnostics"]
    assert max(drifts) <= 0.01 * (1 + 1e-5) < min(free)

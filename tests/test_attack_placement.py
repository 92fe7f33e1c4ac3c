"""Where a simulated attacker acts (issue 67): its client sends the forgery through the
transform chain's client half as it sends any update, so DP-FedAvg's clipping bounds a
boosted update (the clients' clipping under client-side noise, the server's under
server-side noise), a compressor compresses what an ALIE attacker forged (secure
aggregation sums a forgery as any input: tests/test_secure_aggregation.py), and a forgery that is not finite is rejected like any update, saying so."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import needs_glue, tiny_config

from fedloom.algorithms import ClientResult
from fedloom.algorithms.base import ServerState
from fedloom.algorithms.fedavg import FedAvg
from fedloom.experiment import Experiment
from fedloom.params import Params
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

CLIP = 0.05


def _norm(update: Params, start: Params) -> float:
    return math.sqrt(sum(float((update[n].double() - start[n].double()).pow(2).sum())
                         for n in update))


def _deltas(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *overrides: str
) -> dict[int, Params]:
    """Each update Δ_k = θ_k − θ that FedAvg aggregated in one round of the tiny run with
    ``overrides``, by client."""
    seen: dict[int, Params] = {}
    aggregate = FedAvg.aggregate

    def spy(self: FedAvg, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        start = state.global_params
        seen.update({r.client_id: {n: r.params[n].double() - start[n].double()
                                   for n in r.params} for r in results})
        return aggregate(self, state, results)

    monkeypatch.setattr(FedAvg, "aggregate", spy)
    cfg = tiny_config("federation.rounds=1", *overrides, output_dir=tmp_path)
    run = RunDir(tmp_path / "run")
    run.path.mkdir(parents=True)
    simulate(Experiment.build(cfg), run)
    return seen


def _aggregated(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *overrides: str
) -> list[tuple[int, float]]:
    """(client, ‖Δ_k‖) of each update FedAvg aggregated, client 1 boosting its own 10⁴×."""
    boosted = ('attack.name="boosted"', "attack.boost=1e4", "attack.clients=[1]")
    deltas = _deltas(monkeypatch, tmp_path, *boosted, *overrides)
    zero = {n: torch.zeros(()) for d in deltas.values() for n in d}
    return [(cid, _norm(d, zero)) for cid, d in sorted(deltas.items())]


@needs_glue
@pytest.mark.parametrize("noise", ["server", "client"])
def test_a_boosted_update_is_bounded_by_the_clip_norm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, noise: str
) -> None:
    """With client-level DP (z tiny, so the clip is what shows), the attacker's update that
    FedAvg averages is at most C from the global adapter, as every honest client's is,
    whether the server clips (server-side noise) or each client does (client-side noise:
    the attacker's client clips its forgery before it leaves); without DP the same attack
    sends 10⁴ times its update."""
    private = _aggregated(monkeypatch, tmp_path / "dp", "privacy.level='client'",
                          f"privacy.noise='{noise}'", f"privacy.clip_norm={CLIP}",
                          "privacy.noise_multiplier=1e-9")
    assert sorted(c for c, _ in private) == [0, 1, 2]
    noise = 1e-9 * CLIP * 1e3  # z · C / √m on each of well under 10⁶ coordinates
    assert all(norm <= CLIP + noise for _, norm in private), private
    attacker = dict(private)[1]
    assert attacker == pytest.approx(CLIP, rel=1e-4)  # boosted past C, clipped to it
    plain = dict(_aggregated(monkeypatch, tmp_path / "plain"))
    assert plain[1] > 100 * CLIP and plain[1] > 1000 * max(plain[0], plain[2])


@needs_glue
def test_what_an_alie_attacker_forged_is_compressed_as_its_client_sends_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ALIE's forgery (μ − zσ over every client's update) is dense; sent through top-k it
    keeps ⌈ratio · d⌉ coordinates of the update (one vector of its d shared coordinates),
    as every client's update does. (Forged after decoding, it was dense: the benign
    updates' supports differ.)"""
    deltas = _deltas(monkeypatch, tmp_path, 'attack.name="alie"', "attack.clients=[1]",
                     'transforms=[{name = "compress", compressor = "topk", ratio = 0.05}]')
    assert sorted(deltas) == [0, 1, 2]
    for cid, delta in deltas.items():
        kept = sum(int((d != 0).sum()) for d in delta.values())
        d = sum(t.numel() for t in delta.values())
        assert 0 < kept <= math.ceil(0.05 * d), (cid, kept, d)


@needs_glue
def test_a_forged_update_that_overflows_is_rejected_like_any_other(tmp_path: Path) -> None:
    cfg = tiny_config("federation.rounds=1", 'attack.name="sign_flip"', "attack.scale=1e308",
                      "attack.clients=[1]", output_dir=tmp_path)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    simulate(Experiment.build(cfg), run)
    rows = [json.loads(x) for x in run.metrics_path.read_text().splitlines()]
    (train,) = [r for r in rows if r["scope"] == "train"]
    assert train["failed"] == [1] and sorted(train["per_client"]) == ["0", "2"]
    assert train["missing"]["1"].startswith("rejected: ")
    assert train["missing"]["1"].endswith(": non-finite values (forged by the attack)")

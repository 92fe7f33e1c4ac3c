"""Where a simulated attacker acts (issue 67): its forgery enters the server's half of the
transform chain where a real attacker's message would decode, before the clip stage, so
DP-FedAvg's server-side clipping bounds a boosted update as it bounds every client's; and
a forgery that is not finite is rejected like any update, saying so."""

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
from fedloom.attacks import Attack
from fedloom.attacks.boosted import Boosted
from fedloom.experiment import Experiment
from fedloom.params import Params
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate
from fedloom.transforms import Chain
from fedloom.transforms.dp_fedavg import DPFedAvg

CLIP = 0.05


def _norm(update: Params, start: Params) -> float:
    return math.sqrt(sum(float((update[n].double() - start[n].double()).pow(2).sum())
                         for n in update))


def test_the_clip_stage_clips_what_the_attacker_forged() -> None:
    """Chain.server hands the decoded updates to the attack before the clip stage's server
    half: the boosted update reaches the aggregation clipped to C."""
    start = {"w": torch.zeros(4)}
    trained = {cid: {"w": torch.full((4,), 0.01 * (cid + 1))} for cid in range(3)}
    dp = DPFedAvg(noise_multiplier=1e-9, clip_norm=CLIP, clients_per_round=3)
    attack = Attack(Boosted(boost=1e4), attackers=(2,))

    def forge(decoded: dict[int, Params]) -> dict[int, Params]:
        results = [ClientResult(cid, decoded[cid], 10) for cid in sorted(decoded)]
        return {r.client_id: r.params for r in attack.poison(results, dict.fromkeys(decoded, start),
                                                              0)}

    served = Chain((dp,)).server(trained, dict.fromkeys(trained, start), 0, tamper=forge)
    assert _norm(served.updates[2], start) == pytest.approx(CLIP, rel=1e-6)  # 1e4 · 0.02 · 2
    assert _norm(served.updates[0], start) == pytest.approx(0.02, rel=1e-6)  # under C: kept
    # without the clip stage the forgery goes through whole
    plain = Chain(()).server(trained, dict.fromkeys(trained, start), 0, tamper=forge)
    assert _norm(plain.updates[2], start) == pytest.approx(1e4 * 0.06, rel=1e-6)


def _aggregated(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *overrides: str
) -> list[tuple[int, float]]:
    """Each update FedAvg aggregated in one round of the tiny run with ``overrides``, as
    (client, ‖θ_k − θ‖)."""
    seen: list[tuple[int, float]] = []
    aggregate = FedAvg.aggregate

    def spy(self: FedAvg, state: ServerState, results: Sequence[ClientResult]) -> ServerState:
        seen.extend((r.client_id, _norm(r.params, state.global_params)) for r in results)
        return aggregate(self, state, results)

    monkeypatch.setattr(FedAvg, "aggregate", spy)
    cfg = tiny_config("federation.rounds=1", 'attack.name="boosted"', "attack.boost=1e4",
                      "attack.clients=[1]", *overrides, output_dir=tmp_path)
    run = RunDir(tmp_path / "run")
    run.path.mkdir(parents=True)
    simulate(Experiment.build(cfg), run)
    return seen


@needs_glue
def test_a_boosted_update_is_bounded_by_the_servers_clip_norm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With client-level DP and server-side noise (z tiny, so the clip is what shows), the
    attacker's update that FedAvg averages is at most C from the global adapter, as every
    honest client's is; without DP the same attack sends 10⁴ times its update."""
    private = _aggregated(monkeypatch, tmp_path / "dp", "privacy.level='client'",
                          "privacy.noise='server'", f"privacy.clip_norm={CLIP}",
                          "privacy.noise_multiplier=1e-9")
    assert sorted(c for c, _ in private) == [0, 1, 2]
    noise = 1e-9 * CLIP * 1e3  # z · C / √m on each of well under 10⁶ coordinates
    assert all(norm <= CLIP + noise for _, norm in private), private
    attacker = dict(private)[1]
    assert attacker == pytest.approx(CLIP, rel=1e-4)  # boosted past C, clipped to it
    plain = dict(_aggregated(monkeypatch, tmp_path / "plain"))
    assert plain[1] > 100 * CLIP and plain[1] > 1000 * max(plain[0], plain[2])


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

"""Secure aggregation in a run (``[secagg]``): the chain's mask stage
(:mod:`fedloom.transforms.secure_sum`) and the protocol's message rounds with the client
hosts (:mod:`fedloom.runtime.secure_round`).

What is checked: the weighted mean the server rebuilds from the unmasked sum equals the
plain weighted mean to the quantization step; a run with SecAgg / SecAgg+ aggregates as
the run without it (to that step), with simulated drop-outs recovered from the shares;
the server never holds a client's update (its replies carry none, and what it receives
at the masking stage is not any client's input); every setting it cannot run with is
refused by its key, exit 2, nothing written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_glue, run_tiny_cli, tiny_config
from safetensors.torch import load_file

from fedloom.config import SecAggSection
from fedloom.experiment import Experiment
from fedloom.runtime import secure_round
from fedloom.runtime.clients import ClientHost
from fedloom.runtime.rundir import RunDir
from fedloom.runtime.secure_round import SecureClient
from fedloom.secagg import SecAggConfig, SecAggServer, settings
from fedloom.server import simulate
from fedloom.transforms.secure_sum import QUANT_BITS_KEY, SUM_KEY, SecureSum


def _params(rng: np.random.Generator, scale: float = 0.05) -> dict[str, torch.Tensor]:
    return {
        "a": torch.from_numpy(rng.normal(0, scale, (4, 3))).float(),
        "b": torch.from_numpy(rng.normal(0, scale, 5)).float(),
    }


class _Host:
    """Client hosts reduced to the protocol: each client holds an update over a start and
    takes its step as every runtime's clients do (:class:`SecureClient`)."""

    def __init__(self, secure: SecureSum, held: dict[int, tuple[dict, dict, int]]) -> None:
        self.sides = {cid: SecureClient(secure, cid, h) for cid, h in held.items()}

    def exchange(self, round_: int, stage: str, messages: dict) -> dict:
        answers = {cid: self.sides[cid].answer(stage, m) for cid, m in messages.items()}
        return {cid: a for cid, a in answers.items() if a is not None}


@pytest.mark.parametrize("protocol", ["secagg+", "secagg"])
@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_the_unmasked_sum_gives_the_weighted_mean_to_the_quantization_step(
    protocol: str, weighting: str
) -> None:
    rng = np.random.default_rng(0)
    n = 7
    secure = SecureSum(SecAggConfig(protocol, clip_range=0.5), weighting=weighting)
    start = _params(rng, 1.0)
    updates = {cid: {k: start[k] + v for k, v in _params(rng).items()} for cid in range(n)}
    examples = {cid: int(rng.integers(5, 400)) for cid in range(n)}
    host = _Host(secure, {c: (updates[c], start, examples[c]) for c in range(n)})
    weights = {c: secure.weight(examples[c]) for c in range(n)}
    done = secure_round.run(host, secure, weights, 3, SecureSum.dim(start))
    assert done.result is not None and done.result.survivors == tuple(range(n))
    # the exact integer sum of the clients' inputs (each a seeded encoding)
    inputs = [secure.encode(updates[c], start, weights[c], c, done.setup) for c in range(n)]
    assert np.array_equal(done.result.total.astype(np.uint64), np.sum(inputs, axis=0))
    summed = {
        SUM_KEY: torch.from_numpy(done.result.total),
        QUANT_BITS_KEY: torch.tensor([done.setup.quant_bits]),
    }
    served = secure.server({c: summed for c in range(n)}, {c: start for c in range(n)}, 3, {})
    w = np.array([weights[c] for c in range(n)], dtype=np.float64)
    for name in start:
        plain = sum(w[c] * (updates[c][name].double() - start[name].double()) for c in range(n))
        expected = start[name].double() + plain / w.sum()
        got = served.updates[0][name].double()
        step = served.measurements["step"]
        assert (got - expected).abs().max() < step + 1e-6  # float32 storage
    assert served.measurements["weight"] == int(w.sum())
    assert served.measurements["clipped"] == 0


def test_clipped_coordinates_are_counted_in_the_sum() -> None:
    rng = np.random.default_rng(1)
    secure = SecureSum(SecAggConfig(clip_range=0.01))
    start = _params(rng)
    updates = {c: {k: start[k] + v for k, v in _params(rng, 0.05).items()} for c in range(4)}
    host = _Host(secure, {c: (updates[c], start, 10) for c in range(4)})
    done = secure_round.run(host, secure, dict.fromkeys(range(4), 10), 0, SecureSum.dim(start))
    assert done.result is not None
    clipped = sum(
        int(
            (
                torch.cat([(updates[c][k] - start[k]).reshape(-1) for k in sorted(start)]).abs()
                > 0.01
            ).sum()
        )
        for c in range(4)
    )
    assert int(done.result.total[-1]) == clipped > 0


def test_a_total_weight_that_would_wrap_is_refused() -> None:
    secure = SecureSum(SecAggConfig(bits=16, quant_bits=8))
    with pytest.raises(ValueError, match=r"secagg\.bits"):
        secure.setup({0: 200, 1: 200}, 0, 10)  # 400 · 255 > 2^16 − 1
    assert secure.setup({0: 100, 1: 157}, 0, 10).quant_bits == 8  # 257 · 255 = 2^16 − 1


def _run(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, list[dict]]:
    cfg = tiny_config(
        "partition.num_clients=6",
        "partition.scheme=dirichlet",
        "partition.alpha=0.5",
        "federation.rounds=2",
        *overrides,
        output_dir=tmp_path,
    )
    run = RunDir.create(tmp_path / name, "tiny")
    simulate(Experiment.build(cfg), run)
    rows = [json.loads(x) for x in run.metrics_path.read_text().splitlines()]
    return run.path, rows


def _global(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "global.safetensors")


@needs_glue
@pytest.mark.parametrize(
    "faults",
    [(), ("faults.dropout=0.3",), ("attack.name=alie", "attack.fraction=0.34")],
    ids=["all report", "drop-outs", "an ALIE attacker's client masks its forgery"],
)
def test_a_run_under_secure_aggregation_aggregates_as_the_plain_run(
    faults: tuple[str, ...], tmp_path: Path
) -> None:
    plain, plain_rows = _run(tmp_path, "plain", *faults)
    secure, rows = _run(tmp_path, "secure", "secagg.protocol=secagg+", *faults)
    a, b = _global(plain), _global(secure)
    # 2 rounds of 6 clients: b_q = 21 bits for their ≤ 60 examples, step 2/(2^21 − 1)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    train = [r for r in rows if r.get("scope") == "train"]
    plain_train = [r for r in plain_rows if r.get("scope") == "train"]
    assert [sorted(r["missing"]) for r in train] == [sorted(r["missing"]) for r in plain_train]
    assert all(r["secagg"]["protocol"] == "secagg+" for r in train)
    assert [r.get("attackers") for r in train] == [r.get("attackers") for r in plain_train]
    dropped = sum(r["secagg_dropouts"] for r in train)
    assert dropped == sum(len(r["missing"]) for r in plain_train)
    if "attack.name=alie" in faults:
        assert all(r["attackers"] for r in train)
    elif faults:
        assert dropped > 0  # the seed drops someone: its masks were recovered
        assert any("masks recovered" in why for r in train for why in r["missing"].values())
    dev = [r for r in rows if r.get("scope") == "dev"]
    plain_dev = [r for r in plain_rows if r.get("scope") == "dev"]
    assert [r["accuracy"] for r in dev] == [r["accuracy"] for r in plain_dev]


@needs_glue
def test_the_server_never_holds_a_clients_update(tmp_path: Path, monkeypatch) -> None:
    received: list[np.ndarray] = []
    inputs: list[np.ndarray] = []
    replies: list[dict] = []
    collect = SecAggServer.collect_masked

    def spy_collect(self, masked):
        received.extend(m.masked.copy() for m in masked)
        return collect(self, masked)

    encode = SecureSum.encode

    def spy_encode(self, *args):
        x = encode(self, *args)
        inputs.append(x.copy())
        return x

    train_many = ClientHost.train_many

    def spy_train(self, *args, **kwargs):
        got = train_many(self, *args, **kwargs)
        replies.extend(r.result.params for r in got if r.result is not None)
        return got

    monkeypatch.setattr(SecAggServer, "collect_masked", spy_collect)
    monkeypatch.setattr(SecureSum, "encode", spy_encode)
    monkeypatch.setattr(ClientHost, "train_many", spy_train)
    _run(tmp_path, "secure", "secagg.protocol=secagg")
    assert replies and all(params == {} for params in replies)  # training sends no update
    assert len(received) == len(inputs) == 12
    # what arrived is masked: no coordinate block of it equals any client's input
    for y in received:
        for x in inputs:
            assert np.mean(y == x) < 0.01


@needs_glue
def test_client_side_dp_noise_composes_with_secure_aggregation(tmp_path: Path) -> None:
    _, rows = _run(
        tmp_path,
        "dp",
        "secagg.protocol=secagg+",
        "privacy.level=client",
        "privacy.noise=client",
        "privacy.noise_multiplier=0.5",
        "privacy.clip_norm=0.5",
    )
    train = [r for r in rows if r.get("scope") == "train"]
    assert all(r["secagg"]["summed"] == 6 for r in train)
    assert train[-1]["epsilon"] > 0


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["secagg.threshold=7"], "secagg.threshold: t = 7 exceeds"),
        (["secagg.protocol=secagg", "secagg.threshold=3"], "not a majority"),
        (["secagg.bits=8", "secagg.quant_bits=6"], "secagg.bits"),
        (["aggregation.rule=median"], "aggregation.rule: median needs each client's update"),
        (["algorithm.name=ifca", "algorithm.num_clusters=2"], "secagg.protocol"),
        (["algorithm.name=scaffold"], "control variates"),
        (["privacy.level=client", "privacy.noise_multiplier=0.5"], "privacy.noise"),
        (['transforms=[{name = "compress", compressor = "qsgd"}]'], "transforms[0].name"),
        (["faults.garbage={1 = 'nan'}"], "faults.garbage"),
        (["algorithm.weighting=capped"], "algorithm.weighting"),
    ],
)
def test_what_secure_aggregation_cannot_run_with_is_refused(
    overrides: list[str], fragment: str, tmp_path: Path
) -> None:
    result = run_tiny_cli(tmp_path, "secagg.protocol=secagg+", *overrides)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("protocol", ["secagg+", "secagg", "ckks", "paillier"])
def test_the_protocols_settings_are_the_sections_keys_of_the_same_names(protocol: str) -> None:
    """Each protocol's own settings come from ``[secagg]`` by name (no hand-kept order):
    every field is a key of the section with the same default, and a value set there
    reaches the field of that name."""
    section = SecAggSection.model_fields
    built = settings.config(tiny_config(f"secagg.protocol='{protocol}'", "secagg.bits=40"))
    for f in dataclasses.fields(built):
        assert f.name in section, f.name
        if f.name != "protocol":
            assert f.default == section[f.name].default, f.name
    assert built.protocol == protocol and built.bits == 40

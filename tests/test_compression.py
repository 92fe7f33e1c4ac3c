"""The ``compress`` transform: the update travels as the operator's bytes (bytes_up counts
them), error feedback keeps what compression dropped in the client's state (committed,
checkpointed, resumed), and on the quadratic federation top-k and scaled sign approach the
optimum with error feedback and stall away from it without; bad settings are refused by
key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import needs_glue, tiny_raw
from quadratic import CURVED, OPTIMA, optimum

from fedloom.config import ConfigError, validate
from fedloom.experiment import Experiment, build_algorithm
from fedloom.runtime.client_state import load_client_state
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate
from fedloom.transforms import Chain, chain


def _gradient_descent(transform: dict[str, Any], lr: float, rounds: int) -> np.ndarray:
    """The global w of each round on the curved quadratic federation: every client takes
    one exact gradient step y = x − η H_k (x − w_k*) and sends it through the chain of
    ``transform``; the server averages what the chain decodes."""
    chain_ = chain([transform])
    h = [torch.tensor(c) for c in CURVED]
    optima = [torch.tensor(w) for w in OPTIMA]
    x = torch.zeros(2, dtype=torch.float64)
    states: list[dict] = [{} for _ in h]
    path = []
    for r in range(rounds):
        payload = {"w": x}
        sent = {
            k: chain_.up({"w": x - lr * h[k] @ (x - optima[k])}, payload, k, r, states[k])
            for k in range(len(h))
        }
        updates = chain_.server(sent, dict.fromkeys(sent, payload), r).updates
        x = torch.stack([u["w"] for u in updates.values()]).mean(0)
        path.append(x.numpy().copy())
    return np.array(path)


@pytest.mark.parametrize(
    "operator", [{"compressor": "topk", "k": 1}, {"compressor": "sign"}], ids=["topk", "sign"]
)
def test_error_feedback_converges_where_compression_alone_stalls(operator: dict) -> None:
    """Error feedback with a constant step η ends in a neighbourhood of the optimum w* whose
    size is proportional to η, so it converges as the step shrinks (the clients' gradients
    at w* differ, so the residuals never vanish: EF21, an algorithm here, removes that);
    without it the iterates stall at a point whose distance to w* does not shrink with η."""
    target = optimum(CURVED)
    distance = {}
    for feedback in (True, False):
        for lr in (0.1, 0.05):
            rounds = int(20 / lr)
            path = _gradient_descent(
                {"name": "compress", **operator, "error_feedback": feedback}, lr, rounds
            )
            tail = np.linalg.norm(path[-rounds // 10 :] - target, axis=1)
            distance[feedback, lr] = float(tail.mean())
    # measured: 0.033 → 0.017 (top-k), 0.038 → 0.018 (sign): halved with the step
    assert distance[True, 0.05] < 0.6 * distance[True, 0.1] and distance[True, 0.05] < 0.025
    # measured: 0.31 and 0.68–0.71, whatever the step
    assert min(distance[False, 0.1], distance[False, 0.05]) > 0.25


def test_the_update_travels_as_bytes_and_decodes_to_the_payload_plus_delta() -> None:
    payload = {"a": torch.randn(20, 8), "b": torch.randn(30), "scaffold.c/a": torch.randn(20, 8)}
    update = {"a": payload["a"] + 0.01, "b": payload["b"] - 0.02, "scaffold.dc/a": torch.ones(3)}
    chain_ = chain([{"name": "compress", "compressor": "identity"}])
    state: dict = {}
    sent = chain_.up(update, payload, 0, 0, state)
    assert sorted(sent) == ["scaffold.dc/a", "wire/flat", "wire/names"]
    assert sent["wire/flat"].dtype == torch.uint8
    # 190 float32 values plus the header (dtype, ndim, one dimension)
    assert sent["wire/flat"].numel() == 190 * 4 + 6
    back = chain_.server({0: sent}, {0: payload}, 0).updates[0]
    assert sorted(back) == ["a", "b", "scaffold.dc/a"]  # c was sent, not returned
    for n in ("a", "b"):
        torch.testing.assert_close(back[n], update[n], rtol=0, atol=1e-6)
    assert state == {}  # the identity is unbiased: no error feedback, no state


def test_an_undecodable_update_is_rejected_not_fatal() -> None:
    payload = {"a": torch.randn(4, 4)}
    chain_ = chain([{"name": "compress", "compressor": "identity"}])
    good = chain_.up({"a": payload["a"] + 1}, payload, 0, 0, None)
    bad = {**good, "wire/flat": good["wire/flat"][:10]}
    served = chain_.server({0: good, 1: bad}, {0: payload, 1: payload}, 0)
    assert sorted(served.updates) == [0] and "undecodable" in served.rejected[1]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"compressor": "zip"}, r"transforms\[0\]\.compressor: unknown compressor 'zip'"),
        ({"compressor": "topk", "k": 0}, r"transforms\[0\]\.k: "),
        ({"compressor": "topk", "ratio": 1.5}, r"transforms\[0\]\.ratio: "),
        ({"compressor": "qsgd", "levels": 0}, r"transforms\[0\]\.levels: "),
        ({"compressor": "fp16", "k": 3}, r"transforms\[0\]\.k: not a setting of compressor fp16"),
        ({"seed": 1}, r"transforms\[0\]\.seed: unknown setting"),
        ({"tensors": ["("]}, r"transforms\[0\]\.tensors: '\(' is not a regular expression"),
    ],
)
def test_a_bad_compressor_setting_names_its_key(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chain([{"name": "compress", **spec}])
    with pytest.raises(ConfigError, match=message):
        build_algorithm(validate({"transforms": [{"name": "compress", **spec}]}))


def test_compression_with_client_side_noise_is_refused() -> None:
    raw = {
        "transforms": [{"name": "compress", "compressor": "qsgd"}],
        "privacy": {
            "level": "client",
            "noise_multiplier": 1.0,
            "clip_norm": 0.1,
            "noise": "client",
        },
        "algorithm": {"name": "fedavg", "weighting": "uniform"},
    }
    with pytest.raises(
        ConfigError,
        match=r"transforms\[0\]\.name: compress encodes the update as bytes, and privacy\.noise",
    ):
        build_algorithm(validate(raw))


@needs_glue
@pytest.mark.parametrize(
    ("overrides", "spec", "message"),
    [
        (
            ["algorithm.name=fedper"],
            {"compressor": "topk", "ratio": 0.5, "tensors": ["head"]},
            r"transforms\[0\]\.tensors: 'head' selects .*which the method keeps personal",
        ),
        ([], {"compressor": "topk", "k": 10**9}, r"transforms\[0\]\.k: "),
        (
            [],
            {"compressor": "topk", "ratio": 0.5, "tensors": ["nothing_like_this"]},
            r"transforms\[0\]\.tensors: 'nothing_like_this' selects no shared tensor",
        ),
    ],
    ids=["personal tensor", "k > d", "no tensor"],
)
def test_what_the_model_cannot_satisfy_is_refused_before_a_run(
    overrides: list[str], spec: dict, message: str, tmp_path: Path
) -> None:
    raw = {
        **tiny_raw(*overrides, output_dir=tmp_path),
        "transforms": [{"name": "compress", **spec}],
    }
    with pytest.raises(ConfigError, match=message):
        Experiment.build(validate(raw))


def _run(
    tmp_path: Path, name: str, transforms: list[dict], *overrides: str
) -> tuple[list[dict], Path]:
    raw = tiny_raw("federation.rounds=3", "eval.every=3", *overrides, output_dir=tmp_path)
    run = RunDir.create(tmp_path, name)
    simulate(Experiment.build(validate({**raw, "transforms": transforms})), run)
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    return rows, run.path


@needs_glue
def test_in_a_run_top_k_sends_a_fraction_of_the_bytes_and_keeps_its_residual(
    tmp_path: Path,
) -> None:
    plain, _ = _run(tmp_path, "plain", [])
    topk = [{"name": "compress", "compressor": "topk", "ratio": 0.01}]
    compressed, path = _run(tmp_path, "topk", topk)
    no_ef, _ = _run(tmp_path, "no_ef", [{**topk[0], "error_feedback": False}])
    up = {
        name: [r["bytes_up"] for r in rows if r["scope"] == "train"]
        for name, rows in (("plain", plain), ("topk", compressed))
    }
    # 1 % of the values, each an index and a value: about 2 % of the float32 bytes
    assert all(0 < c < 0.03 * p for c, p in zip(up["topk"], up["plain"]))
    state = load_client_state(path / "checkpoints" / "clients" / "client_000.safetensors")
    residual = state["transforms"]["compress"]["residual"]
    assert residual and all(torch.isfinite(t).all() for t in residual.values())
    # the residual changes what is sent: without it the run differs
    losses = [
        [r["train_loss"] for r in rows if r["scope"] == "train"] for rows in (compressed, no_ef)
    ]
    assert losses[0][0] == losses[1][0] and losses[0][1:] != losses[1][1:]


def test_the_chain_of_no_transform_is_the_identity() -> None:
    assert chain([]) == Chain(())


def test_a_method_that_compresses_its_own_messages_refuses_the_transform() -> None:
    raw = {
        "algorithm": {"name": "diana", "compressor": "randk", "ratio": 0.1},
        "transforms": [{"name": "compress", "compressor": "topk"}],
    }
    with pytest.raises(
        ConfigError, match=r"transforms\[0\]\.name: compress encodes .*algorithm\.name = 'diana'"
    ):
        build_algorithm(validate(raw))


def test_an_update_with_nothing_compressed_passes_through() -> None:
    chain_ = chain([{"name": "compress", "compressor": "topk", "ratio": 0.5}])
    sent = chain_.up({}, {"a": torch.ones(4)}, 0, 0, {})  # a method that sends nothing
    assert chain_.server({0: sent}, {0: {"a": torch.ones(4)}}, 0).updates == {0: {}}


def _down_chain() -> Chain:
    return chain([{"name": "compress_down", "compressor": "qsgd", "levels": 4}], seed=5)


def test_the_broadcast_goes_in_full_once_then_as_the_compressed_difference() -> None:
    down = _down_chain()
    client: dict = {}
    x0 = {"a": torch.randn(40, 8), "step": torch.ones(1, dtype=torch.int64)}
    cast = down.broadcast({0: x0}, 0)
    assert cast.sent[0] is x0 and cast.starts[0] is x0  # no reference yet: in full
    assert down.down(cast.sent[0], 0, 0, client) is x0
    states = down.commit(cast.state["states"], [0])
    x1 = {"a": x0["a"] + 0.01 * torch.randn(40, 8), "step": x0["step"] + 1}
    cast = down.broadcast({0: x1}, 1, states)
    assert "a" not in cast.sent[0] and cast.sent[0]["wire/flat"].dtype == torch.uint8
    assert cast.sent[0]["wire/flat"].numel() < 0.2 * x1["a"].numel() * 4
    rebuilt = down.down(cast.sent[0], 0, 1, client)
    # the client rebuilds bit for bit what the server decodes its update against
    assert torch.equal(rebuilt["a"], cast.starts[0]["a"]) and torch.equal(
        rebuilt["step"], x1["step"]
    )
    assert 0 < (rebuilt["a"] - x1["a"]).norm() < (x0["a"] - x1["a"]).norm()
    # the error is carried: with the references kept, the estimate approaches x1
    states, estimate = down.commit(cast.state["states"], [0]), rebuilt
    for r in range(2, 30):
        cast = down.broadcast({0: x1}, r, states)
        estimate = down.down(cast.sent[0], 0, r, client)
        states = down.commit(cast.state["states"], [0])
    assert (estimate["a"] - x1["a"]).norm() < 0.1 * (rebuilt["a"] - x1["a"]).norm()


def test_a_client_left_out_keeps_its_reference_on_both_sides() -> None:
    down = _down_chain()
    x0 = {"a": torch.randn(30)}
    cast = down.broadcast({0: x0}, 0)
    client: dict = {}
    down.down(cast.sent[0], 0, 0, client)
    states = down.commit(cast.state["states"], [0])
    kept = {"transforms": {k: dict(v) for k, v in client["transforms"].items()}}
    # round 1: the client receives, trains, but its update is rejected: nothing committed
    cast = down.broadcast({0: {"a": x0["a"] + 1}}, 1, states)
    down.down(cast.sent[0], 0, 1, client)
    states = down.commit(cast.state["states"], [])
    # round 2 starts from the committed state of both sides and still decodes exactly
    cast = down.broadcast({0: {"a": x0["a"] + 2}}, 2, states)
    assert torch.equal(down.down(cast.sent[0], 0, 2, kept)["a"], cast.starts[0]["a"])


@needs_glue
def test_in_a_run_the_downlink_shrinks_after_the_first_round(tmp_path: Path) -> None:
    plain, _ = _run(tmp_path, "plain", [])
    rows, _ = _run(
        tmp_path, "down", [{"name": "compress_down", "compressor": "qsgd", "levels": 16}]
    )
    down = [r["bytes_down"] for r in rows if r["scope"] == "train"]
    full = [r["bytes_down"] for r in plain if r["scope"] == "train"]
    assert down[0] == full[0] and all(d < 0.2 * f for d, f in zip(down[1:], full[1:]))
    assert all(r["missing"] == {} for r in rows if r["scope"] == "train")


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "compress", "compressor": "topk"},
        {"name": "compress", "compressor": "qsgd", "error_feedback": True},
        {"name": "compress_down", "compressor": "qsgd"},
    ],
    ids=["error feedback", "error feedback, unbiased", "downlink reference"],
)
def test_client_state_is_required_where_it_is_kept(spec: dict) -> None:
    p = {"a": torch.ones(8)}
    with pytest.raises(ValueError, match=f"^{spec['name']} keeps state on the client"):
        chain([spec]).up({"a": torch.zeros(8)}, p, 0, 0, None)
        chain([spec]).down(p, 0, 0, None)


@needs_glue
def test_compression_composes_with_server_side_dp_noise(tmp_path: Path) -> None:
    rows, _ = _run(
        tmp_path,
        "dp",
        [{"name": "compress", "compressor": "randk", "ratio": 0.1}],
        "privacy.level=client",
        "privacy.noise_multiplier=0.5",
        "privacy.clip_norm=0.1",
    )
    train = [r for r in rows if r["scope"] == "train"]
    assert all(r["missing"] == {} for r in train) and train[-1]["epsilon"] > 0

"""FedMosaic (fedloom.algorithms.fedmosaic) and its task vector (fedloom.train.task_vector):
the server's per-client aggregate against a hand computation, never including the
client itself, independent of the order results arrive in; the anchor gradient against
autograd on the plain backbone, independent of the client's training state; and a tiny
run: what crosses the client/server boundary and the relevance output contract."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import needs_glue

from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult, ServerState
from fedloom.algorithms.fedmosaic import LOCAL, TASK_VECTOR, FedMosaic, as_global
from fedloom.config import ConfigError, LoraConfig, ModelConfig
from fedloom.data import Example, get_task
from fedloom.experiment import Experiment
from fedloom.models.fedmodel import FedModel
from fedloom.models.gate import NoisyTokenGate
from fedloom.runtime.local import simulate
from fedloom.runtime.rundir import RunDir
from fedloom.train.task_vector import anchor_gradient, probe_weight, sampled_batches

SLOT = "x.lora_A.global.weight"
SENT = "x.lora_A.local.weight"


def result(cid: int, value: float, vector: torch.Tensor) -> ClientResult:
    return ClientResult(cid, {SENT: torch.full((2, 3), value), TASK_VECTOR: vector}, 10)


def state_after(alg: FedMosaic, results: list[ClientResult]) -> ServerState:
    return alg.aggregate(alg.init({SLOT: torch.zeros(2, 3), "head.weight": torch.zeros(2)}), results)


VECTORS = {
    0: torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
    1: torch.tensor([[1.0, 0.1], [0.1, 1.0]]),
    2: torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
}


def test_payload_is_the_relevance_weighted_mean_of_the_others() -> None:
    alg = FedMosaic(temperature=0.5, similarity="flat")
    state = state_after(alg, [result(c, float(10 * (c + 1)), VECTORS[c]) for c in (2, 0, 1)])
    flat = {c: v.flatten() / v.norm() for c, v in VECTORS.items()}
    s01, s02 = float(flat[0] @ flat[1]), float(flat[0] @ flat[2])
    w1 = math.exp(s01 / 0.5) / (math.exp(s01 / 0.5) + math.exp(s02 / 0.5))
    payload = alg.payload(state, 0)
    assert set(payload) == {SLOT}  # only the global slot travels down
    expected = w1 * 20.0 + (1 - w1) * 30.0  # client 0's own 10.0 never enters
    torch.testing.assert_close(payload[SLOT], torch.full((2, 3), expected))
    assert w1 > 0.5  # the more similar client weighs more


def test_the_aggregate_never_includes_the_client_itself() -> None:
    alg = FedMosaic()
    huge = [result(0, 1e30, VECTORS[0]), result(1, 1.0, VECTORS[1]), result(2, 3.0, VECTORS[2])]
    payload = alg.payload(state_after(alg, huge), 0)[SLOT]
    assert float(payload.max()) <= 3.0 and float(payload.min()) >= 1.0


def test_state_does_not_depend_on_the_order_results_arrive_in() -> None:
    alg = FedMosaic()
    results = [result(c, float(c), VECTORS[c]) for c in (0, 1, 2)]
    one, other = state_after(alg, results), state_after(alg, results[::-1])
    assert one.extra["clients"] == other.extra["clients"] == [0, 1, 2]
    torch.testing.assert_close(one.extra["similarity"], other.extra["similarity"])
    for c in (0, 1, 2):
        torch.testing.assert_close(alg.payload(one, c)[SLOT], alg.payload(other, c)[SLOT])


def test_unknown_clients_and_uniform_weighting_take_the_plain_mean() -> None:
    alg = FedMosaic()
    state = state_after(alg, [result(0, 1.0, VECTORS[0]), result(1, 5.0, VECTORS[1])])
    torch.testing.assert_close(alg.payload(state, 7)[SLOT], torch.full((2, 3), 3.0))
    uniform = dataclasses.replace(alg, weighting="uniform")
    both = state_after(uniform, [result(c, float(c), VECTORS[c]) for c in (0, 1, 2)])
    torch.testing.assert_close(uniform.payload(both, 0)[SLOT], torch.full((2, 3), 1.5))
    assert not torch.allclose(alg.payload(both, 0)[SLOT], torch.full((2, 3), 1.5))


def test_before_anybody_is_known_the_payload_is_the_initial_slot() -> None:
    alg = FedMosaic()
    state = alg.init({SLOT: torch.ones(2, 3), "head.weight": torch.zeros(2)})
    assert alg.payload(state, 0).keys() == {SLOT}
    torch.testing.assert_close(alg.payload(state, 0)[SLOT], torch.ones(2, 3))


def test_local_names_map_to_the_global_slot() -> None:
    assert as_global("a.query.lora_B.local.weight") == "a.query.lora_B.global.weight"
    assert as_global("a.query.lora_P.local") == "a.query.lora_P.global"
    assert as_global("a.query.lora_gate.proj.weight") == "a.query.lora_gate.proj.weight"


@pytest.mark.parametrize("key", ["temperature=0", "grad_every=0", "keep_fraction=1.5",
                                 "noise_multiplier=-1", "ema_decay=1", "gate_start=1.0"])
def test_out_of_range_hyperparameters_name_their_key(key: str) -> None:
    name, value = key.split("=")
    with pytest.raises(ValueError, match=f"algorithm.{name}"):
        algorithms.create("fedmosaic", **{name: float(value) if "." in value or name != "grad_every"
                                          else int(value)})


MRPC = get_task("MRPC")
EXAMPLES = [Example("The cat sat on the mat.", "A cat was on a mat.", 1),
            Example("Stocks fell.", "Markets rose sharply after the report.", 0),
            Example("He said no to the offer.", None, 0)]


def test_anchor_gradient_is_the_backbone_gradient_whatever_the_adapter() -> None:
    mosaic = FedModel.build(ModelConfig(precision="fp32", backbone="tiny-bert", adapters="mosaic",
                                        lora=LoraConfig(r=4, pq_blocks=1)), MRPC, 64, seed=0)
    plain = FedModel.build(ModelConfig(precision="fp32", backbone="tiny-bert"), MRPC, 64, seed=0)
    features = mosaic.encode(EXAMPLES)
    # the plain single-LoRA model at initialization is the same function (B = 0)
    weight = probe_weight(plain)
    assert weight.shape == (32, 64)  # tiny-bert's last output.dense: d x intermediate
    plain.set_params({**plain.get_params(),
                      **{n: t for n, t in mosaic.initial_params.items() if n.startswith("classifier")}})
    plain.head.eval()
    weight.requires_grad_(True)
    expected = torch.autograd.grad(plain.loss(plain.head.collate(features)), weight)[0]
    weight.requires_grad_(False)
    # the mosaic model with a trained-looking adapter gives the anchor's gradient anyway
    g = torch.Generator().manual_seed(0)
    trained = {n: torch.randn(t.shape, generator=g) * 0.3 for n, t in mosaic.get_params().items()}
    mosaic.set_params(trained)
    got = anchor_gradient(mosaic, [features])
    torch.testing.assert_close(got, expected)
    assert not probe_weight(mosaic).requires_grad
    assert all(torch.equal(mosaic.get_params()[n], t) for n, t in trained.items())  # restored


def test_sampled_batches_count_and_seed() -> None:
    train = list(range(20))
    batches = sampled_batches(train, steps=11, grad_every=5, batch_size=4, seed=3)
    assert len(batches) == 3 and all(len(b) == 4 and len(set(b)) == 4 for b in batches)
    assert batches == sampled_batches(train, steps=11, grad_every=5, batch_size=4, seed=3)


@pytest.mark.parametrize("start", [0.5, 0.2])
def test_every_gate_starts_at_gate_start(start: float) -> None:
    mosaic = FedModel.build(ModelConfig(precision="fp32", backbone="tiny-bert", adapters="mosaic",
                                        lora=LoraConfig(r=4, pq_blocks=1)), MRPC, 64, seed=0)
    alg = FedMosaic(gate_start=start)
    payload = {n: t for n, t in mosaic.initial_params.items() if ".global" in n}
    local = alg.local_part(SimpleNamespace(state={}, model=mosaic), payload)
    mosaic.set_params({**payload, **local})
    gates = [m for m in mosaic.head.modules() if isinstance(m, NoisyTokenGate)]
    assert gates and not set(local) & set(payload)
    for gate in gates:
        gate.eval()
        tokens = torch.randn(3, 5, gate.proj.in_features)
        torch.testing.assert_close(gate(tokens, None), torch.full((3,), start))
    kept = {n: t for n, t in local.items() if not n.endswith("lora_gate.proj.bias")}
    assert all(torch.equal(t, mosaic.initial_params[n]) for n, t in kept.items())


def test_the_mosaic_model_is_required_explicitly(make_config) -> None:
    with pytest.raises(ConfigError, match="model.adapters"):
        Experiment.build(make_config("algorithm.name=fedmosaic", "model.adapters=dual"))


@needs_glue
@pytest.mark.parametrize("backbone", ["tiny-bert", "tiny-llama"])
def test_a_run_sends_only_the_local_adapter_and_logs_relevance(
    make_config, tmp_path: Path, backbone: str
) -> None:
    cfg = make_config("algorithm.name=fedmosaic", "diagnostics.every=0", "federation.rounds=2",
                      "model.lora.pq_blocks=1", f"model.backbone={backbone}")
    exp = Experiment.build(cfg)
    assert exp.cfg.model.adapters == "mosaic"
    sent: list[set[str]] = []
    kept: list[set[str]] = []

    class Spy(FedMosaic):
        def local_train(self, ctx: ClientContext, payload):  # noqa: ANN001, ANN201
            out = super().local_train(ctx, payload)
            sent.append(set(out.params))
            kept.append(set(ctx.state[LOCAL]))
            return out

    exp.algorithm = Spy(**{f.name: getattr(exp.algorithm, f.name)
                           for f in dataclasses.fields(exp.algorithm)})
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    names = set(exp.model.param_names)
    local_adapter = {n for n in names if ".local" in n and ".lora_gate." not in n}
    assert sent and all(s == local_adapter | {TASK_VECTOR} for s in sent)
    gates_and_head = {n for n in names if ".lora_gate." in n or "lora_" not in n}
    assert all(gates_and_head <= k and not (k - local_adapter - gates_and_head) for k in kept)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    relevance = [r for r in rows if r.get("scope") == "relevance"]
    assert [r["round"] for r in relevance] == [1, 2]
    for row in relevance:
        n = len(row["clients"])
        assert n == 3 and len(row["matrix"]) == n and all(len(x) == n for x in row["matrix"])
    assert summary["relevance"] == {k: relevance[-1][k] for k in ("clients", "matrix")}
    assert (run.path / "relevance.png").stat().st_size > 0
    assert "personal" in summary and "global" not in summary


@needs_glue
def test_a_trained_global_slot_is_sent_and_becomes_the_others_payload(
    make_config, tmp_path: Path
) -> None:
    cfg = make_config("algorithm.name=fedmosaic", "algorithm.global_slot=trained",
                      "algorithm.weighting=uniform", "diagnostics.every=0",
                      "federation.rounds=2", "model.lora.pq_blocks=1")
    exp = Experiment.build(cfg)
    received: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    sent: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    class Spy(FedMosaic):
        def local_train(self, ctx: ClientContext, payload):  # noqa: ANN001, ANN201
            received[ctx.round, ctx.client_id] = {n: t.clone() for n, t in payload.items()}
            out = super().local_train(ctx, payload)
            sent[ctx.round, ctx.client_id] = {n: t for n, t in out.params.items() if n != TASK_VECTOR}
            return out

    exp.algorithm = Spy(**{f.name: getattr(exp.algorithm, f.name)
                           for f in dataclasses.fields(exp.algorithm)})
    simulate(exp, RunDir.create(tmp_path / "runs", cfg.name))
    first, second = sorted({r for r, _ in sent})
    clients = sorted(c for r, c in sent if r == first)
    assert len(clients) == 3
    trained = exp.model.trainable_parameters()
    for cid in clients:
        payload, own = received[first, cid], sent[first, cid]
        assert set(own) == set(payload) and all(".global" in n for n in own)
        assert any(not torch.equal(own[n], payload[n]) for n in own if n in trained)
        others = [sent[first, c] for c in clients if c != cid]
        for name, tensor in received[second, cid].items():
            torch.testing.assert_close(tensor, sum(o[name] for o in others) / len(others))

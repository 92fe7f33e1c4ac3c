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
from fedloom.algorithms.fedmosaic import SLOT as KEPT
from fedloom.config import ConfigError, LoraConfig, ModelConfig, TrainConfig
from fedloom.data import Example, get_task
from fedloom.experiment import Experiment
from fedloom.models.fedmodel import FedModel
from fedloom.models.gate import NoisyTokenGate
from fedloom.models.pqlora import is_pq
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate
from fedloom.train.local import build_optimizer
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
        def local_train(self, ctx: ClientContext, payload):
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
        def local_train(self, ctx: ClientContext, payload):
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


# --- issue 41: the official code's rules -------------------------------------------------
def mosaic_model(seed: int = 0) -> FedModel:
    return FedModel.build(ModelConfig(precision="fp32", backbone="tiny-bert", adapters="mosaic",
                                      lora=LoraConfig(r=4, pq_blocks=1)), MRPC, 64, seed=seed)


def mosaic_context(model: FedModel, cid: int = 0, lr: float = 1e-2) -> ClientContext:
    settings = TrainConfig(lr=lr, local_steps=2, batch_size=2, schedule="constant")
    return ClientContext(cid, model, model.encode(EXAMPLES), settings, round=0, total_rounds=2,
                         state={}, seed=cid)


def random_slot(model: FedModel, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * 0.1
            for n, t in model.initial_params.items() if ".global" in n}


@pytest.mark.parametrize(("scored_slot", "global_slot"),
                         [("kept", "frozen"), ("kept", "trained"), ("latest", "frozen")])
def test_a_client_is_scored_with_the_global_slot_it_trained_with(
    scored_slot: str, global_slot: str
) -> None:
    """The official code scores the model a client saved after its training (its slot as
    it trained with it); "latest" rebuilds the slot from the last aggregate instead."""
    assert FedMosaic().scored_slot == "kept"
    model = mosaic_model()
    alg = FedMosaic(scored_slot=scored_slot, global_slot=global_slot)  # type: ignore[arg-type]
    ctx = mosaic_context(model)
    trained_with, latest = random_slot(model, 1), random_slot(model, 2)
    alg.local_train(ctx, trained_with)
    kept = ctx.state[KEPT]
    if global_slot == "frozen":
        assert all(torch.equal(kept[n], t) for n, t in trained_with.items())
    else:  # the slot trained along: the client's model holds the trained one
        assert any(not torch.equal(kept[n], t) for n, t in trained_with.items())
    adapter = alg.client_adapter(ctx, latest)
    expected = latest if scored_slot == "latest" else kept
    assert all(torch.equal(adapter[n], t) for n, t in expected.items())
    assert all(torch.equal(adapter[n], t) for n, t in ctx.state[LOCAL].items())


def test_p_and_q_train_at_the_scaled_learning_rate(make_config) -> None:
    """P and Q at train.lr × train.pq_lr_scale (5/3, the official text runs' 5e-4 / 3e-4);
    every other LoRA tensor, gates included, at train.lr."""
    assert TrainConfig().pq_lr_scale == pytest.approx(5 / 3)
    trainable = mosaic_model().trainable_parameters()
    groups = {g["kind"]: g for g in build_optimizer(TrainConfig(lr=3e-4), trainable).param_groups}
    pq = {id(p) for n, p in trainable.items() if is_pq(n)}
    assert pq and {id(p) for p in groups["pq"]["params"]} == pq
    assert groups["pq"]["lr"] == pytest.approx(5e-4) and groups["adapters"]["lr"] == 3e-4
    gates = {id(p) for n, p in trainable.items() if ".lora_gate." in n}
    assert gates <= {id(p) for p in groups["adapters"]["params"]}
    scaled = build_optimizer(TrainConfig(lr=1e-3, pq_lr_scale=1.0), trainable).param_groups
    assert {g["kind"]: g["lr"] for g in scaled} == {"adapters": 1e-3, "pq": 1e-3, "head": 1e-3}
    # the rate reaches local training: the round's learning-rate sums
    model = mosaic_model()
    ctx = mosaic_context(model, lr=3e-4)
    metrics = FedMosaic().local_train(ctx, random_slot(model, 1)).metrics
    assert metrics["lr_sum_pq"] == pytest.approx(5 / 3 * metrics["lr_sum_adapters"])
    with pytest.raises(ConfigError, match="train.pq_lr_scale"):
        make_config("train.pq_lr_scale=0")


@pytest.mark.parametrize(("key", "value"), [("absent", "zero"), ("scored_slot", "fresh"),
                                            ("head", "shared")])
def test_unknown_choices_name_their_key(key: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"algorithm.{key}"):
        algorithms.create("fedmosaic", **{key: value})


BERT_A, BERT_P = "e.layer.0.attention.self.query.lora_A.global.weight", \
    "e.layer.0.attention.self.query.lora_P.global"
LLAMA_A, LLAMA_P = "m.layers.3.self_attn.q_proj.lora_A.global.weight", \
    "m.layers.3.self_attn.q_proj.lora_P.global"
MIXED_SLOTS = {"bert": {BERT_A: torch.zeros(2, 3), BERT_P: torch.zeros(2, 2)},
               "llama": {LLAMA_A: torch.zeros(2, 5), LLAMA_P: torch.zeros(2, 2)}}


def sent_from(cid: int, backbone: str, value: float, vector: torch.Tensor) -> ClientResult:
    params = {n.replace(".global", ".local"): torch.full_like(t, value)
              for n, t in MIXED_SLOTS[backbone].items()}
    return ClientResult(cid, {**params, TASK_VECTOR: vector}, 10)


def mixed_state(alg: FedMosaic, backbone_of: dict[int, str], values: dict[int, float]):
    state = alg.init_mixed(MIXED_SLOTS, backbone_of)
    g = torch.Generator().manual_seed(0)
    return alg.aggregate(state, [sent_from(c, backbone_of[c], values[c], torch.randn(3, 4, generator=g))
                                 for c in values])


def test_the_official_rule_renormalizes_within_the_backbone_and_p_q_over_everyone() -> None:
    """fedmosaic_utils.py:81-95: P and Q by the softmax over all the others, every other
    tensor by the softmax over the others of the client's own backbone."""
    alg = FedMosaic()
    assert alg.absent == "renormalize"
    backbone_of = {0: "bert", 1: "bert", 2: "bert", 3: "llama"}
    values = {0: 1.0, 1: 2.0, 2: 4.0, 3: 8.0}
    state = mixed_state(alg, backbone_of, values)
    row = state.extra["similarity"][0]
    w = {j: math.exp(float(row[j]) / alg.temperature) for j in (1, 2, 3)}
    same = (w[1] * 2.0 + w[2] * 4.0) / (w[1] + w[2])
    everyone = (w[1] * 2.0 + w[2] * 4.0 + w[3] * 8.0) / sum(w.values())
    payload = alg.payload(state, 0)
    torch.testing.assert_close(payload[BERT_A], torch.full((2, 3), same))
    torch.testing.assert_close(payload[BERT_P], torch.full((2, 2), everyone))


@pytest.mark.parametrize("absent", ["renormalize", "initial"])
def test_a_client_alone_on_its_backbone_gets_its_own_adapter_outside_p_and_q(absent: str) -> None:
    """The official slot starts as a copy of the client's local adapter and only what
    others contribute overwrites it (fedmosaic_utils.py:70-74, 143-144); with "initial"
    the lone client's LoRA layers get the initial (zero) slot."""
    alg = FedMosaic(absent=absent, weighting="uniform")  # type: ignore[arg-type]
    backbone_of = {0: "bert", 1: "bert", 2: "llama"}
    state = mixed_state(alg, backbone_of, {0: 1.0, 1: 3.0, 2: 10.0})
    lone = alg.payload(state, 2)
    own = 10.0 if absent == "renormalize" else 0.0
    torch.testing.assert_close(lone[LLAMA_A], torch.full((2, 5), own))
    # P and Q: every other client has them, under either rule the bert clients' (1 + 3) / 2
    torch.testing.assert_close(lone[LLAMA_P], torch.full((2, 2), 2.0))
    # before it has sent an adapter it has none of its own: the initial slot
    before = mixed_state(alg, backbone_of, {0: 1.0, 1: 3.0})
    torch.testing.assert_close(alg.payload(before, 2)[LLAMA_A], torch.zeros(2, 5))


def test_a_frozen_head_is_the_same_on_every_client_and_never_trains() -> None:
    """head = "frozen": the encoder's classifier head stays at its seeded initial value,
    the same on every client (every host builds the model from the run's seed); the
    default "own" head trains."""
    assert FedMosaic().head == "own"
    heads = {}
    for cid in (0, 1):
        model = mosaic_model()  # as each client's host builds it
        head_names = [n for n in model.param_names if "lora_" not in n]
        assert head_names
        ctx = mosaic_context(model, cid)
        FedMosaic(head="frozen").local_train(ctx, random_slot(model, cid))
        heads[cid] = {n: ctx.state[LOCAL][n] for n in head_names}
        assert all(torch.equal(t, model.initial_params[n]) for n, t in heads[cid].items())
        adapter = FedMosaic(head="frozen").client_adapter(ctx, random_slot(model, 9))
        assert all(torch.equal(adapter[n], t) for n, t in heads[cid].items())
    assert all(torch.equal(heads[0][n], heads[1][n]) for n in heads[0])
    model = mosaic_model()
    ctx = mosaic_context(model)
    FedMosaic().local_train(ctx, random_slot(model, 0))
    assert any(not torch.equal(ctx.state[LOCAL][n], model.initial_params[n]) for n in heads[0])

"""Dual LoRA adapters mixed by a learned gate (fedloom.models.dual, fedloom.models.gate) and
fedlocal_global (FedDPA) on the tiny random backbones and a small real MRPC subset: the
gate's closed form, the model at initialization, with the gate pinned to either adapter and
at any g against PEFT's single-LoRA model and the LoRA formula, the gate's gradients,
the global phase against FedAvg, and what crosses the client/server boundary in a run."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import needs_glue

from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult, ServerState, sharing
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.fedlocal_global import LOCAL, FedLocalGlobal
from fedloom.config import ConfigError, LoraConfig, ModelConfig, TrainConfig
from fedloom.data import Example, get_task
from fedloom.evaluation.score import evaluate
from fedloom.experiment import Experiment
from fedloom.models.backbones import load_backbone
from fedloom.models.catalog import resolve_backbone
from fedloom.models.dual import LOCAL_PATTERNS, global_only, is_local
from fedloom.models.fedmodel import FedModel
from fedloom.models.gate import InputGate, mean_pool
from fedloom.params import Params
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate

MRPC = get_task("MRPC")
EXAMPLES = [
    Example("The cat sat on the mat.", "A cat was sitting on a mat.", 1),
    Example("Stocks fell sharply on Monday after the report.", "Markets rose.", 0),
    Example("He said no.", "He refused the offer made by the committee last week.", 0),
    Example("Rain is expected tomorrow in the north.", "It will probably rain up north.", 1),
    Example("The vote was postponed.", "Lawmakers delayed the vote until May.", 1),
    Example("Prices rose.", "The company reported record losses in its third quarter.", 0),
]
GATE_W, GATE_B = "encoder.lora_gate.proj.weight", "encoder.lora_gate.proj.bias"


def build(backbone: str = "tiny-bert", adapters: str = "dual", **lora: object) -> FedModel:
    cfg = ModelConfig(backbone=backbone, adapters=adapters, lora=LoraConfig(**lora),
                      precision="fp32")
    return FedModel.build(cfg, MRPC, max_length=64, seed=0)


def randomized(model: FedModel, seed: int) -> Params:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * 0.2 for n, p in model.get_params().items()}


def gate_of(prefix: str) -> tuple[str, str]:
    return f"{prefix}.lora_gate.proj.weight", f"{prefix}.lora_gate.proj.bias"


def pinned(params: Params, bias: float, prefix: str = "encoder") -> Params:
    """``params`` with the gate constant: v = 0 and b = ``bias`` (±inf pins g to 1 or 0)."""
    w, b = gate_of(prefix)
    return {**params, w: torch.zeros_like(params[w]), b: torch.full_like(params[b], bias)}


def as_single(params: Params, adapter: str) -> Params:
    """The dual adapter's ``adapter`` LoRA and head under the single-LoRA model's names."""
    tag = f".{adapter}."
    return {
        n.replace(tag, "."): t for n, t in params.items()
        if tag in n or "lora_" not in n
    }


def per_example_loss(model: FedModel, params: Params) -> torch.Tensor:
    model.set_params(params)
    model.head.eval()
    return model.head.predict(model.head.collate(model.encode(EXAMPLES)))[1]


def captured_gate(model: FedModel, features: list) -> torch.Tensor:
    """The gate values g(x) of one forward pass over ``features``."""
    seen: list[torch.Tensor] = []
    gate = next(m for m in model.head.modules() if isinstance(m, InputGate))
    handle = gate.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    model.predict(features, 32)
    handle.remove()
    return torch.cat(seen)


# --- the gate layer -----------------------------------------------------------------------


def test_gate_is_a_sigmoid_of_the_normalized_features() -> None:
    gate = InputGate(4)
    features = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]])
    assert torch.equal(gate(features), torch.full((2,), 0.5))  # initialization: g = 1/2
    with torch.no_grad():
        gate.proj.weight.copy_(torch.tensor([[1.0, 2.0, 0.0, 0.0]]))
        gate.proj.bias.fill_(-0.5)
    # ê = (0.6, 0.8, 0, 0): z = 0.6 + 1.6 - 0.5 = 1.7;  ê = (0, 0, 1, 0): z = -0.5
    expected = torch.tensor([1 / (1 + math.exp(-1.7)), 1 / (1 + math.exp(0.5))])
    assert torch.allclose(gate(features), expected, atol=1e-7)
    assert torch.allclose(expected, torch.tensor([0.845535, 0.377541]), atol=1e-6)
    with torch.no_grad():
        gate.proj.bias.fill_(float("inf"))
    assert torch.equal(gate(features), torch.ones(2))  # pinned: exactly 1
    with torch.no_grad():
        gate.proj.bias.fill_(-float("inf"))
    assert torch.equal(gate(features), torch.zeros(2))


def test_mean_pool_ignores_padding() -> None:
    tokens = torch.tensor([[[1.0, 2.0], [3.0, 6.0], [100.0, 100.0]]])
    assert torch.equal(mean_pool(tokens, torch.tensor([[1, 1, 0]])), torch.tensor([[2.0, 4.0]]))


# --- the dual model -----------------------------------------------------------------------


@pytest.mark.parametrize(("backbone", "prefix"), [("tiny-bert", "encoder"), ("tiny-llama", "lm")])
def test_names_make_the_split_a_pattern(backbone: str, prefix: str) -> None:
    dual, single = build(backbone), build(backbone, adapters="single")
    names = dual.param_names
    lora_single = [n for n in single.param_names if "lora_" in n]
    glob = [n for n in names if ".global." in n]
    local = [n for n in names if is_local(n)]
    assert len(glob) == len(lora_single) == (24 if backbone == "tiny-bert" else 28)
    assert sorted(n.replace(".global.", ".") for n in glob) == sorted(lora_single)
    # the local part: every local LoRA factor plus the gate's weight and bias (llama's
    # mlp.gate_proj is not the gate)
    assert len(local) == len(glob) + 2
    assert set(gate_of(prefix)) <= set(local)
    shared, mine = sharing.split(dual.get_params(), LOCAL_PATTERNS)
    assert set(mine) == set(local) and not any(map(is_local, shared))
    head = sharing.select(names, [sharing.HEAD])  # the gate is not "head"
    assert head == [n for n in single.param_names if "lora_" not in n]


@pytest.mark.parametrize("backbone", ["tiny-bert", "tiny-llama"])
def test_at_initialization_the_dual_model_is_the_frozen_backbone(backbone: str) -> None:
    dual = build(backbone)
    raw, _ = load_backbone(resolve_backbone(backbone), seed=0)
    raw.eval()
    batch = dual.head.collate(dual.encode(EXAMPLES))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    dual.head.eval()
    with torch.no_grad():
        if backbone == "tiny-bert":
            ours, frozen = dual.head.encoder(**inputs).last_hidden_state, raw(**inputs).last_hidden_state
        else:
            inputs["position_ids"] = batch["position_ids"]
            ours, frozen = dual.head.lm(**inputs).logits, raw(**inputs).logits
    assert all(float(t.abs().max()) == 0.0 for n, t in dual.get_params().items() if "lora_B" in n)
    assert torch.equal(ours, frozen)  # both B's zero: exactly the backbone


@pytest.mark.parametrize(("backbone", "prefix"), [("tiny-bert", "encoder"), ("tiny-llama", "lm")])
def test_pinned_gate_is_the_single_lora_model_of_that_adapter(backbone: str, prefix: str) -> None:
    dual, single = build(backbone), build(backbone, adapters="single")
    params = randomized(dual, seed=1)  # both adapters non-zero
    for adapter, bias in (("global", float("inf")), ("local", -float("inf"))):
        mixed = per_example_loss(dual, pinned(params, bias, prefix))
        alone = per_example_loss(single, as_single(params, adapter))
        assert torch.equal(mixed, alone), (adapter, float((mixed - alone).abs().max()))
    # and the server's view of the global adapter (local zeroed, gate at +inf) is the same
    assert torch.equal(per_example_loss(dual, global_only(params)),
                       per_example_loss(single, as_single(params, "global")))
    # a gate strictly inside (0, 1) is neither
    half = per_example_loss(dual, pinned(params, 0.0, prefix))
    assert float((half - per_example_loss(single, as_single(params, "global"))).abs().max()) > 1e-3


def test_every_adapted_layer_computes_the_gated_lora_formula() -> None:
    """y = W x + b + (α/r)(g B_g A_g x + (1 − g) B_l A_l x), α/r = 12/4 = 3, g from the
    mean token embedding, for layer 0's query projection of tiny-bert."""
    dual = build(r=4, alpha=12.0, dropout=0.0)
    params = randomized(dual, seed=2)
    dual.set_params(params)
    peft_model = dual.head.encoder
    query = peft_model.base_model.model.encoder.layer[0].attention.self.query
    assert query.scaling == {"global": 3.0, "local": 3.0}
    seen: dict[str, torch.Tensor] = {}
    handle = query.register_forward_hook(lambda _m, args, out: seen.update(x=args[0], y=out))
    batch = dual.head.collate(dual.encode(EXAMPLES))
    dual.head.eval()
    with torch.no_grad():
        dual.head.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    handle.remove()
    emb = peft_model.get_input_embeddings()(batch["input_ids"])
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (emb * mask).sum(1) / mask.sum(1)
    z = (pooled / pooled.norm(dim=-1, keepdim=True)) @ params[GATE_W][0] + params[GATE_B]
    g = torch.sigmoid(z).view(-1, 1, 1)
    assert float(g.max() - g.min()) > 0.01  # differs between inputs

    def delta(adapter: str) -> torch.Tensor:
        key = "encoder.encoder.layer.0.attention.self.query.lora_{}." + adapter + ".weight"
        return seen["x"] @ params[key.format("A")].T @ params[key.format("B")].T

    base = query.base_layer(seen["x"])
    expected = base + 3.0 * (g * delta("global") + (1 - g) * delta("local"))
    assert torch.allclose(seen["y"], expected, atol=1e-5), float((seen["y"] - expected).abs().max())


def test_the_gate_receives_gradients_once_the_adapters_differ() -> None:
    dual = build()
    features = dual.encode(EXAMPLES)
    batch = dual.head.collate(features)
    gate = dual.trainable_parameters()

    def gate_grads() -> tuple[float, float]:
        for p in gate.values():
            p.grad = None
        dual.loss(batch).backward()
        return float(gate[GATE_W].grad.norm()), float(gate[GATE_B].grad.abs().sum())

    dual.head.eval()
    # at initialization both B's are zero: the two branches agree, dL/dg = 0 exactly
    assert gate_grads() == (0.0, 0.0)
    assert torch.equal(captured_gate(dual, features), torch.full((len(EXAMPLES),), 0.5))
    dual.set_params(randomized(dual, seed=3))
    w_grad, b_grad = gate_grads()
    assert w_grad > 1e-4 and b_grad > 1e-4
    values = captured_gate(dual, features)
    assert ((values > 0) & (values < 1)).all() and float(values.max() - values.min()) > 0.01


def test_a_causal_lms_gate_reads_the_prompt_never_the_answer() -> None:
    """MRPC's answers ("not equivalent" / "equivalent") differ in tokens and length; the
    gate with which every answer option of an example is scored (computed once on the
    prompts, then held for the options' continuations), and the gate of the training
    sequence with the gold answer, is the gate of the prompt alone."""
    dual = build("tiny-llama")
    params = randomized(dual, seed=4)
    params["lm.lora_gate.proj.weight"] = params["lm.lora_gate.proj.weight"] * 50
    dual.set_params(params)
    features = dual.encode(EXAMPLES)
    seen: list[torch.Tensor] = []
    gate = next(m for m in dual.head.modules() if isinstance(m, InputGate))
    handle = gate.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    dual.head.eval()
    with torch.no_grad():
        dual.head.predict(dual.head.collate(features))  # every option of every example
        dual.head.loss(dual.head.collate(features))  # the gold answers
        dual.head.embed(features)  # the prompts alone
    handle.remove()
    options, gold, prompt = seen  # scoring computed the gate once for all the options
    assert torch.allclose(options, prompt, atol=1e-6)
    assert torch.allclose(gold, prompt, atol=1e-6)
    assert float(prompt.max() - prompt.min()) > 0.01  # and it does depend on the input


# --- the algorithm ------------------------------------------------------------------------


def context(model: FedModel, state: dict, settings: TrainConfig, seed: int = 7) -> ClientContext:
    return ClientContext(0, model, model.encode(EXAMPLES), settings, round=0, total_rounds=2,
                         state=state, seed=seed)


def test_the_global_phase_is_fedavgs_local_training_of_the_global_adapter() -> None:
    """The sent global adapter equals FedAvg's update of the single-LoRA model started from
    the same values: the personal phase before it and the pinned local branch change nothing."""
    settings = TrainConfig(local_steps=3, batch_size=4, lr=5e-3)
    dual, single = build(dropout=0.0), build(adapters="single", dropout=0.0)
    alg = FedLocalGlobal()
    payload = alg.payload(alg.init(dual.get_params()), 0)
    assert not any(map(is_local, payload))
    state: dict = {}
    ours = alg.local_train(context(dual, state, settings), payload)
    theirs = FedAvg().local_train(context(single, {}, settings), as_single(payload, "global"))
    assert set(ours.params) == set(payload)
    gap = max(float((ours.params[n] - theirs.params[n.replace(".global.", ".")]).abs().max())
              for n in ours.params)
    assert gap < 1e-6, gap
    moved = max(float((ours.params[n] - payload[n]).abs().max()) for n in payload)
    assert moved > 1e-3  # it trained
    # the personal phase trained the local LoRA and the gate, and kept them on the client
    local = state[LOCAL]
    assert set(local) == {n for n in dual.param_names if is_local(n)}
    assert max(float(t.abs().max()) for n, t in local.items() if "lora_B.local" in n) > 1e-4
    assert float(local[GATE_W].abs().max()) > 0 and "personal_loss" in ours.metrics
    # the client's adapter merges the payload with its own part, without touching its state
    before = {n: t.clone() for n, t in local.items()}
    adapter = alg.client_adapter(context(dual, state, settings), payload)
    assert adapter == {**payload, **local}
    assert all(torch.equal(before[n], state[LOCAL][n]) for n in before)
    # a client that never trained uses the global adapter alone
    fresh = alg.client_adapter(context(dual, {}, settings), payload)
    assert float(fresh[GATE_B]) == math.inf
    assert all(float(t.abs().max()) == 0 for n, t in fresh.items() if ".local." in n)


def test_hyperparameters_and_model_are_checked() -> None:
    with pytest.raises(algorithms.AlgorithmError, match=r"^algorithm\.personal_steps: must be >= 1"):
        algorithms.create("fedlocal_global", personal_steps=0)
    with pytest.raises(ValueError, match=r"^model\.adapters: fedlocal_global needs"):
        FedLocalGlobal().check_model(build(adapters="single").get_params())


def test_explicit_single_adapters_are_refused(make_config) -> None:
    cfg = make_config("algorithm.name=fedlocal_global", 'model.adapters="single"')
    with pytest.raises(ConfigError, match=r"^model\.adapters: algorithm fedlocal_global needs"):
        Experiment.build(cfg)


def spy_on(exp: Experiment) -> dict[str, list]:
    """Make ``exp.algorithm`` record every payload, every ClientResult.params, every
    aggregated result and each client's local part after its round (client id, Params)."""
    seen: dict[str, list] = {"payload": [], "sent": [], "aggregated": [], "kept": []}

    class Spy(FedLocalGlobal):
        log: ClassVar[dict[str, list]] = seen

        def local_train(self, ctx: ClientContext, payload: Params) -> ClientResult:
            self.log["payload"].append(dict(payload))
            result = super().local_train(ctx, payload)
            self.log["sent"].append(dict(result.params))
            self.log["kept"].append((ctx.client_id, dict(ctx.state[LOCAL])))
            return result

        def aggregate(self, state: ServerState, results: list[ClientResult]) -> ServerState:
            self.log["aggregated"].extend(dict(r.params) for r in results)
            return super().aggregate(state, results)

    exp.algorithm = Spy(**{f.name: getattr(exp.algorithm, f.name)
                           for f in dataclasses.fields(exp.algorithm)})
    return seen


@needs_glue
def test_simulation_keeps_the_local_part_on_the_clients(make_config, tmp_path: Path) -> None:
    cfg = make_config("algorithm.name=fedlocal_global", "diagnostics.every=0")
    exp = Experiment.build(cfg)
    assert exp.cfg.model.adapters == "dual"  # chosen for the method
    seen = spy_on(exp)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)

    local_names = {n for n in exp.model.param_names if is_local(n)}
    global_names = set(exp.model.param_names) - local_names
    assert len(local_names) == 26 and len(global_names) == 26  # 24 LoRA + gate 2 / head 2
    crossing = seen["payload"] + seen["sent"] + seen["aggregated"]
    assert len(crossing) == 3 * 2 * 3  # 3 clients x 2 rounds, three views each
    assert all(set(p) == global_names for p in crossing)
    # what the clients kept is nowhere in what they sent, and it trained
    for (_, kept), sent in zip(seen["kept"], seen["sent"], strict=True):
        assert set(kept) == local_names and not set(kept) & set(sent)
        assert max(float(t.abs().max()) for n, t in kept.items() if "lora_B.local" in n) > 1e-4

    # summary.json carries the clients' personal scores and the global adapter's
    written = json.loads((run.path / "summary.json").read_text())
    assert written["personal"] == summary["personal"]
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    last = [r for r in rows if r.get("scope") == "personal/clients"][-1]
    per_client = [v["accuracy"] for v in last["per_client"].values()]
    assert len(per_client) == 3
    assert written["personal"]["clients"]["accuracy"]["mean"] == pytest.approx(np.mean(per_client))
    assert set(written["global"]) >= {"dev", "clients"}
    assert tomllib.loads((run.path / "config.toml").read_text())["model"]["adapters"] == "dual"

    # the server scores the global adapter alone: its dev scores are the single-LoRA
    # model's with the global adapter of the final checkpoint
    final = load_params(run.checkpoints / "global.safetensors")
    assert float(final[GATE_B]) == math.inf
    single = FedModel.build(exp.cfg.model.model_copy(update={"adapters": "single"}), exp.task,
                            exp.cfg.data.max_length, exp.cfg.seed)
    scored = evaluate(single, as_single(final, "global"), exp.dev, exp.cfg.eval.batch_size)
    assert scored["accuracy"] == written["global"]["dev"]["accuracy"]
    assert scored["loss"] == pytest.approx(written["global"]["dev"]["loss"], abs=1e-6)

    # client 0's trained gate weights its own test inputs differently
    kept = [local for cid, local in seen["kept"] if cid == 0][-1]
    exp.model.set_params({**{n: t for n, t in final.items() if not is_local(n)}, **kept})
    values = captured_gate(exp.model, exp.clients[0].test)
    assert float(values.max() - values.min()) > 0, values

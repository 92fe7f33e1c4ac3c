"""PQ-LoRA (fedloom.models.pqlora) and FedMosaic's gated mosaic model (fedloom.models.mosaic,
fedloom.models.gate.NoisyTokenGate): the layer against its formula and against PEFT's LoRA,
the target blocks, what is trainable, the model at initialization, and the gate's
gradients (including the noise weight the official code never trains)."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from fedloom.config import LoraConfig, ModelConfig, TrainConfig
from fedloom.data import Example, get_task
from fedloom.models.dual import GLOBAL, LOCAL, global_only, is_local
from fedloom.models.fedmodel import FedModel
from fedloom.models.gate import NoisyTokenGate
from fedloom.models.mosaic import is_mosaic
from fedloom.models.pqlora import (
    PQ_P,
    PQ_Q,
    is_pq,
    layer_index,
    make_pq,
    orthonormal,
    pq_block_count,
    target_blocks,
)
from fedloom.train.local import build_optimizer

MRPC = get_task("MRPC")
EXAMPLES = [
    Example("The cat sat on the mat.", "A cat was sitting on a mat.", 1),
    Example("Stocks fell sharply on Monday.", "Markets rose after the report.", 0),
    Example("He said no.", None, 0),
]
D_IN, D_OUT, R, ALPHA = 12, 10, 4, 8.0


def lora_linear(seed: int) -> nn.Module:
    """A PEFT LoRA adapter ("default") on one linear layer, with random (nonzero) A and B."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, D_OUT))
    peft = get_peft_model(model, PeftLoraConfig(r=R, lora_alpha=ALPHA, target_modules=["0"], lora_dropout=0.0))
    layer = lora_layer(peft)
    nn.init.normal_(layer.lora_B["default"].weight)
    return peft


def lora_layer(model: nn.Module) -> LoraLayer:
    return next(m for m in model.modules() if isinstance(m, LoraLayer))


def test_pq_forward_equals_the_formula() -> None:
    model = lora_linear(0)
    layer = lora_layer(model)
    make_pq(layer, ["default"], torch.Generator().manual_seed(1))
    p = getattr(layer, PQ_P)["default"]
    q = getattr(layer, PQ_Q)["default"]
    with torch.no_grad():
        p.copy_(torch.randn(R, R))
        q.copy_(torch.randn(1, R))
    x = torch.randn(5, D_IN)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w, bias = layer.base_layer.weight, layer.base_layer.bias
    expected = x @ w.T + bias + (ALPHA / R) * (((x @ a.T) @ p + q) @ b.T)
    torch.testing.assert_close(model(x), expected)


def test_pq_with_identity_p_and_zero_q_is_lora_with_the_same_a_and_b() -> None:
    pq_model, plain = lora_linear(0), lora_linear(0)
    pq_layer, plain_layer = lora_layer(pq_model), lora_layer(plain)
    make_pq(pq_layer, ["default"], torch.Generator().manual_seed(2))
    with torch.no_grad():
        getattr(pq_layer, PQ_P)["default"].copy_(torch.eye(R))
        plain_layer.lora_A["default"].weight.copy_(pq_layer.lora_A["default"].weight)
        plain_layer.lora_B["default"].weight.copy_(pq_layer.lora_B["default"].weight)
    x = torch.randn(7, D_IN)
    torch.testing.assert_close(pq_model(x), plain(x))
    # and differs as soon as P moves (the test can fail)
    with torch.no_grad():
        getattr(pq_layer, PQ_P)["default"].mul_(2.0)
    assert not torch.allclose(pq_model(x), plain(x))


def test_pq_factors_are_frozen_orthonormal_and_p_q_start_at_zero() -> None:
    layer = lora_layer(lora_linear(0))
    make_pq(layer, ["default"], torch.Generator().manual_seed(3))
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert not a.requires_grad and not b.requires_grad
    torch.testing.assert_close(a @ a.T, torch.eye(R), atol=1e-5, rtol=0)
    torch.testing.assert_close(b.T @ b, torch.eye(R), atol=1e-5, rtol=0)
    assert getattr(layer, PQ_P)["default"].abs().sum() == 0
    assert getattr(layer, PQ_Q)["default"].abs().sum() == 0


def test_orthonormal_is_seeded() -> None:
    one = orthonormal(6, 3, torch.Generator().manual_seed(0))
    assert torch.equal(one, orthonormal(6, 3, torch.Generator().manual_seed(0)))
    assert not torch.equal(one, orthonormal(6, 3, torch.Generator().manual_seed(1)))


@pytest.mark.parametrize(
    ("layers", "blocks", "expected"),
    [(6, 4, [0, 1, 2, 5]), (30, 4, [6, 13, 20, 29]), (2, 2, [0, 1]), (6, 1, [5]), (8, 8, list(range(8)))],
)
def test_target_blocks(layers: int, blocks: int, expected: list[int]) -> None:
    assert target_blocks(layers, blocks) == expected


@pytest.mark.parametrize("blocks", [0, 7])
def test_target_blocks_refuses_impossible_counts(blocks: int) -> None:
    with pytest.raises(ValueError, match="model.lora.pq_blocks"):
        target_blocks(6, blocks)


@pytest.mark.parametrize(
    ("setting", "adapted", "expected"),
    # by depth: one per six adapted blocks, at least one (FedMosaic's 4 of 16-28 blocks);
    # an integer is capped by the adapted blocks
    [("auto", 6, 1), ("auto", 2, 1), ("auto", 10, 1), ("auto", 16, 2), ("auto", 28, 4),
     ("auto", 30, 5), ("auto", 0, 0), (4, 6, 4), (4, 2, 2), (0, 6, 0)],
)
def test_pq_block_count(setting: int | str, adapted: int, expected: int) -> None:
    assert pq_block_count(setting, adapted) == expected  # type: ignore[arg-type]


def test_the_default_puts_one_pq_block_on_a_six_block_backbone() -> None:
    """MiniLM's depth: "auto" is the default and gives the top block only (issue 41: the
    old default of 4 made 4 of MiniLM's 6 blocks PQ-LoRA)."""
    assert LoraConfig().pq_blocks == "auto"
    assert target_blocks(6, pq_block_count(LoraConfig().pq_blocks, 6)) == [5]


def test_layer_index_reads_bert_and_llama_names() -> None:
    assert layer_index("encoder.layer.3.attention.self.query") == 3
    assert layer_index("model.layers.12.mlp.down_proj") == 12
    assert layer_index("classifier") is None


def build(pq_blocks: int = 2, adapters: str = "mosaic", backbone: str = "tiny-bert") -> FedModel:
    cfg = ModelConfig(backbone=backbone, adapters=adapters, lora=LoraConfig(r=4, pq_blocks=pq_blocks),
                      precision="fp32")
    return FedModel.build(cfg, MRPC, max_length=64, seed=0)


def test_mosaic_model_trainables_and_names() -> None:
    model = build(pq_blocks=1)  # 2 layers, 1 block: layer 1 carries PQ-LoRA
    names = model.param_names
    assert is_mosaic(names)
    pq = [n for n in names if is_pq(n)]
    assert pq and all(layer_index(n) == 1 for n in pq)
    assert {n.rsplit(".", 1)[-1] for n in pq} == {GLOBAL, LOCAL}
    # a PQ layer's A and B are frozen (not Params); a plain layer's are trainable
    assert not any("layer.1." in n and (".lora_A." in n or ".lora_B." in n) for n in names)
    assert any("layer.0." in n and ".lora_A.local." in n for n in names)
    # one gate per adapted layer, with a noise weight, in the local part
    gates = [n for n in names if ".lora_gate." in n]
    layers = {n.split(".lora_")[0] for n in names if ".lora_" in n}
    assert len(gates) == 3 * len(layers)
    assert all(is_local(n) for n in gates)
    assert all(is_local(n) == n.endswith(".local") for n in pq)


def test_a_shallow_backbone_gets_pq_lora_in_every_layer() -> None:
    names = build(pq_blocks=4).param_names  # tiny-bert has 2 layers
    assert {layer_index(n) for n in names if is_pq(n)} == {0, 1}


def test_mosaic_model_starts_as_the_backbone() -> None:
    mosaic, single = build(pq_blocks=2), build(adapters="single")
    batch = mosaic.head.collate(mosaic.encode(EXAMPLES))
    mosaic.head.eval()
    single.head.eval()
    torch.testing.assert_close(mosaic.head._pooled(batch), single.head._pooled(batch))


def test_global_only_pins_every_layer_gate_to_the_global_adapter() -> None:
    model = build(pq_blocks=2)
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(t.shape, generator=g) * 0.3 for n, t in model.get_params().items()}
    batch = model.head.collate(model.encode(EXAMPLES))
    model.head.eval()
    model.set_params(global_only(params))
    pinned = model.head._pooled(batch)
    # changing the local part changes nothing once the gates are pinned
    other = {n: (t + 1.0 if is_local(n) and ".lora_gate." not in n else t) for n, t in params.items()}
    model.set_params(global_only(other))
    torch.testing.assert_close(model.head._pooled(batch), pinned)
    model.set_params(params)
    assert not torch.allclose(model.head._pooled(batch), pinned)


def test_gate_gradients_reach_the_gate_and_the_noise_weight() -> None:
    model = build(pq_blocks=2)
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(t.shape, generator=g) * 0.3 for n, t in model.get_params().items()}
    model.set_params(params)
    model.head.train()
    torch.manual_seed(0)
    model.loss(model.head.collate(model.encode(EXAMPLES))).backward()
    trainable = model.trainable_parameters()
    for suffix in ("lora_gate.proj.weight", "lora_gate.proj.bias", "lora_gate.noise.weight"):
        grads = [p.grad for n, p in trainable.items() if n.endswith(suffix)]
        assert grads and all(gr is not None and gr.abs().sum() > 0 for gr in grads), suffix
    # the gates train at the adapters' learning rate, not the head's
    groups = build_optimizer(TrainConfig(lr=1e-3, head_lr=5e-2), trainable).param_groups
    adapter_group = next(gr for gr in groups if gr["kind"] == "adapters")
    gate_ids = {id(p) for n, p in trainable.items() if ".lora_gate." in n}
    assert gate_ids <= {id(p) for p in adapter_group["params"]}
    assert adapter_group["lr"] == 1e-3


def test_noisy_gate_is_deterministic_in_eval_and_noisy_in_training() -> None:
    gate = NoisyTokenGate(8)
    with torch.no_grad():
        gate.proj.weight.normal_()
    tokens = torch.randn(3, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    gate.eval()
    clean = gate(tokens, mask)
    logits = (tokens @ gate.proj.weight.T).squeeze(-1) + gate.proj.bias
    expected = torch.sigmoid((logits * mask).sum(1) / mask.sum(1))
    torch.testing.assert_close(clean, expected)
    # padding never matters
    padded = tokens.clone()
    padded[0, 3:] = 100.0
    torch.testing.assert_close(gate(padded, mask), clean)
    gate.train()
    torch.manual_seed(0)
    assert not torch.allclose(gate(tokens, mask), clean)


def test_noise_scale_starts_at_softplus_zero() -> None:
    """With u = 0 the per-token noise has std softplus(0) = ln 2 (plus 1e-5): the logit
    mean over n tokens has std ln 2 / sqrt(n) (statistical check over many draws)."""
    gate = NoisyTokenGate(4)
    gate.train()
    n, draws = 4, 4000
    tokens = torch.randn(draws, n, 4)
    torch.manual_seed(0)
    logit = torch.logit(gate(tokens, None).double())
    expected = (math.log(2.0) + 1e-5) / math.sqrt(n)
    # the sample std of `draws` normal values has relative standard error 1/sqrt(2 draws)
    assert abs(logit.std().item() / expected - 1) < 4 / math.sqrt(2 * draws)

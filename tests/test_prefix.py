"""Frozen-prefix caching (fedloom.models.prefix) and ``model.lora.layers``: a cached model
computes what the full forward pass computes, and really reads the cache."""

from __future__ import annotations

import pytest
import torch
from test_models import EXAMPLES as MODEL_EXAMPLES

from fedloom.config import LoraConfig, ModelConfig
from fedloom.data import Example, get_task
from fedloom.models.fedmodel import FedModel
from fedloom.models.pqlora import PQ_P, adapted_blocks, layer_index, pq_layers

MRPC = get_task("MRPC")

EXAMPLES = [*MODEL_EXAMPLES, Example("Rain is expected tomorrow.", "It will probably rain.", 1)]


def build(backbone: str, adapters: str = "single", prefix_cache: bool = False,
          layers: list[int] | None = None) -> FedModel:
    cfg = ModelConfig(backbone=backbone, adapters=adapters, prefix_cache=prefix_cache,
                      lora=LoraConfig(layers=layers, dropout=0.0), precision="fp32")
    return FedModel.build(cfg, MRPC, max_length=64, seed=0)


def perturbed(model: FedModel, seed: int = 1) -> dict[str, torch.Tensor]:
    """The model's adapter plus noise, so that B ≠ 0 and the gates move."""
    g = torch.Generator().manual_seed(seed)
    return {n: p + 0.2 * torch.randn(p.shape, generator=g) for n, p in model.get_params().items()}


def loss_and_grads(model: FedModel, features: list) -> tuple[float, dict[str, torch.Tensor]]:
    model.head.eval()  # the prefix runs without dropout when cached; compare like with like
    for p in model.trainable_parameters().values():
        p.grad = None
    loss = model.loss(model.head.collate(features))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.trainable_parameters().items()
                         if p.grad is not None}


CASES = [(b, a) for b in ("tiny-bert", "tiny-llama") for a in ("single", "dual", "mosaic")]


@pytest.mark.parametrize(("backbone", "adapters"), CASES)
def test_cached_prefix_gives_the_full_passes_loss_gradients_and_predictions(
        backbone: str, adapters: str) -> None:
    full = build(backbone, adapters, layers=[1])
    cached = build(backbone, adapters, prefix_cache=True, layers=[1])
    adapter = perturbed(full)
    full.set_params(adapter)
    cached.set_params(adapter)
    features = full.encode(EXAMPLES)
    for _ in range(2):  # first computing the prefix, then replaying it
        loss_full, grads_full = loss_and_grads(full, features[:3])
        loss_cached, grads_cached = loss_and_grads(cached, features[:3])
        assert loss_cached == pytest.approx(loss_full, abs=1e-5)
        assert grads_cached.keys() == grads_full.keys() and grads_full
        for name, grad in grads_full.items():
            torch.testing.assert_close(grads_cached[name], grad, atol=1e-5, rtol=1e-4)
    assert len(cached.head.prefix) == 3
    # scoring: other batches (other padding), the rest of the examples computed on demand
    pred_full, _, losses_full = full.predict_each(features, batch_size=2)
    pred_cached, _, losses_cached = cached.predict_each(features, batch_size=2)
    assert (pred_cached == pred_full).all()
    torch.testing.assert_close(torch.as_tensor(losses_cached), torch.as_tensor(losses_full),
                               atol=1e-5, rtol=1e-4)
    # a verbalizer caches only what trained (each example's answer); its other options
    # are scored from the prompt's key/value cache unless the prefix holds them all
    assert len(cached.head.prefix) == (len(EXAMPLES) if backbone == "tiny-bert" else 3)


def test_verbalizer_scores_options_from_the_cache_once_it_holds_them() -> None:
    full = build("tiny-llama", "mosaic", layers=[1])
    cached = build("tiny-llama", "mosaic", prefix_cache=True, layers=[1])
    adapter = perturbed(full)
    full.set_params(adapter)
    cached.set_params(adapter)
    features = full.encode(EXAMPLES)
    head = cached.head
    full.head.eval()  # the gates' noise is off
    head.eval()
    for k in range(len(MRPC.verbalizer)):  # put every option's sequence in the cache
        head.loss(head._sequences(features, [k] * len(features)))
    with torch.no_grad():  # change block 0: a replayed pass does not see it
        for name, p in cached.head.named_parameters():
            if layer_index(name) == 0 and not p.requires_grad:
                p.mul_(1.5)
    scores_full, counts_full = full.head.option_scores(features)
    scores_cached, counts_cached = head.option_scores(features)
    torch.testing.assert_close(scores_cached, scores_full, atol=1e-4, rtol=1e-4)
    assert torch.equal(counts_cached, counts_full)


@pytest.mark.parametrize("backbone", ["tiny-bert", "tiny-llama"])
def test_a_cached_model_reads_the_cache_not_the_prefix_blocks(backbone: str) -> None:
    full = build(backbone, layers=[1])
    cached = build(backbone, prefix_cache=True, layers=[1])
    features = full.encode(EXAMPLES)
    batch = full.head.collate(features)
    cached.head.eval()
    full.head.eval()
    before = cached.loss(batch).item()
    with torch.no_grad():  # change block 0 of both backbones: only the full pass sees it
        for model in (full, cached):
            for name, p in model.head.named_parameters():
                if layer_index(name) == 0 and not p.requires_grad:
                    p.mul_(1.5)
    assert cached.loss(batch).item() == pytest.approx(before, abs=1e-6)
    assert abs(full.loss(batch).item() - before) > 1e-4


def test_training_mode_keeps_the_prefix_deterministic_and_restores_the_mode() -> None:
    cached = build("tiny-bert", prefix_cache=True, layers=[1])
    features = cached.encode(EXAMPLES)
    cached.head.train()
    cached.loss(cached.head.collate(features))
    assert cached.head.training and cached.transformer.training
    assert all(m.training for m in cached.transformer.modules())


def test_prefix_cache_needs_unadapted_lower_blocks() -> None:
    with pytest.raises(ValueError, match=r"model\.lora\.layers"):
        build("tiny-bert", prefix_cache=True)


def test_lora_layers_out_of_range_is_named() -> None:
    with pytest.raises(ValueError, match=r"model\.lora\.layers: block 2 does not exist"):
        build("tiny-bert", layers=[2])


def test_lora_layers_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        LoraConfig(layers=[1, 1])


@pytest.mark.parametrize("backbone", ["tiny-bert", "tiny-llama"])
def test_lora_layers_adapts_only_those_blocks(backbone: str) -> None:
    model = build(backbone, layers=[1])
    blocks = {layer_index(n) for n in model.param_names} - {None}
    assert blocks == {1}
    assert adapted_blocks(model.transformer) == [1]


def test_pq_layers_spread_over_the_adapted_blocks() -> None:
    assert pq_layers(list(range(30)), 4) == [6, 13, 20, 29]
    assert pq_layers(list(range(24, 30)), 4) == [24, 25, 26, 29]
    model = build("tiny-llama", adapters="mosaic", layers=[1])
    pq = {layer_index(n) for n, m in model.transformer.named_modules() if hasattr(m, PQ_P)}
    assert pq == {1}

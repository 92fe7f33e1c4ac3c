"""FedModel on the tiny random backbones: Params get/set, heads, verbalizer scoring, LoRA."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedloom.config import LoraConfig, ModelConfig
from fedloom.data import Example, get_task
from fedloom.models.fedmodel import FedModel, clean_name
from fedloom.models.lora import DEFAULT_TARGET_MODULES

MRPC = get_task("MRPC")

EXAMPLES = [
    Example("The cat sat on the mat.", "A cat was sitting on a mat.", 1),
    Example("Stocks fell sharply on Monday after the report.", "Markets rose.", 0),
    Example("He said no.", "He refused the offer made by the committee last week.", 0),
    Example("Rain is expected tomorrow in the north.", "It will probably rain up north tomorrow.", 1),
]


def build(backbone: str, task=MRPC, seed: int = 0, **model: object) -> FedModel:
    """The model of ``backbone``, in fp32 unless ``precision`` says otherwise (these tests
    check the math against float32 references)."""
    lora = model.pop("lora", {})
    model.setdefault("precision", "fp32")
    cfg = ModelConfig(backbone=backbone, lora=LoraConfig(**lora), **model)
    return FedModel.build(cfg, task, max_length=64, seed=seed)


def frozen_parameters(model: FedModel) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.head.named_parameters() if not p.requires_grad}


def random_params(model: FedModel, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in model.get_params().items()}


@pytest.fixture(params=["tiny-bert", "tiny-llama"])
def model(request: pytest.FixtureRequest) -> FedModel:
    return build(request.param)


# --- building -----------------------------------------------------------------------------


def test_build_tiny_bert_is_a_classifier() -> None:
    m = build("tiny-bert")
    assert m.spec.kind == "encoder"
    assert type(m.head).__name__ == "ClassifierHead"
    assert m.head.classifier.out_features == MRPC.num_labels == 2
    assert m.task is MRPC


def test_build_tiny_llama_is_a_verbalizer() -> None:
    m = build("tiny-llama")
    assert m.spec.kind == "decoder"
    assert type(m.head).__name__ == "VerbalizerHead"
    eos = m.head.tokenizer.eos_token_id
    assert eos is not None
    assert len(m.head.options) == 2 and all(o[-1] == eos for o in m.head.options)


@pytest.mark.parametrize(
    ("backbone", "task", "head", "match"),
    [
        ("tiny-llama", "MRPC", "classifier", "model.head: 'classifier' needs an encoder"),
        ("tiny-bert", "MRPC", "verbalizer", "model.head: 'verbalizer' needs a causal-LM"),
        ("tiny-llama", "STS-B", "auto", "model.head: the verbalizer needs a classification task"),
    ],
)
def test_head_and_backbone_mismatch(backbone: str, task: str, head: str, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        build(backbone, get_task(task), head=head)


# --- Params: what is trainable --------------------------------------------------------------


def test_params_are_only_lora_factors_and_the_head(model: FedModel) -> None:
    params = model.get_params()
    assert params
    for name in params:
        is_lora = ".lora_A." in name or ".lora_B." in name
        is_head = name.startswith("classifier.")
        assert is_lora or is_head, name
        assert "base_layer" not in name and "embed" not in name
        assert "base_model" not in name and ".default." not in name  # PEFT noise removed
    heads = [n for n in params if n.startswith("classifier.")]
    if model.spec.kind == "encoder":
        assert sorted(heads) == ["classifier.bias", "classifier.weight"]
    else:
        assert heads == []  # the verbalizer scores with the frozen LM head
    # every adapted module contributes both factors
    a = {n.replace(".lora_A.", ".") for n in params if ".lora_A." in n}
    b = {n.replace(".lora_B.", ".") for n in params if ".lora_B." in n}
    assert a == b and a


def test_backbone_is_frozen_and_not_in_params(model: FedModel) -> None:
    params = model.get_params()
    trainable = {clean_name(n) for n, p in model.head.named_parameters() if p.requires_grad}
    assert trainable == set(params)
    frozen = frozen_parameters(model)
    assert frozen
    assert not set(map(clean_name, frozen)) & set(params)
    # the backbone holds the overwhelming majority of the weights
    assert sum(p.numel() for p in frozen.values()) > 10 * sum(t.numel() for t in params.values())


def test_lora_shapes_and_zero_init() -> None:
    m = build("tiny-bert", lora={"r": 4})
    for name, tensor in m.get_params().items():
        if ".lora_A." in name:
            # r x d_in: hidden size 32, or 64 for the FFN's output projection
            assert tensor.shape[0] == 4 and tensor.shape[1] in (32, 64)
            assert tensor.abs().sum() > 0
        elif ".lora_B." in name:
            assert tensor.shape[1] == 4
            assert torch.count_nonzero(tensor) == 0  # starts from the backbone's function


def module_paths(model: FedModel) -> set[str]:
    """Adapted module paths with the layer index replaced by '*'."""
    return {
        re.sub(r"\.\d+\.", ".*.", n.split(".lora_A.")[0])
        for n in model.get_params()
        if ".lora_A." in n
    }


def test_default_target_modules_bert() -> None:
    m = build("tiny-bert")
    assert module_paths(m) == {
        "encoder.encoder.layer.*.attention.self.query",
        "encoder.encoder.layer.*.attention.self.key",
        "encoder.encoder.layer.*.attention.self.value",
        "encoder.encoder.layer.*.attention.output.dense",
        "encoder.encoder.layer.*.intermediate.dense",
        "encoder.encoder.layer.*.output.dense",
    }
    # 6 modules x 2 layers x (A, B)
    assert sum(".lora_" in n for n in m.get_params()) == 24
    assert "query" in DEFAULT_TARGET_MODULES["bert"]


def test_default_target_modules_llama() -> None:
    m = build("tiny-llama")
    attn = {f"lm.model.layers.*.self_attn.{p}_proj" for p in "qkvo"}
    mlp = {f"lm.model.layers.*.mlp.{p}_proj" for p in ("gate", "up", "down")}
    assert module_paths(m) == attn | mlp
    assert len(m.get_params()) == 7 * 2 * 2


def test_explicit_target_modules() -> None:
    m = build("tiny-bert", lora={"target_modules": ["query", "value"]})
    assert module_paths(m) == {
        "encoder.encoder.layer.*.attention.self.query",
        "encoder.encoder.layer.*.attention.self.value",
    }


def test_unknown_target_module_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"^model\.lora\.target_modules: "):
        build("tiny-bert", lora={"target_modules": ["no_such_module"]})


# --- Params: get / set --------------------------------------------------------------------


def test_get_set_round_trip(model: FedModel) -> None:
    original = model.get_params()
    other = random_params(model, seed=1)
    model.set_params(other)
    got = model.get_params()
    assert got.keys() == other.keys()
    assert all(torch.equal(got[n], other[n]) for n in other)
    model.set_params(original)
    assert all(torch.equal(model.get_params()[n], original[n]) for n in original)


def test_get_params_returns_detached_copies(model: FedModel) -> None:
    params = model.get_params()
    name = next(iter(params))
    before = params[name].clone()
    params[name] += 1.0
    assert torch.equal(model.get_params()[name], before)
    assert not any(t.requires_grad for t in params.values())


def test_set_params_copies_in_place_and_leaves_the_backbone_alone(model: FedModel) -> None:
    trainable = model.trainable_parameters()
    frozen = frozen_parameters(model)
    trainable_ptrs = {n: p.data_ptr() for n, p in trainable.items()}
    frozen_ptrs = {n: p.data_ptr() for n, p in frozen.items()}
    frozen_values = {n: p.detach().clone() for n, p in frozen.items()}
    client_a, client_b = random_params(model, 1), random_params(model, 2)

    for params in (client_a, client_b, client_a):  # switching between two clients
        model.set_params(params)
        now = model.trainable_parameters()
        assert {n: p for n, p in now.items()}.keys() == trainable.keys()
        assert all(now[n] is trainable[n] for n in trainable)  # same Parameter objects
        assert {n: p.data_ptr() for n, p in now.items()} == trainable_ptrs
        assert all(torch.equal(now[n].detach(), params[n]) for n in params)
        # the adapter tensors do not alias the caller's dict
        assert all(now[n].data_ptr() != params[n].data_ptr() for n in params)

    after = frozen_parameters(model)
    assert {n: p.data_ptr() for n, p in after.items()} == frozen_ptrs
    assert all(torch.equal(after[n], frozen_values[n]) for n in frozen_values)


def test_set_params_changes_the_function(model: FedModel) -> None:
    features = model.encode(EXAMPLES)
    _, _, loss0 = model.predict(features, 8)
    model.set_params(random_params(model, 3))
    _, _, loss1 = model.predict(features, 8)
    assert loss0 != loss1


def test_set_params_missing_key_is_named(model: FedModel) -> None:
    params = model.get_params()
    name = min(params)
    del params[name]
    with pytest.raises(KeyError) as info:
        model.set_params(params)
    assert name in str(info.value) and "missing" in str(info.value)


def test_set_params_unexpected_key_is_named(model: FedModel) -> None:
    params = model.get_params()
    params["encoder.extra.lora_A.weight"] = torch.zeros(1)
    with pytest.raises(KeyError) as info:
        model.set_params(params)
    assert "encoder.extra.lora_A.weight" in str(info.value)


def test_set_params_wrong_shape_is_named(model: FedModel) -> None:
    before = model.get_params()
    params = random_params(model, 4)
    name = list(params)[-1]  # the last one copied
    params[name] = torch.zeros(params[name].numel() + 1)
    with pytest.raises(ValueError, match=re.escape(name)):
        model.set_params(params)
    # a rejected update leaves the adapter as it was (no half-written client)
    after = model.get_params()
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_seeded_build_is_deterministic() -> None:
    for backbone in ("tiny-bert", "tiny-llama"):
        a, b, c = build(backbone, seed=3), build(backbone, seed=3), build(backbone, seed=4)
        pa, pb, pc = a.get_params(), b.get_params(), c.get_params()
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
        fa, fb = frozen_parameters(a), frozen_parameters(b)
        assert all(torch.equal(fa[n], fb[n]) for n in fa)
        # a different seed gives a different initial adapter (lora_A is random)
        assert any(not torch.equal(pa[n], pc[n]) for n in pa if ".lora_A." in n)


# --- classifier head ----------------------------------------------------------------------


def test_classifier_loss_is_cross_entropy_and_ignores_padding() -> None:
    m = build("tiny-bert", head_dropout=0.0, lora={"dropout": 0.0})
    m.set_params(random_params(m, 5))
    m.head.eval()
    features = m.encode(EXAMPLES)
    batch = m.head.collate(features)
    assert batch["attention_mask"].sum(1).unique().numel() > 1  # really padded
    with torch.no_grad():
        logits = m.head._logits(batch)
        loss = m.loss(batch)
        assert torch.allclose(loss, F.cross_entropy(logits, batch["labels"]))
        singles = [m.loss(m.head.collate([f])) for f in features]
    assert torch.allclose(loss, torch.stack(singles).mean(), atol=1e-5)


def test_regression_loss_is_mse() -> None:
    stsb = get_task("STS-B")
    m = build("tiny-bert", task=stsb, head_dropout=0.0)
    assert m.head.classifier.out_features == 1
    m.set_params(random_params(m, 6))
    m.head.eval()
    examples = [Example(e.text_a, e.text_b, s) for e, s in zip(EXAMPLES, (0.5, 4.2, 1.0, 3.3))]
    features = m.encode(examples)
    batch = m.head.collate(features)
    assert batch["labels"].dtype == torch.float32
    with torch.no_grad():
        out = m.head._logits(batch).squeeze(-1)
        labels = torch.tensor([0.5, 4.2, 1.0, 3.3])
        assert torch.allclose(m.loss(batch), ((out - labels) ** 2).mean())
    preds, got_labels, mean_loss = m.predict(features, batch_size=3)
    assert preds.dtype == np.float32 and got_labels.tolist() == pytest.approx([0.5, 4.2, 1.0, 3.3])
    assert mean_loss == pytest.approx(float(((out - labels) ** 2).mean()), rel=1e-4)
    assert np.allclose(preds, out.numpy(), atol=1e-5)


def test_predict_returns_the_original_order() -> None:
    m = build("tiny-bert", head_dropout=0.0)
    m.set_params(random_params(m, 7))
    features = m.encode(EXAMPLES)
    preds, labels, _ = m.predict(features, batch_size=3)
    assert labels.tolist() == [e.label for e in EXAMPLES]
    m.head.eval()
    with torch.no_grad():
        singles = [int(m.head._logits(m.head.collate([f])).argmax(-1)) for f in features]
    assert preds.tolist() == singles


def test_predict_restores_training_mode() -> None:
    m = build("tiny-bert")
    m.head.train()
    m.predict(m.encode(EXAMPLES[:2]), 2)
    assert m.head.training
    m.head.eval()
    m.predict(m.encode(EXAMPLES[:2]), 2)
    assert not m.head.training


# --- verbalizer ---------------------------------------------------------------------------


@pytest.fixture
def verbalizer() -> FedModel:
    m = build("tiny-llama", lora={"dropout": 0.0})
    m.set_params(random_params(m, 11))  # non-zero B: LoRA takes part in the scores
    m.head.eval()
    return m


def test_verbalizer_targets_cover_only_the_answer(verbalizer: FedModel) -> None:
    head = verbalizer.head
    features = verbalizer.encode(EXAMPLES)
    batch = head.collate(features)
    for i, f in enumerate(features):
        prompt = f["prompt_ids"]
        answer = head.options[f["label"]]
        n = len(prompt)
        pad = batch["input_ids"].shape[1] - n - len(answer)  # rows are left-padded
        targets = batch["targets"][i]
        assert (targets[: pad + n] == -100).all()  # padding and prompt
        assert targets[pad + n :].tolist() == answer
        assert answer[-1] == head.tokenizer.eos_token_id
        assert batch["input_ids"][i, pad:].tolist() == prompt + answer
        assert batch["attention_mask"][i, pad:].all() and batch["attention_mask"][i].sum() == n + len(answer)
        assert batch["position_ids"][i, pad:].tolist() == list(range(n + len(answer)))


def test_verbalizer_loss_is_answer_token_cross_entropy(verbalizer: FedModel) -> None:
    head = verbalizer.head
    features = verbalizer.encode(EXAMPLES)
    batch = head.collate(features)
    with torch.no_grad():
        loss = verbalizer.loss(batch)
        logits = head.lm(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    # next-token cross-entropy, averaged over answer tokens only
    manual = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["targets"][:, 1:].reshape(-1),
        ignore_index=-100,
    )
    assert torch.allclose(loss, manual, atol=1e-5)
    # and what the prompt positions would predict does not matter: replacing every
    # prompt target by a real token changes the loss, so -100 is what excludes them
    polluted = dict(batch)
    polluted["targets"] = torch.where(batch["targets"] == -100, 7, batch["targets"])
    with torch.no_grad():
        assert not torch.allclose(verbalizer.loss(polluted), loss)


def test_verbalizer_loss_is_unaffected_by_batch_padding(verbalizer: FedModel) -> None:
    head = verbalizer.head
    features = verbalizer.encode(EXAMPLES)
    with torch.no_grad():
        together = verbalizer.loss(head.collate(features))
        totals, counts = zip(*(head._answer_logprob(head.collate([f])) for f in features))
    expected = -torch.cat(totals).sum() / torch.cat(counts).sum()
    assert torch.allclose(together, expected, atol=1e-5)


def brute_force_scores(m: FedModel, feature: dict) -> list[float]:
    """sum_t log p(answer_k[t] | prompt, answer_k[<t]) for each option k, one unpadded
    sequence at a time, straight from the LM's logits."""
    scores = []
    prompt = feature["prompt_ids"]
    for option in m.head.options:
        ids = torch.tensor([prompt + option])
        with torch.no_grad():
            logp = torch.log_softmax(m.head.lm(input_ids=ids).logits[0].double(), -1)
        scores.append(sum(float(logp[len(prompt) + t - 1, tok]) for t, tok in enumerate(option)))
    return scores


def test_verbalizer_predict_picks_the_most_likely_option(verbalizer: FedModel) -> None:
    features = verbalizer.encode(EXAMPLES)
    preds, labels, mean_loss = verbalizer.predict(features, batch_size=3)
    brute = [brute_force_scores(verbalizer, f) for f in features]
    assert preds.tolist() == [int(np.argmax(s)) for s in brute]
    assert labels.tolist() == [e.label for e in EXAMPLES]
    # per-example loss: the label's answer log-likelihood per answer token
    lengths = [len(o) for o in verbalizer.head.options]
    expected = np.mean([-s[y] / lengths[y] for s, y in zip(brute, labels)])
    assert mean_loss == pytest.approx(expected, rel=1e-4)



def test_verbalizer_predict_with_equal_length_options() -> None:
    """Options of equal length (" no" / " yes" + end-of-text) so that the winner varies
    from example to example even on a random LM; predict must follow the scores."""
    from fedloom.data import custom_task

    task = custom_task("yesno", ["no", "yes"], question="Is it so?")
    m = build("tiny-llama", task=task, lora={"dropout": 0.0})
    m.set_params(random_params(m, 11))
    m.head.eval()
    assert [len(o) for o in m.head.options] == [2, 2]
    words = ["cats", "dogs", "rain", "stocks", "music", "trains", "paint", "snow"]
    examples = [Example(f"sentence number {i} about {w}", None, i % 2) for i, w in enumerate(words)]
    features = m.encode(examples)
    brute = [int(np.argmax(brute_force_scores(m, f))) for f in features]
    assert set(brute) == {0, 1}  # the check below can tell a right answer from a constant
    preds, _, _ = m.predict(features, batch_size=3)
    assert preds.tolist() == brute


# --- precision ----------------------------------------------------------------------------


@pytest.mark.parametrize("backbone", ["tiny-bert", "tiny-llama"])
def test_bf16_precision_runs_forward_in_bf16_and_keeps_the_adapters_float32(backbone: str) -> None:
    fp32, bf16 = build(backbone), build(backbone, precision="bf16")
    params = random_params(fp32, 1)
    fp32.set_params(params)
    bf16.set_params(params)
    features = fp32.encode(EXAMPLES)
    batch = fp32.head.collate(features)
    seen: list[torch.dtype] = []
    hook = bf16.transformer.get_input_embeddings().register_forward_hook(
        lambda _m, _a, out: seen.append(torch.get_autocast_dtype("cpu")
                                        if torch.is_autocast_enabled("cpu") else out.dtype)
    )
    loss = bf16.loss(batch)
    hook.remove()
    assert seen == [torch.bfloat16]
    assert loss.dtype == torch.float32
    loss.backward()
    grads = [p.grad for p in bf16.trainable_parameters().values() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)
    assert all(p.dtype == torch.float32 for p in bf16.get_params().values())
    # the same numbers to bf16's precision (8 bits of mantissa), not bit for bit
    assert loss.item() == pytest.approx(fp32.loss(batch).item(), rel=0.05, abs=0.02)
    _, _, l32 = fp32.predict_each(features, 2)
    _, _, l16 = bf16.predict_each(features, 2)
    assert np.allclose(l16, l32, rtol=0.05, atol=0.02)


def test_a_group_inherits_the_models_precision_unless_it_sets_its_own() -> None:
    cfg = ModelConfig(precision="bf16", groups=[{"clients": [1], "backbone": "tiny-llama"}])
    assert cfg.for_backbone("tiny-llama").precision == "bf16"
    cfg = ModelConfig(groups=[{"clients": [1], "backbone": "tiny-llama", "precision": "bf16"}])
    assert cfg.for_backbone("tiny-llama").precision == "bf16"
    assert cfg.for_backbone("minilm").precision == "auto"  # the default


@pytest.mark.parametrize(("avx512_bf16", "amx", "expected"), [
    (True, False, "bf16"), (False, True, "bf16"), (False, False, "fp32")])
def test_auto_precision_is_bf16_only_on_a_cpu_with_native_bf16(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, expected: str
) -> None:
    from fedloom.device import resolve_precision

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_precision("auto") == expected
    assert build("tiny-bert", precision="auto").precision == expected
    assert resolve_precision("fp32") == "fp32" and resolve_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="model.precision: 'fp16' .* needs a CUDA device"):
        resolve_precision("fp16")
    with pytest.raises(ValueError, match="model.precision: 'fp8' is not"):
        resolve_precision("fp8")

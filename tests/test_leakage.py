"""The leakage attacks against their definitions on a tiny BERT: the label counts of an SGD
step read exactly from the bias update, the span check recovering exactly the tokens of a
batch whose inputs the LoRA A factors of block 0 can hold, and DLG matching a gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import needs_glue, tiny_config

from fedloom.data.examples import Example
from fedloom.experiment import Experiment
from fedloom.privacy import leakage


def _model(*overrides: str):
    exp = Experiment.build(tiny_config("model.lora.r=2", "model.lora.dropout=0.0", *overrides))
    model = exp.model
    g = torch.Generator().manual_seed(0)
    params = model.get_params()  # LoRA's B starts at zero: give it values, as training does
    model.set_params({n: (0.3 * torch.randn(t.shape, generator=g) if "lora_B" in n else t)
                      for n, t in params.items()})
    model.transformer.eval()  # no dropout: the exact case
    model.head.eval()
    return exp, model


def _step(model, features, lr: float) -> dict[str, torch.Tensor]:
    trainable = model.trainable_parameters()
    for p in trainable.values():
        p.grad = None
    model.loss(model.head.collate(features)).backward()
    return {n: -lr * p.grad.detach().clone() for n, p in trainable.items()}


@needs_glue
def test_an_sgd_steps_bias_update_gives_the_batchs_label_counts() -> None:
    exp, model = _model()
    batch = exp.clients[0].train[:8]
    with torch.no_grad():
        probs = torch.softmax(model.head._logits(model.head.collate(batch)), -1).mean(0)
    delta = _step(model, batch, lr=0.05)
    counts = leakage.label_counts(delta["classifier.bias"], 0.05, 1, 8, probs)
    true = np.bincount([f["label"] for f in batch], minlength=2)
    assert counts.tolist() == true.tolist()
    assert leakage.labels_recovered(true, counts) == 1.0
    assert leakage.labels_recovered([3, 5], [5, 3]) == pytest.approx(6 / 8)


@needs_glue
def test_the_span_check_recovers_the_tokens_of_a_short_batch_exactly() -> None:
    _, model = _model()
    (feature,) = model.encode([Example("good movie", None, 1)])
    delta = _step(model, [feature], lr=0.1)
    basis = leakage.row_space(leakage.embedding_readers(delta))
    assert basis.shape[1] == len(feature["input_ids"])  # one direction per token input
    embeddings = next(m for n, m in model.transformer.named_modules() if n.endswith("embeddings"))
    inputs = leakage.FirstLayerInputs.of(embeddings)
    scores = leakage.token_scores(basis, inputs.at, range(16))
    true = set(feature["input_ids"])
    assert all(scores[t] > 0.9999 for t in true)
    top = set(torch.topk(scores, len(true)).indices.tolist())
    assert top == true
    recovered = set(torch.nonzero(scores >= 0.9999).flatten().tolist())
    assert leakage.precision_recall(recovered, true) == (1.0, 1.0)
    # a different sentence is not in the span
    (other,) = model.encode([Example("terrible plot", None, 0)])
    assert not set(other["input_ids"]) - {101, 102} <= recovered


def test_dlg_matches_the_gradient_of_a_linear_model() -> None:
    # the reference attack on the smallest model: a linear classifier's gradient on one
    # example determines the example (Zhu et al. 2019); L-BFGS finds it
    g = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(6, 3)
    x, y = torch.randn(1, 1, 6, generator=g), torch.tensor([2])

    def gradient_of(inputs: torch.Tensor, label_logits: torch.Tensor) -> list[torch.Tensor]:
        logits = layer(inputs[:, 0])
        target = torch.softmax(label_logits, -1)
        loss = -(target * torch.log_softmax(logits, -1)).sum(-1).mean()
        return list(torch.autograd.grad(loss, list(layer.parameters()), create_graph=True))

    observed = [t.detach() for t in gradient_of(x, torch.nn.functional.one_hot(y, 3) * 50.0)]
    dummy, labels = leakage.dlg(gradient_of, observed, (1, 1, 6), 3, iterations=200)
    assert int(labels.argmax()) == 2
    assert torch.allclose(dummy, x, atol=1e-2)

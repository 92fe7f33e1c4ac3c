"""Temperature scaling (fedloom.models.calibration): the fit recovers the temperature of
logits made over-confident by a known factor, leaves predictions alone, and reads the
model's log-probabilities in the features' own label order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import needs_glue, tiny_config

from fedloom.evaluation.score import evaluate
from fedloom.experiment import Experiment
from fedloom.models.calibration import T_MAX, T_MIN, fit_temperature, held_out_log_probs


def calibrated_logits(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-class logits (0, m), m ~ N(0, 2²), and labels drawn from softmax of them: a
    calibrated model (T = 1)."""
    gen = torch.Generator().manual_seed(seed)
    margin = 2 * torch.randn(n, generator=gen, dtype=torch.float64)
    labels = (torch.rand(n, generator=gen, dtype=torch.float64) < torch.sigmoid(margin)).long()
    return torch.stack([torch.zeros(n, dtype=torch.float64), margin], 1), labels


@pytest.mark.parametrize("factor", [0.5, 1.0, 3.0])
def test_the_fit_undoes_a_known_overconfidence(factor: float) -> None:
    """Logits of a calibrated model times ``factor`` need T = factor. The MLE of β = 1/T
    over 20,000 examples has a standard error of about 1 % here: 5 % is several of them."""
    logits, labels = calibrated_logits(20_000, seed=7)
    found = fit_temperature(logits * factor, labels)
    assert found == pytest.approx(factor, rel=0.05)


def test_the_fit_minimizes_the_nll_and_stays_in_bounds() -> None:
    logits, labels = calibrated_logits(2_000, seed=1)
    found = fit_temperature(3 * logits, labels)

    def nll(t: float) -> float:
        return float(torch.nn.functional.cross_entropy(3 * logits / t, labels))

    assert nll(found) <= min(nll(found * 0.9), nll(found * 1.1))
    # labels a model always gets wrong want T → ∞, always right T → 0: the bounds
    assert fit_temperature(3 * logits, 1 - (logits[:, 1] > 0).long()) == pytest.approx(
        T_MAX, rel=1e-3)
    assert fit_temperature(3 * logits, (logits[:, 1] > 0).long()) == pytest.approx(
        T_MIN, rel=1e-3)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="fit_temperature"):
        fit_temperature(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="fit_temperature"):
        fit_temperature(torch.zeros(0, 2), torch.zeros(0))


@needs_glue
def test_log_probs_are_the_models_in_the_features_label_order(tmp_path) -> None:
    exp = Experiment.build(tiny_config(output_dir=tmp_path))
    features = exp.clients[0].test
    log_probs, labels = held_out_log_probs(exp.model, features, 8)
    assert log_probs.shape == (len(features), 2)
    mean_loss = -log_probs[torch.arange(len(labels)), labels].mean().item()
    assert mean_loss == pytest.approx(evaluate(exp.model, exp.model.get_params(), features, 8)["loss"],
                                      rel=1e-5)
    assert sorted(labels.tolist()) == sorted(int(f["label"]) for f in features)
    assert np.allclose(log_probs.exp().sum(1).numpy(), 1.0, atol=1e-5)

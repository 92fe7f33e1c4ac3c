"""Heterogeneity diagnostics: drift, gradient dissimilarity on a real model and its
minibatch-noise correction (statistically, on linear clients with noisy examples), the
embedding probes (feature shift, label consistency), FedModel.embed and the advice rules."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch

from fedloom import algorithms
from fedloom.config import LoraConfig, ModelConfig
from fedloom.data import Example, get_task
from fedloom.diagnostics import (
    Measures,
    advise,
    client_drift,
    client_gradient,
    client_gradient_estimate,
    drift_summary,
    feature_shift,
    gradient_dissimilarity,
    iid_feature_shift,
    label_consistency,
)
from fedloom.diagnostics import advice as rules
from fedloom.models.fedmodel import FedModel

MRPC = get_task("MRPC")
EXAMPLES = [
    Example("The cat sat on the mat.", "A cat was sitting on a mat.", 1),
    Example("Stocks fell sharply on Monday after the report.", "Markets rose.", 0),
    Example("He said no.", "He refused the offer made by the committee last week.", 0),
    Example(
        "Rain is expected tomorrow in the north.", "It will probably rain up north tomorrow.", 1
    ),
    Example("A short one.", "Short.", 1),
    Example("Prices climbed for a third straight day.", "Prices went up again.", 1),
]


def build(backbone: str) -> FedModel:
    cfg = ModelConfig(precision="fp32", backbone=backbone, lora=LoraConfig(dropout=0.1))
    return FedModel.build(cfg, MRPC, max_length=64, seed=0)


def random_params(model: FedModel, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in model.get_params().items()}


@pytest.fixture(scope="module", params=["tiny-bert", "tiny-llama"])
def model(request: pytest.FixtureRequest) -> FedModel:
    return build(request.param)


# --- drift -----------------------------------------------------------------------------------


def test_client_drift_by_hand() -> None:
    start = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([[1.0]]), "c": torch.zeros(3)}
    end = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([[-1.0]]), "personal": torch.ones(2)}
    # default: the tensors both hold (a, b): sqrt(9 + 16 + 4)
    assert client_drift(start, end) == pytest.approx(29**0.5)
    assert client_drift(start, end, ["a"]) == pytest.approx(5.0)
    assert client_drift(start, start) == 0.0
    with pytest.raises(ValueError, match="no tensor in common"):
        client_drift({"x": torch.zeros(1)}, {"y": torch.zeros(1)})


def test_drift_summary() -> None:
    summary = drift_summary({3: 1.0, 5: 4.0, 7: 1.0})
    assert summary == {"mean": 2.0, "max": 4.0, "per_client": {3: 1.0, 5: 4.0, 7: 1.0}}
    with pytest.raises(ValueError):
        drift_summary({})


# --- gradient dissimilarity --------------------------------------------------------------------


def test_gradient_dissimilarity_checks_its_inputs_and_zero_gradients() -> None:
    g = {0: torch.tensor([1.0, 0.0]), 1: torch.zeros(2)}
    with pytest.raises(ValueError, match="different clients"):
        gradient_dissimilarity(g, {0: 1.0})
    with pytest.raises(ValueError, match="non-negative"):
        gradient_dissimilarity(g, {0: 1.0, 1: -1.0})
    dis = gradient_dissimilarity(g, {0: 1.0, 1: 3.0})
    assert np.allclose(dis.cosine, [[1.0, 0.0], [0.0, 0.0]])  # a zero gradient: cosine 0
    # ∇F = (0.25, 0), G² = 0.25 * 0.75² + 0.75 * 0.25² = 0.1875, B² = 0.25 / 0.0625
    assert dis.g2 == pytest.approx(0.1875) and dis.b2 == pytest.approx(4.0)


def test_gradient_dissimilarity_removes_the_given_noise_by_hand() -> None:
    g = {0: torch.tensor([1.0, 0.0]), 1: torch.zeros(2)}
    w = {0: 1.0, 1: 3.0}  # p = (0.25, 0.75); raw G² 0.1875, ‖∇F‖² 0.0625
    assert gradient_dissimilarity(g, w).g2_debiased is None  # no noise given
    dis = gradient_dissimilarity(g, w, {0: 0.04, 1: 0.02})
    bias = 0.25 * 0.75 * 0.04 + 0.75 * 0.25 * 0.02  # Σ p_k (1 − p_k) v_k = 0.01125
    mean_sq = 0.0625 - (0.25**2 * 0.04 + 0.75**2 * 0.02)  # ‖ĝ‖² − Σ p_k² v_k = 0.04875
    assert dis.g2 == pytest.approx(0.1875) and dis.b2 == pytest.approx(4.0)  # raw unchanged
    assert dis.g2_debiased == pytest.approx(0.1875 - bias)
    assert dis.b2_debiased == pytest.approx((mean_sq + 0.1875 - bias) / mean_sq)
    assert dis.noise_share == pytest.approx(bias / 0.1875)
    # noise beyond the measured spread: both clipped at 0, B² undefined, share > 1
    loud = gradient_dissimilarity(g, w, {0: 10.0, 1: 10.0})
    assert loud.g2_debiased == 0.0 and loud.b2_debiased == math.inf and loud.noise_share > 1
    # one client's noise unknown (a single batch of a subsample): no debiased values
    unknown = gradient_dissimilarity(g, w, {0: 0.04, 1: math.nan})
    assert unknown.g2_debiased is unknown.b2_debiased is unknown.noise_share is None
    assert unknown.g2 == dis.g2
    with pytest.raises(ValueError, match="noise name different clients"):
        gradient_dissimilarity(g, w, {0: 0.1})
    with pytest.raises(ValueError, match="non-negative"):
        gradient_dissimilarity(g, w, {0: 0.1, 1: -0.1})


def test_client_gradient_on_a_real_model_is_the_mean_example_gradient() -> None:
    """tiny-bert's loss is the example mean, so one batch of everything and one batch per
    example give the same gradient; dropout is off and nothing is left on .grad."""
    m = build("tiny-bert")
    params = random_params(m, 1)
    features = m.encode(EXAMPLES)
    m.head.train()
    whole = client_gradient(m, params, features, batches=1, batch_size=len(features), seed=0)
    singles = client_gradient(m, params, features, batches=len(features), batch_size=1, seed=3)
    uneven = client_gradient(m, params, features, batches=2, batch_size=4, seed=5)  # 4 + 2
    assert whole.dtype == torch.float64 and whole.device.type == "cpu"
    assert whole.numel() == sum(p.numel() for p in params.values())
    assert torch.allclose(whole, singles, atol=1e-6) and torch.allclose(whole, uneven, atol=1e-6)
    assert whole.abs().sum() > 0
    assert m.head.training
    assert all(p.grad is None for p in m.trainable_parameters().values())
    # deterministic: same seed, same sample (a subsample here)
    a = client_gradient(m, params, features, batches=1, batch_size=3, seed=7)
    assert torch.equal(a, client_gradient(m, params, features, batches=1, batch_size=3, seed=7))
    # in param_names order
    m.set_params(params)
    m.head.eval()
    loss = m.loss(m.head.collate(features))
    grads = torch.autograd.grad(loss, list(m.trainable_parameters().values()))
    m.head.train()
    manual = torch.cat([g.reshape(-1).double() for g in grads])
    assert torch.allclose(whole, manual, atol=1e-6)
    assert list(m.trainable_parameters()) == m.param_names


def test_client_gradient_estimate_noise_on_a_real_model_by_hand() -> None:
    """Two batches of 2 out of 6 examples: v̂ = (1 − 4/6) · ½ · Σ_j ‖h_j − h̄‖²
    = ‖h_1 − h_2‖² / 12; the whole client: v̂ = 0; one batch of a subsample: nan."""
    m = build("tiny-bert")
    params = random_params(m, 1)
    features = m.encode(EXAMPLES)
    est = client_gradient_estimate(m, params, features, batches=2, batch_size=2, seed=1)
    assert (est.batches, est.examples) == (2, 4)
    sample = np.random.default_rng(1).permutation(len(features))[:4]
    h1, h2 = (
        client_gradient(m, params, [features[i] for i in part], 1, 2, seed=0)
        for part in (sample[:2], sample[2:])
    )
    assert torch.allclose(est.mean, (h1 + h2) / 2, atol=1e-6)
    assert est.noise == pytest.approx(float((h1 - h2) @ (h1 - h2)) / 12, rel=1e-4)
    assert est.noise > 0
    assert torch.equal(est.mean, client_gradient(m, params, features, 2, 2, seed=1))
    whole = client_gradient_estimate(m, params, features, batches=2, batch_size=4, seed=0)
    assert (whole.batches, whole.examples, whole.noise) == (2, 6, 0.0)  # 4 + 2, everything
    single = client_gradient_estimate(m, params, features, batches=1, batch_size=3, seed=0)
    assert single.batches == 1 and math.isnan(single.noise)


# --- the noise correction, statistically ----------------------------------------------------


class _Head:
    training = True

    def train(self, mode: bool = True) -> _Head:
        self.training = mode
        return self


class NoisyLinear:
    """A client whose examples are vectors x_i and whose loss on a batch is w · (mean of
    its x_i): a batch's gradient is the mean of its examples' vectors, F_k's gradient the
    mean over all of them. Features are example indices."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = torch.tensor(x, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.zeros(x.shape[1], dtype=torch.float64))
        self.head = _Head()

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {"w": self.w}

    def set_params(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.w.copy_(params["w"])

    def batches(
        self, features: Sequence[int], batch_size: int, order: np.ndarray | None = None
    ) -> Iterator[list[int]]:
        order = np.arange(len(features)) if order is None else order
        for start in range(0, len(order), batch_size):
            yield [features[i] for i in order[start : start + batch_size]]

    def loss(self, batch: list[int]) -> torch.Tensor:
        return self.w @ self.x[batch].mean(0)


DIM, SIGMA, BATCHES, BATCH_SIZE = 10, 1.0, 2, 8  # m = 16 examples per client
NOISY_SIZES = (40, 60, 80, 100)  # p = (0.14, 0.21, 0.29, 0.36)
SEEDS = 400


def noisy_client(rng: np.random.Generator, mean: np.ndarray, n: int) -> np.ndarray:
    """n examples x_i = mean + σ (z_i − z̄), z_i ~ N(0, I): per-example noise of trace
    E S² = d σ² around a client gradient of exactly ``mean``."""
    z = rng.normal(size=(n, len(mean)))
    return mean + SIGMA * (z - z.mean(0))


def expected_noise(n: int) -> float:
    """v_k = E ‖ĝ_k − ∇F_k‖² = (d σ² / m)(1 − m/n), m = BATCHES · BATCH_SIZE."""
    m = BATCHES * BATCH_SIZE
    return DIM * SIGMA**2 / m * (1 - m / n)


def noisy_federation(means: np.ndarray, seed: int) -> tuple[np.ndarray, ...]:
    """Over SEEDS fresh federations: raw G², the unclipped debiased G²
    (G²_raw − Σ p_k (1 − p_k) v̂_k = G²_raw (1 − noise share)) and the reported one."""
    rng = np.random.default_rng(seed)
    zero = {"w": torch.zeros(DIM, dtype=torch.float64)}
    raw, unclipped, reported = [], [], []
    for s in range(SEEDS):
        estimates = {
            k: client_gradient_estimate(
                NoisyLinear(noisy_client(rng, means[k], n)),
                zero,
                list(range(n)),
                BATCHES,
                BATCH_SIZE,
                seed=s * 10 + k,
            )
            for k, n in enumerate(NOISY_SIZES)
        }
        dis = gradient_dissimilarity(
            {k: e.mean for k, e in estimates.items()},
            {k: float(n) for k, n in enumerate(NOISY_SIZES)},
            {k: e.noise for k, e in estimates.items()},
        )
        assert dis.g2_debiased == pytest.approx(max(dis.g2 * (1 - dis.noise_share), 0.0))
        raw.append(dis.g2)
        unclipped.append(dis.g2 * (1 - dis.noise_share))
        reported.append(dis.g2_debiased)
    return np.array(raw), np.array(unclipped), np.array(reported)


def within(samples: np.ndarray, target: float, ses: float = 3.0) -> bool:
    """The sample mean is within ``ses`` standard errors of ``target``."""
    se = samples.std(ddof=1) / len(samples) ** 0.5
    return abs(samples.mean() - target) < ses * se


def noise_bias() -> float:
    """Σ_k p_k (1 − p_k) v_k: how far the raw G² is biased upwards."""
    p = np.asarray(NOISY_SIZES, dtype=np.float64) / sum(NOISY_SIZES)
    return float(sum(pk * (1 - pk) * expected_noise(n) for pk, n in zip(p, NOISY_SIZES)))


def test_noise_estimate_is_unbiased_for_the_error_of_the_mean() -> None:
    """E v̂_k = E ‖ĝ_k − ∇F_k‖² = (d σ² / m)(1 − m/n), matched seed by seed."""
    rng = np.random.default_rng(0)
    mean = np.arange(DIM, dtype=np.float64) / DIM
    zero = {"w": torch.zeros(DIM, dtype=torch.float64)}
    noise, error = [], []
    for s in range(SEEDS):
        x = noisy_client(rng, mean, 50)
        est = client_gradient_estimate(NoisyLinear(x), zero, list(range(50)), 4, 5, seed=s)
        assert (est.batches, est.examples) == (4, 20)
        noise.append(est.noise)
        error.append(float(((est.mean.numpy() - mean) ** 2).sum()))
    noise_, error_ = np.array(noise), np.array(error)
    v = DIM * SIGMA**2 / 20 * (1 - 20 / 50)
    assert within(noise_, v) and within(error_, v)
    assert within(noise_ - error_, 0.0)
    assert (noise_ > 0).all()


def test_iid_clients_raw_g2_is_noise_and_the_debiased_g2_averages_to_zero() -> None:
    means = np.tile(np.eye(DIM)[0], (len(NOISY_SIZES), 1))  # every ∇F_k the same: G² = 0
    raw, unclipped, reported = noisy_federation(means, seed=1)
    bias = noise_bias()  # ≈ 0.35 here
    assert raw.mean() > 20 * raw.std(ddof=1) / SEEDS**0.5  # clearly positive
    assert within(raw, bias)  # raw G² = noise alone
    assert within(unclipped, 0.0)  # the correction removes it
    # the reported (clipped at 0) values are small next to the raw ones
    assert reported.mean() < 0.25 * raw.mean() and (reported >= 0).all()


def test_heterogeneous_clients_debiased_g2_averages_to_the_true_g2() -> None:
    rng = np.random.default_rng(2)
    means = rng.normal(size=(len(NOISY_SIZES), DIM)) * 0.4
    p = np.asarray(NOISY_SIZES, dtype=np.float64) / sum(NOISY_SIZES)
    true_g2 = float(p @ ((means - p @ means) ** 2).sum(1))  # ≈ 0.90
    raw, unclipped, reported = noisy_federation(means, seed=3)
    assert (unclipped > 0).all()  # no clipping: the reported value is the unbiased one
    assert np.allclose(unclipped, reported, rtol=1e-12, atol=0)
    assert within(reported, true_g2)
    assert within(raw - true_g2, noise_bias())  # raw is biased upwards by Σ p(1 − p) v
    assert raw.mean() - true_g2 > 0.1


# --- FedModel.embed ------------------------------------------------------------------------------


def hidden_size(m: FedModel) -> int:
    inner = m.head.encoder if m.spec.kind == "encoder" else m.head.lm
    return inner.config.hidden_size


def test_embed_shape_order_and_determinism(model: FedModel) -> None:
    features = model.encode(EXAMPLES)
    model.head.train()
    emb = model.embed(features, batch_size=4)
    assert emb.shape == (len(EXAMPLES), hidden_size(model)) and emb.dtype == np.float32
    assert np.isfinite(emb).all()
    assert model.head.training  # mode restored
    assert np.array_equal(emb, model.embed(features, batch_size=4))  # no dropout
    perm = [4, 2, 0, 5, 1, 3]
    permuted = model.embed([features[i] for i in perm], batch_size=4)
    assert np.allclose(permuted, emb[perm], atol=1e-5)
    # batching and padding do not matter: one example at a time gives the same vectors
    singles = np.concatenate([model.embed([f], batch_size=1) for f in features])
    assert np.allclose(singles, emb, atol=1e-5)


def test_classifier_embed_is_what_the_classifier_reads() -> None:
    m = build("tiny-bert")
    m.set_params(random_params(m, 2))
    features = m.encode(EXAMPLES)
    emb = torch.from_numpy(m.embed(features, batch_size=8))
    m.head.eval()
    with torch.no_grad():
        logits = m.head._logits(m.head.collate(features))
        assert torch.allclose(m.head.classifier(emb), logits, atol=1e-5)


def test_verbalizer_embed_is_the_mean_last_hidden_state_over_the_prompt() -> None:
    m = build("tiny-llama")
    features = m.encode(EXAMPLES[:3])
    emb = m.embed(features, batch_size=3)
    m.head.eval()
    with torch.no_grad():
        for i, f in enumerate(features):
            out = m.head.lm(input_ids=torch.tensor([f["prompt_ids"]]), output_hidden_states=True)
            assert np.allclose(emb[i], out.hidden_states[-1][0].mean(0).numpy(), atol=1e-5)


# --- feature shift ------------------------------------------------------------------------------


def test_feature_shift_by_hand() -> None:
    x = {0: np.array([[0.0, 0.0], [2.0, 0.0]]), 1: np.array([[4.0, 0.0], [6.0, 0.0]])}
    # pooled mean (3, 0); variance (9 + 1 + 1 + 9) / 4 = 5; client means (1, 0), (5, 0)
    out = feature_shift(x)
    assert out["per_client"] == {0: pytest.approx(0.8), 1: pytest.approx(0.8)}
    assert out["mean"] == pytest.approx(0.8) and out["max"] == pytest.approx(0.8)
    assert out["iid_mean"] == pytest.approx(2 / (2 * 3))  # (N − n) / (n (N − 1))
    assert np.allclose(iid_feature_shift([2, 2]), [1 / 3, 1 / 3])


def test_feature_shift_is_near_zero_for_identical_distributions_and_large_for_shifted() -> None:
    rng = np.random.default_rng(0)
    sizes = (200, 300, 400, 500)
    same = {k: rng.normal(size=(n, 16)) for k, n in enumerate(sizes)}
    iid = feature_shift(same)
    assert iid["mean"] < 0.01
    assert iid["mean"] == pytest.approx(iid["iid_mean"], rel=0.6)  # ≈ 1/n_k: sampling noise
    shifted = {k: x + 3.0 * np.eye(16)[k] for k, x in same.items()}
    out = feature_shift(shifted)
    assert out["mean"] > 0.3 and min(out["per_client"].values()) > 0.2


# --- label consistency ---------------------------------------------------------------------------


def blobs(rng: np.random.Generator, n: int, flip: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Two Gaussian blobs in 16-D, one per label; ``flip`` swaps the labels."""
    labels = rng.integers(0, 2, n)
    centers = np.stack([np.eye(16)[0] * 4, np.eye(16)[1] * 4])
    x = centers[labels] + rng.normal(size=(n, 16))
    return x, (1 - labels) if flip else labels


def test_label_consistency_flags_the_client_with_permuted_labels() -> None:
    rng = np.random.default_rng(1)
    data = {k: blobs(rng, 60, flip=(k == 2)) for k in range(6)}
    out = label_consistency(
        {k: x for k, (x, _) in data.items()}, {k: y for k, (_, y) in data.items()}, k=5
    )
    flipped = out["per_client"][2]
    assert flipped["within"] > 0.95 and flipped["cross"] < 0.3 and flipped["gap"] > 0.7
    for k in (0, 1, 3, 4, 5):  # one sixth of their foreign neighbours are the flipped client's
        assert out["per_client"][k]["gap"] < 0.3
    assert out["max_gap"] == flipped["gap"]
    assert out["mean_gap"] == pytest.approx(np.mean([v["gap"] for v in out["per_client"].values()]))


def test_label_consistency_is_flat_without_concept_shift() -> None:
    rng = np.random.default_rng(2)
    data = {k: blobs(rng, 40) for k in range(3)}
    out = label_consistency(
        {k: x for k, (x, _) in data.items()}, {k: y for k, (_, y) in data.items()}, k=5
    )
    assert out["max_gap"] < 0.1
    assert all(v["cross"] > 0.9 for v in out["per_client"].values())
    with pytest.raises(ValueError, match="client 0"):
        label_consistency({0: np.zeros((1, 2)), 1: np.zeros((3, 2))}, {0: [0], 1: [0, 1, 0]})


def test_label_skew_alone_opens_no_gap_on_uninformative_embeddings() -> None:
    """One-label clients agree with themselves trivially (within = 1); measured against
    chance that is no evidence of concept shift."""
    rng = np.random.default_rng(3)
    x = {k: rng.normal(size=(50, 8)) for k in range(4)}  # embeddings carry no label signal
    y = {k: np.full(50, k % 2) for k in range(4)}
    out = label_consistency(x, y, k=5)
    for v in out["per_client"].values():
        assert v["within"] == 1.0 and v["within_chance"] == 1.0
        assert v["cross_chance"] == pytest.approx(50 / 150)  # one of the three others agrees
        assert v["within"] - v["cross"] > 0.5  # the raw gap would call this concept shift
    assert abs(out["mean_gap"]) < 0.1 and out["max_gap"] < 0.2


def test_label_consistency_chance_levels_by_hand() -> None:
    x = {0: np.eye(4)[[0, 0, 1]], 1: np.eye(4)[[2, 3, 3, 3]]}
    y = {0: [0, 0, 1], 1: [1, 1, 1, 0]}
    v = label_consistency(x, y, k=2)["per_client"]
    # client 0: own pairs (0,0) agree, so within chance 2 / 6; cross: 2/3·1/4 + 1/3·3/4
    assert v[0]["within_chance"] == pytest.approx(2 / 6)
    assert v[0]["cross_chance"] == pytest.approx(2 / 3 * 1 / 4 + 1 / 3 * 3 / 4)
    assert v[1]["within_chance"] == pytest.approx(6 / 12)
    expected = (v[0]["within"] - 2 / 6) - (v[0]["cross"] - 5 / 12)
    assert v[0]["gap"] == pytest.approx(expected)


# --- advice ------------------------------------------------------------------------------------

IID: dict[str, object] = {
    "num_clients": 4,
    "sizes": {0: 100, 1: 110, 2: 95, 3: 105},
    "label_js_mean": 0.01,
    "label_js_max": 0.02,
    "feature_shift": 0.012,
    "consistency_gap_max": 0.05,
    "consistency_gap_mean": 0.02,
    "g2": 0.003,
    "b2": 1.08,
    "gradient_cosine": np.full((4, 4), 0.97) + 0.03 * np.eye(4),
}


def kinds(measures: Measures) -> list[str]:
    return [f.kind for f in advise(measures).findings]


def measures(**changes: object) -> Measures:
    return Measures(**{**IID, **changes})


def test_iid_measures_recommend_fedavg_only() -> None:
    advice = advise(measures())
    assert kinds(measures()) == ["iid"]
    assert advice.recommendations == ["FedAvg (available: algorithm.name = 'fedavg')"]
    message = advice.findings[0].message
    assert "looks IID" in message and "0.01" in message and "1.08" in message
    text = advice.render()
    assert "looks IID" in text and "FedAvg" in text
    json.dumps(advice.to_dict())


@pytest.mark.parametrize(
    ("js", "expected", "quoted", "methods"),
    [
        (
            0.1,
            ["label_skew"],
            "0.1 (moderate 0.05-0.2",
            ["FedProx (available", "SCAFFOLD (available"],
        ),
        (
            0.31,
            ["label_skew"],
            "0.31 (severe > 0.2",
            ["local training (an adapter of its own, never shared) (available", "Ditto (available"],
        ),
        (0.049, ["iid"], "0.049", ["FedAvg (available"]),
    ],
)
def test_label_skew(js: float, expected: list[str], quoted: str, methods: list[str]) -> None:
    advice = advise(measures(label_js_mean=js))
    assert kinds(measures(label_js_mean=js)) == expected
    assert quoted in advice.findings[0].message
    for m in methods:
        assert any(r.startswith(m) for r in advice.recommendations), advice.recommendations


def test_quantity_skew() -> None:
    sizes = {0: 10, 1: 20, 2: 40, 3: 400}
    advice = advise(measures(sizes=sizes))
    assert kinds(measures(sizes=sizes)) == ["quantity_skew"]
    cv = np.std(list(sizes.values())) / np.mean(list(sizes.values()))
    assert f"{cv:.3g} (> 0.5)" in advice.findings[0].message
    assert any(
        "FedNova (available: algorithm.name = 'fednova')" in r for r in advice.recommendations
    )
    assert kinds(measures(sizes={0: 80, 1: 100, 2: 120, 3: 100})) == ["iid"]


def test_feature_skew_is_measured_against_sampling_noise() -> None:
    expected = float(iid_feature_shift(list(IID["sizes"].values())).mean())
    advice = advise(measures(feature_shift=0.35))
    assert kinds(measures(feature_shift=0.35)) == ["feature_skew"]
    assert "0.35" in advice.findings[0].message and "> 0.1" in advice.findings[0].message
    assert "FedPer (shared body, personal head) (available: algorithm.name = 'fedper')" in advice.recommendations
    assert kinds(measures(feature_shift=expected + 0.09)) == ["iid"]
    # tiny clients: 0.2 is what random clients of 5 examples show anyway
    tiny = {k: 5 for k in range(4)}
    assert kinds(measures(sizes=tiny, feature_shift=0.2)) == ["iid"]
    assert kinds(measures(feature_shift=0.2, feature_shift_iid=0.15)) == ["iid"]


def test_concept_shift() -> None:
    advice = advise(measures(consistency_gap_max=0.85, consistency_gap_mean=0.3))
    assert [f.kind for f in advice.findings] == ["concept_shift"]
    assert "0.85 (> 0.4; mean 0.3)" in advice.findings[0].message
    assert {"IFCA (available: algorithm.name = 'ifca')", "CFL (available: algorithm.name = 'cfl')",
            "Ditto (available: algorithm.name = 'ditto')"} <= set(advice.recommendations)
    assert kinds(measures(consistency_gap_max=0.35)) == ["iid"]


def two_groups(within: float, between: float) -> np.ndarray:
    groups = np.array([0, 0, 0, 1, 1, 1])
    cos = np.where(groups[:, None] == groups[None, :], within, between)
    np.fill_diagonal(cos, 1.0)
    return cos


def test_client_groups_from_gradient_cosines() -> None:
    sizes = {k: 50 for k in range(6)}
    found = measures(num_clients=6, sizes=sizes, gradient_cosine=two_groups(0.9, -0.4))
    advice = advise(found)
    assert [f.kind for f in advice.findings] == ["client_groups"]
    assert "2 groups [[0, 1, 2], [3, 4, 5]]" in advice.findings[0].message
    assert "IFCA (available: algorithm.name = 'ifca')" in advice.recommendations
    # near-identical gradients: a clean split but no real difference in direction
    assert kinds(measures(num_clients=6, sizes=sizes, gradient_cosine=two_groups(0.99, 0.95))) == [
        "iid"
    ]
    # noise around one direction
    rng = np.random.default_rng(0)
    g = np.ones((6, 20)) + 0.2 * rng.normal(size=(6, 20))
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    assert kinds(measures(num_clients=6, sizes=sizes, gradient_cosine=g @ g.T)) == ["iid"]


def test_task_heterogeneity() -> None:
    shares = {0: {"MRPC": 1.0}, 1: {"MRPC": 0.8, "RTE": 0.2}, 2: {"RTE": 1.0}, 3: {"RTE": 1.0}}
    advice = advise(measures(num_tasks=2, task_shares=shares))
    assert [f.kind for f in advice.findings] == ["task_heterogeneity"]
    assert (
        "2 tasks over 4 clients" in advice.findings[0].message
        and "0.95" in advice.findings[0].message
    )
    assert {"MOCHA (available: algorithm.name = 'mocha')",
            "FedEM (available: algorithm.name = 'fedem')",
            "FedMosaic (available: algorithm.name = 'fedmosaic')"} <= set(advice.recommendations)


def test_gradient_disagreement() -> None:
    advice = advise(measures(b2=3.5, g2=0.4))
    assert [f.kind for f in advice.findings] == ["gradient_disagreement"]
    assert "B² 3.5 (> 2.0" in advice.findings[0].message and "G² 0.4" in advice.findings[0].message
    infinite = advise(measures(b2=float("inf")))
    assert json.loads(json.dumps(infinite.to_dict()))["findings"][0]["evidence"]["b2"] is None


def test_gradient_rules_judge_the_debiased_b2() -> None:
    """IID clients measured on a few small batches: raw B² 10 is minibatch noise."""
    noisy = measures(b2=10.0, g2=0.9, b2_debiased=1.05, g2_debiased=0.005, noise_share=0.99)
    advice = advise(noisy)
    assert kinds(noisy) == ["iid"]
    assert advice.recommendations == ["FedAvg (available: algorithm.name = 'fedavg')"]
    message = advice.findings[0].message
    assert "B² 1.05 without minibatch noise (near 1, <= 2.0; raw B² 10)" in message
    assert "G² 0.005 without minibatch noise (raw 0.9)" in message
    assert "noise share of G² 0.99" in message
    assert advice.findings[0].evidence == {
        "label_js_mean": 0.01,
        "b2": 10.0,
        "b2_debiased": 1.05,
        "g2": 0.9,
        "g2_debiased": 0.005,
        "noise_share": 0.99,
    }
    # without the correction the raw B² alone would call for SCAFFOLD
    assert kinds(measures(b2=10.0, g2=0.9)) == ["gradient_disagreement"]
    # a real disagreement survives the correction and quotes both
    real = advise(measures(b2=4.0, g2=0.5, b2_debiased=3.2, g2_debiased=0.4, noise_share=0.2))
    assert [f.kind for f in real.findings] == ["gradient_disagreement"]
    text = real.findings[0].message
    assert "B² 3.2 without minibatch noise (> 2.0: G² exceeds ‖∇F‖²; raw B² 4)" in text
    assert "G² 0.4 without minibatch noise (raw 0.5)" in text and "noise share of G² 0.2" in text
    assert "SCAFFOLD (available: algorithm.name = 'scaffold')" in real.recommendations
    assert json.loads(json.dumps(real.to_dict()))["findings"][0]["evidence"]["b2_debiased"] == 3.2


def test_client_groups_need_gradients_that_are_not_mostly_noise() -> None:
    sizes = {k: 50 for k in range(6)}
    grouped = {"num_clients": 6, "sizes": sizes, "gradient_cosine": two_groups(0.9, -0.4)}
    advice = advise(measures(**grouped, noise_share=0.1))
    assert [f.kind for f in advice.findings] == ["client_groups"]
    assert "noise share of G² 0.1 <= 0.5" in advice.findings[0].message
    assert advice.findings[0].evidence["noise_share"] == 0.1
    assert kinds(measures(**grouped, noise_share=0.9)) == ["iid"]


def test_several_findings_merge_their_recommendations() -> None:
    advice = advise(measures(label_js_mean=0.3, consistency_gap_max=0.9))
    assert [f.kind for f in advice.findings] == ["label_skew", "concept_shift"]
    assert advice.recommendations.count("Ditto (available: algorithm.name = 'ditto')") == 1
    assert not any(r.startswith("FedAvg") for r in advice.recommendations)
    lines = advice.render().splitlines()
    assert lines[0] == "Findings:" and "Recommended:" in lines


def test_availability_follows_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rules.method("SCAFFOLD") == "SCAFFOLD (available: algorithm.name = 'scaffold')"
    fedbn = "FedBN-style local normalization"
    assert rules.method(fedbn) == f"{fedbn} (planned)"
    monkeypatch.setattr(rules.algorithms, "available", lambda: ["fedbn"])
    assert rules.method(fedbn) == f"{fedbn} (available: algorithm.name = 'fedbn')"


def test_every_method_the_advice_names_is_registered_but_fedbn() -> None:
    """Every recommendation goes through rules.METHODS. FedBN-style local normalization is
    the one planned method: a registered one here must be named by its registry name."""
    planned = {name for name, key in rules.METHODS.items() if key not in algorithms.available()}
    assert planned == {"FedBN-style local normalization"}


def test_measures_from_partition_stats() -> None:
    stats = {
        "mean_js_to_global": 0.12,
        "clients": [
            {"client_id": 0, "train": 40, "js_to_global": 0.1, "task_counts": {"MRPC": 40}},
            {"client_id": 1, "train": 0, "js_to_global": 0.0, "task_counts": {}},
            {
                "client_id": 2,
                "train": 10,
                "js_to_global": 0.2,
                "task_counts": {"RTE": 5, "MRPC": 5},
            },
        ],
    }
    gradients = {2: torch.tensor([0.0, 1.0]), 0: torch.tensor([1.0, 1.0])}
    dis = gradient_dissimilarity(gradients, {2: 10.0, 0: 40.0})
    feature = {"mean": 0.3, "iid_mean": 0.05}
    consistency = {"max_gap": 0.5, "mean_gap": 0.25}
    m = Measures.from_stats(stats, gradient=dis, feature=feature, consistency=consistency)
    assert m.num_clients == 2 and dict(m.sizes) == {0: 40, 2: 10}  # size CV 0.6
    assert m.label_js_mean == 0.12 and m.label_js_max == 0.2
    assert m.num_tasks == 2 and m.task_shares == {0: {"MRPC": 1.0}, 2: {"RTE": 0.5, "MRPC": 0.5}}
    assert m.feature_shift == 0.3 and m.feature_shift_iid == 0.05
    assert m.consistency_gap_max == 0.5 and m.g2 == dis.g2 and m.b2 == dis.b2
    assert m.g2_debiased is m.b2_debiased is m.noise_share is None  # no noise given
    # rows follow the sizes' order (0, 2), not the gradients' (2, 0)
    assert np.allclose(m.gradient_cosine, [[1.0, 2**-0.5], [2**-0.5, 1.0]])
    assert [f.kind for f in advise(m).findings] == [
        "label_skew",
        "quantity_skew",
        "feature_skew",
        "concept_shift",
        "task_heterogeneity",
    ]
    noisy = gradient_dissimilarity(gradients, {2: 10.0, 0: 40.0}, {2: 0.01, 0: 0.02})
    m = Measures.from_stats(stats, gradient=noisy)
    assert (m.g2_debiased, m.b2_debiased, m.noise_share) == (
        noisy.g2_debiased,
        noisy.b2_debiased,
        noisy.noise_share,
    )
    assert m.g2_debiased is not None and m.g2_debiased < m.g2


def test_severe_label_skew_quotes_the_clients_holding_one_label() -> None:
    """From the partition's label counts: clients 0 and 2 train on one class, client 3 on
    both (client 1 has no data); the severe finding quotes "2 of 3 clients hold one label"
    and puts training alone first. Without label counts (a regression task) it is not
    quoted."""
    counts = {0: [40, 0], 1: [0, 0], 2: [0, 10], 3: [6, 9]}
    stats = {
        "mean_js_to_global": 0.3,
        "clients": [
            {"client_id": c, "train": sum(n), "js_to_global": 0.3, "label_counts": n}
            for c, n in counts.items()
        ],
    }
    m = Measures.from_stats(stats)
    assert m.one_label_clients == 2
    (finding,) = [f for f in advise(m).findings if f.kind == "label_skew"]
    assert "(severe > 0.2; max 0.3; 2 of 3 clients hold one label)" in finding.message
    assert finding.evidence["one_label_clients"] == 2
    assert finding.recommendations[0].startswith("local training (an adapter of its own")
    for client in stats["clients"]:
        client["label_counts"] = None
    unlabeled = Measures.from_stats(stats)
    assert unlabeled.one_label_clients is None
    assert "hold one label" not in advise(unlabeled).findings[0].message

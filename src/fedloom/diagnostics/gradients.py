"""Client gradients at one model and how much they disagree, with and without the
minibatch noise of estimating them.

With data shares p_k = n_k / Σ_j n_j, client objectives F_k and the federated objective
F = Σ_k p_k F_k (so ∇F = Σ_k p_k ∇F_k), at a point w:

* gradient dissimilarity  G²(w) = Σ_k p_k ‖∇F_k(w) − ∇F(w)‖², the weighted variance of
  the client gradients around their mean — the constant of the bounded-dissimilarity
  assumption under which Karimireddy et al. 2020 ("SCAFFOLD: Stochastic Controlled
  Averaging for Federated Learning", ICML, Assumption A1 with B = 1) bound FedAvg's
  client drift;
* B-local dissimilarity   B²(w) = Σ_k p_k ‖∇F_k(w)‖² / ‖∇F(w)‖² (Li et al. 2020,
  "Federated Optimization in Heterogeneous Networks" (FedProx), Definition 3). B² ≥ 1,
  with equality iff every client gradient equals the mean; expanding the square,
  Σ_k p_k ‖∇F_k‖² = ‖∇F‖² + G², so G² = (B² − 1) ‖∇F‖². B is undefined where ∇F = 0
  (e.g. at the federated optimum); it is reported as infinite there.

Each ∇F_k is estimated by :func:`client_gradient_estimate` on a seeded sample of the
client's examples, with dropout off, so that the numbers are reproducible.

Minibatch noise. The estimate is ĝ_k = g_k + ε_k with g_k = ∇F_k, E ε_k = 0,
v_k = E ‖ε_k‖² (the trace of Cov ε_k), the clients' samples independent, and the plug-in
mean ĝ = Σ_k p_k ĝ_k = ∇F + ε̄, ε̄ = Σ_k p_k ε_k. The cross terms of the expanded squares
have mean zero, so

    E ‖ĝ‖²              = ‖∇F‖² + E ‖ε̄‖²          = ‖∇F‖² + Σ_k p_k² v_k,
    E Σ_k p_k ‖ĝ_k‖²     = Σ_k p_k (‖g_k‖² + v_k)  = Σ_k p_k ‖g_k‖² + Σ_k p_k v_k,

and since Σ_k p_k ‖ĝ_k − ĝ‖² = Σ_k p_k ‖ĝ_k‖² − ‖ĝ‖² (and likewise without hats),

    E Σ_k p_k ‖ĝ_k − ĝ‖² = G² + Σ_k p_k v_k − Σ_k p_k² v_k = G² + Σ_k p_k (1 − p_k) v_k.

The raw G² is biased upwards by the noise: IID clients measured on a few small batches
look heterogeneous, and B² = 1 + G²/‖∇F‖² grows with it. Given unbiased estimates v̂_k
(see :func:`client_gradient_estimate`), :func:`gradient_dissimilarity` subtracts the bias:

    G²_debiased    = max(G²_raw − Σ_k p_k (1 − p_k) v̂_k, 0),
    ‖∇F‖²_debiased = max(‖ĝ‖² − Σ_k p_k² v̂_k, 0),
    B²_debiased    = (‖∇F‖²_debiased + G²_debiased) / ‖∇F‖²_debiased  (∞ where it is 0),

and reports the noise share Σ_k p_k (1 − p_k) v̂_k / G²_raw, the part of the measured
spread that sampling noise explains (≈ 1 for IID clients, ≪ 1 for genuinely different
ones; it can exceed 1, when G²_debiased is clipped to 0). The two differences are
unbiased before the clipping at 0; the clipping (and the ratio in B²) makes the reported
values slightly biased upwards, which is the safe side for the "looks IID" verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from fedloom.models.heads import Feature
from fedloom.params import Params


class Head(Protocol):
    training: bool

    def train(self, mode: bool = True) -> Any: ...


class GradientModel(Protocol):
    """What :func:`client_gradient_estimate` needs of a model (FedModel has all of it)."""

    @property
    def head(self) -> Head: ...

    def set_params(self, params: Params) -> None: ...

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]: ...

    def batches(
        self, features: Sequence[Feature], batch_size: int, order: np.ndarray | None = None
    ) -> Iterator[Any]: ...

    def loss(self, batch: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class GradientEstimate:
    """A client's gradient estimate ĝ_k and its sampling noise.

    ``mean``: ĝ_k, one float64 CPU vector; ``noise``: v̂_k, an unbiased estimate of
    E ‖ĝ_k − ∇F_k‖² (0 when every example was used, nan when it cannot be estimated: one
    batch of a subsample); ``batches``: the number of minibatches b; ``examples``: the
    number of examples m they hold."""

    mean: torch.Tensor
    noise: float
    batches: int
    examples: int


def client_gradient_estimate(
    model: GradientModel,
    params: Params,
    features: Sequence[Feature],
    batches: int,
    batch_size: int,
    seed: int,
) -> GradientEstimate:
    """ĝ_k ≈ ∇F_k(params) and its noise v̂_k from minibatch gradients.

    ĝ_k is one float64 CPU vector over the trainable tensors (in the order of
    ``model.trainable_parameters()``, i.e. ``model.param_names``). F_k is the mean example
    loss over the client's n examples; m = min(n, batches · batch_size) of them are drawn
    without replacement with ``seed`` and cut into b = ⌈m / batch_size⌉ batches, and ĝ_k is
    the example-weighted mean of the batch gradients h_j (each batch's mean loss counts
    with its share of the m examples), i.e. the gradient of the mean loss over the sample.
    Dropout is off while the gradients are taken (the head's train/eval mode is restored).
    They are computed with ``torch.autograd.grad``, so no ``.grad`` attribute is read or
    left behind.

    Noise. If m = n, ĝ_k = ∇F_k: v̂_k = 0, whatever b is (this is the only case with a
    ragged last batch). Otherwise m = b · s with every batch full (s = ``batch_size``).
    Treat h_j as the mean of its s examples' gradients x_i (exact when a batch's loss is
    the mean of its examples' losses, as in the classifier heads; an approximation for a
    token-weighted mean such as the verbalizer's), and let S² = Σ_i ‖x_i − ∇F_k‖² / (n − 1)
    over the client's n examples. Sampling m of them without replacement gives

        v_k = E ‖ĝ_k − ∇F_k‖² = (S² / m) (1 − m/n).

    Given the m drawn examples, the batches are a uniformly random partition of them into
    b parts, so each h_j is a without-replacement sample mean of s of them around their
    mean ĝ_k = h̄: E ‖h_j − h̄‖² = (S_m² / s)(1 − s/m) with S_m² the sample's variance
    (denominator m − 1), and E S_m² = S². Summing, E Σ_j ‖h_j − h̄‖² = (b − 1) S² / s, so
    for b ≥ 2

        v̂_k = (1 − m/n) · (1/b) · (1/(b − 1)) · Σ_j ‖h_j − h̄‖²

    — the trace of the sample covariance of the batch gradients, divided by b because ĝ_k
    is their mean, with the finite-population correction — is unbiased for v_k. With a
    single batch of a proper subsample (b = 1, m < n) it cannot be estimated: nan. The
    sum Σ_j s_j ‖h_j − ĝ_k‖² (= s Σ_j ‖h_j − h̄‖²) is accumulated with a weighted Welford
    update next to the mean, so only two vectors are held at a time.
    """
    if not features:
        raise ValueError("client_gradient: the client has no examples")
    if batches < 1 or batch_size < 1:
        raise ValueError(
            f"client_gradient: batches ({batches}) and batch_size ({batch_size}) must be >= 1"
        )
    model.set_params(params)
    tensors = list(model.trainable_parameters().values())
    rng = np.random.default_rng(seed)
    sample = rng.permutation(len(features))[: batches * batch_size]
    sizes = [len(sample[i : i + batch_size]) for i in range(0, len(sample), batch_size)]
    mean = torch.zeros(sum(p.numel() for p in tensors), dtype=torch.float64)
    weight = 0
    spread = 0.0  # Σ_j s_j ‖h_j − mean‖², over the batches so far
    was_training = model.head.training
    model.head.train(False)
    try:
        for size, batch in zip(sizes, model.batches(features, batch_size, sample), strict=True):
            grads = torch.autograd.grad(model.loss(batch), tensors, allow_unused=True)
            h = torch.cat(
                [
                    torch.zeros(p.numel(), dtype=torch.float64)
                    if g is None
                    else g.detach().reshape(-1).to("cpu", torch.float64)
                    for p, g in zip(tensors, grads, strict=True)
                ]
            )
            weight += size
            delta = h - mean
            mean += delta * (size / weight)
            spread += size * float(delta @ (h - mean))
    finally:
        model.head.train(was_training)
    m, n, b = len(sample), len(features), len(sizes)
    if m == n:
        noise = 0.0
    elif b < 2:
        noise = math.nan
    else:  # spread / m = Σ_j ‖h_j − h̄‖² / b, every batch holding s = m / b examples
        noise = (1 - m / n) * spread / ((b - 1) * m)
    return GradientEstimate(mean=mean, noise=noise, batches=b, examples=m)


def client_gradient(
    model: GradientModel,
    params: Params,
    features: Sequence[Feature],
    batches: int,
    batch_size: int,
    seed: int,
) -> torch.Tensor:
    """ĝ_k alone: ``client_gradient_estimate(...).mean``."""
    return client_gradient_estimate(model, params, features, batches, batch_size, seed).mean


@dataclass(frozen=True)
class Dissimilarity:
    """Heterogeneity of client gradients at one point (see the module docstring).

    ``g2``, ``b2``, ``mean_gradient_norm``, ``per_client`` and ``cosine`` are the plug-in
    (raw) values on the estimated gradients; ``g2_debiased``, ``b2_debiased`` and
    ``noise_share`` correct for their sampling noise, and are None when the noise was not
    given or some client's is unknown (nan). ``clients`` orders the rows and columns of
    ``cosine``; cosine similarities with a zero gradient are 0."""

    g2: float
    b2: float
    mean_gradient_norm: float
    per_client: dict[int, float]
    cosine: np.ndarray
    clients: tuple[int, ...]
    g2_debiased: float | None = None
    b2_debiased: float | None = None
    noise_share: float | None = None


def gradient_dissimilarity(
    gradients: Mapping[int, torch.Tensor],
    weights: Mapping[int, float],
    noise: Mapping[int, float] | None = None,
) -> Dissimilarity:
    """G², B², ‖∇F‖, each client's ‖∇F_k − ∇F‖² and the K × K cosine similarities of the
    client gradients, with p_k = weights[k] / Σ_j weights[j] (e.g. example counts).

    ``noise`` maps each client to v̂_k, its gradient's sampling noise
    (:attr:`GradientEstimate.noise`); with it G², ‖∇F‖² and B² are also reported with the
    noise removed, and the noise share of G² (see the module docstring)."""
    if not gradients:
        raise ValueError("gradient_dissimilarity of no clients")
    if gradients.keys() != weights.keys():
        raise ValueError(
            f"gradients and weights name different clients: "
            f"{sorted(gradients)} vs {sorted(weights)}"
        )
    if noise is not None and noise.keys() != gradients.keys():
        raise ValueError(
            f"gradients and noise name different clients: {sorted(gradients)} vs {sorted(noise)}"
        )
    if noise is not None and any(v < 0 for v in noise.values()):
        raise ValueError(f"gradient noise must be non-negative: {dict(noise)}")
    clients = tuple(gradients)
    g = torch.stack([gradients[c].detach().to("cpu", torch.float64).reshape(-1) for c in clients])
    w = torch.tensor([weights[c] for c in clients], dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(
            f"client weights must be non-negative with a positive sum: {dict(weights)}"
        )
    p = w / w.sum()
    mean = p @ g
    spread = ((g - mean) ** 2).sum(1)
    g2 = float(p @ spread)
    mean_sq = float(mean @ mean)
    b2 = float(p @ (g**2).sum(1)) / mean_sq if mean_sq > 0 else math.inf
    norms = g.norm(dim=1)
    outer = torch.outer(norms, norms)
    cosine = torch.where(outer > 0, (g @ g.T) / outer.clamp_min(1e-300), 0.0)
    g2_debiased = b2_debiased = noise_share = None
    if noise is not None and not any(math.isnan(noise[c]) for c in clients):
        v = torch.tensor([noise[c] for c in clients], dtype=torch.float64)
        bias = float(p @ ((1 - p) * v))
        g2_debiased = max(g2 - bias, 0.0)
        mean_sq_debiased = max(mean_sq - float(p**2 @ v), 0.0)
        b2_debiased = (
            (mean_sq_debiased + g2_debiased) / mean_sq_debiased
            if mean_sq_debiased > 0
            else math.inf
        )
        noise_share = bias / g2 if g2 > 0 else (0.0 if bias == 0 else math.inf)
    return Dissimilarity(
        g2=g2,
        b2=b2,
        mean_gradient_norm=mean_sq**0.5,
        per_client={c: float(s) for c, s in zip(clients, spread, strict=True)},
        cosine=cosine.numpy(),
        clients=clients,
        g2_debiased=g2_debiased,
        b2_debiased=b2_debiased,
        noise_share=noise_share,
    )

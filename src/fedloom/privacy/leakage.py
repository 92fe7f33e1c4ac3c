"""What an honest-but-curious server can read from one client's update: the attacks of the
leakage evaluation (``benchmarks/leakage.py`` runs them on real updates of a MiniLM client).

* **Label counts** from the classifier's bias (iDLG, Zhao et al. 2020; the count
  estimate of LLG, Wainakh et al. 2022). For softmax cross-entropy the gradient of the
  bias of class j over a batch of B examples is g_j = p̄_j − c_j / B (p̄ the mean predicted
  probability, c_j the count of label j), so c_j = B (p̄_j − g_j). After S steps of SGD at
  rate η from the payload, Δb = −η Σ_s g_s, so the counts over the round's S batches are
  B (S p̄ + Δb / η), with p̄ estimated by the server on data of its own under the global
  adapter it sent (LLG+'s estimate). The estimate assumes SGD; under AdamW it is applied
  all the same, and the table says what it gets.
* **Tokens** from the first layer's LoRA update (the span check of DAGER, Petrov et al.
  2024). The query, key and value projections of block 0 read the embedding output
  x_t = LayerNorm(E[v_t] + P[t] + T[0]), and the gradient of their LoRA factor A is
  Σ_t (s Bᵀ δ_t) x_tᵀ: every row of the gradient lies in span{x_t} (weight decay's
  −ηλA₀ is removed first: :func:`embedding_readers`). So the vocabulary entry v (at
  some position p) whose x_{v,p} lies in the row space of the stacked ΔA is a token of
  the batch. fedloom scores each v by max_p ‖Π x_{v,p}‖ / ‖x_{v,p}‖ (Π the projection on
  that row space) and recovers the tokens scoring above a threshold. How fedloom differs
  from DAGER: LoRA's ΔA has at most r rows per projection, so the row space holds at most
  3r directions of span{x_t}; a batch of more distinct token inputs than that is only
  partly visible, which the table shows; and the client trains with dropout and bf16
  autocast as it really does, so a true token scores below 1 (the threshold is 0.9).
* **DLG** (Zhu et al. 2019): dummy input embeddings and soft labels optimized with L-BFGS
  until their gradient matches the observed one; each dummy embedding is then read as its
  nearest vocabulary entry (:func:`dlg`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn


def label_counts(
    delta_bias: torch.Tensor, lr: float, steps: int, batch_size: int, mean_probs: torch.Tensor
) -> np.ndarray:
    """The label counts of the ``steps`` batches of ``batch_size`` examples behind the
    bias update ``delta_bias`` of SGD at rate ``lr`` (rounded to whole examples that add
    up to steps × batch_size)."""
    total = steps * batch_size
    raw = batch_size * (steps * mean_probs.double() + delta_bias.double() / lr)
    counts = np.clip(np.rint(raw.numpy()), 0, total).astype(int)
    while counts.sum() != total:  # fix the rounding: move one example at a time
        j = (
            int(np.argmax(raw.numpy() - counts))
            if counts.sum() < total
            else int(np.argmax(counts - raw.numpy()))
        )
        counts[j] += 1 if counts.sum() < total else -1
    return counts


def labels_recovered(true_counts: Sequence[int], estimated: Sequence[int]) -> float:
    """The fraction of the examples whose label the estimate accounts for: Σ_j min(c_j,
    ĉ_j) / Σ_j c_j."""
    true = np.asarray(true_counts)
    return float(np.minimum(true, np.asarray(estimated)).sum() / max(1, true.sum()))


#: the LoRA A factors that read the embedding output in a BERT-style encoder: block 0's
#: query, key and value projections (block 0's other layers read its attention's output)
EMBEDDING_READERS = re.compile(r"\.layer\.0\.attention\.self\.(query|key|value)\.lora_A\b")


def embedding_readers(
    delta: dict[str, torch.Tensor], payload: dict[str, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The updates of the LoRA A factors whose rows lie in the span of the first-layer
    inputs (:data:`EMBEDDING_READERS`). With the ``payload`` they started from, each is
    first rid of its component along the starting factor A₀: weight decay adds −ηλA₀
    to the update (SGD and AdamW alike), a full-rank term outside the span, and its
    coefficient is estimated by least squares (⟨ΔA, A₀⟩ / ‖A₀‖²), which also works after
    clipping has scaled the update by a factor the server does not know."""
    out = []
    for name, d in sorted(delta.items()):
        if not EMBEDDING_READERS.search(name):
            continue
        d = d.double()
        if payload is not None:
            start = payload[name].double()
            d = d - (d * start).sum() / (start * start).sum().clamp_min(1e-30) * start
        out.append(d)
    return out


def row_space(deltas: Iterable[torch.Tensor], tolerance: float = 1e-6) -> torch.Tensor:
    """An orthonormal basis (d × k) of the row space of the stacked ``deltas`` (each
    r × d), to the numerical rank at ``tolerance`` of the largest singular value."""
    stacked = torch.cat([d.double() for d in deltas])
    _, s, vh = torch.linalg.svd(stacked, full_matrices=False)
    if s.numel() == 0 or s[0] == 0:
        return torch.zeros(stacked.shape[1], 0, dtype=torch.float64)
    return vh[s > tolerance * s[0]].T


@dataclass(frozen=True)
class FirstLayerInputs:
    """x_{v,p} = LayerNorm(E[v] + P[p] + T[type]) of a BERT-style embedding module: the
    input of block 0's projections for token v at position p."""

    word: torch.Tensor
    position: torch.Tensor
    token_type: torch.Tensor
    norm: nn.LayerNorm

    @classmethod
    def of(cls, embeddings: nn.Module) -> FirstLayerInputs:
        parts = dict(embeddings.named_children())

        def table(name: str) -> torch.Tensor:
            return cast(nn.Embedding, parts[name]).weight.detach().float()

        return cls(
            table("word_embeddings"),
            table("position_embeddings"),
            table("token_type_embeddings"),
            cast(nn.LayerNorm, parts["LayerNorm"]),
        )

    @torch.no_grad()
    def at(self, position: int, token_type: int = 0) -> torch.Tensor:
        """(vocabulary × d) inputs of every token at ``position``."""
        x = self.word + self.position[position] + self.token_type[token_type]
        return self.norm.float()(x).double()


@torch.no_grad()
def token_scores(
    basis: torch.Tensor, inputs: Callable[[int], torch.Tensor], positions: Iterable[int]
) -> torch.Tensor:
    """max over ``positions`` of ‖Π x_{v,p}‖ / ‖x_{v,p}‖ for every vocabulary entry v, Π the
    projection on the columns of ``basis``."""
    best: torch.Tensor | None = None
    for p in positions:
        x = inputs(p)
        score = (x @ basis).norm(dim=1) / x.norm(dim=1).clamp_min(1e-12)
        best = score if best is None else torch.maximum(best, score)
    assert best is not None
    return best


def precision_recall(recovered: set[int], true: set[int]) -> tuple[float, float]:
    hits = len(recovered & true)
    return hits / max(1, len(recovered)), hits / max(1, len(true))


def dlg(
    gradient_of: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]],
    observed: list[torch.Tensor],
    shape: tuple[int, int, int],
    num_labels: int,
    iterations: int = 50,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deep Leakage from Gradients: (dummy inputs of ``shape``, soft labels) whose
    gradient ``gradient_of(inputs, label_logits)`` (with ``create_graph=True``) matches
    ``observed`` in squared L2, optimized with L-BFGS for ``iterations`` steps."""
    g = torch.Generator().manual_seed(seed)
    dummy = torch.randn(shape, generator=g).requires_grad_(True)
    labels = torch.randn(shape[0], num_labels, generator=g).requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [dummy, labels], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        grads = gradient_of(dummy, labels)
        loss = sum(((a - b) ** 2).sum() for a, b in zip(grads, observed, strict=True))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        return loss

    optimizer.step(closure)
    return dummy.detach(), labels.detach()

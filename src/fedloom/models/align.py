"""Aligning PQ-LoRA's frozen factors across backbones (FedMosaic, Seo et al., arXiv 2506.11024).

A PQ-LoRA layer computes ``out = W x + s · B((A x) P + Q)`` with A ∈ R^{r×d_in} and
B ∈ R^{d_out×r} frozen; only P (r×r) and Q (1×r) train and travel. P and Q depend only on
r, so clients with different backbones can average them, block k of one model with block k
of the other, module by role (query, key, value, attention output, MLP up, MLP down), if
the rank spaces mean the same thing in both models. The smallest backbone is the *anchor*:
its A (orthonormal rows) and B (orthonormal columns) are random and seeded
(:func:`anchor_adapters`). A bigger model's factors are fitted on public text that both
models read, the tokens of the two tokenizations matched by character offsets
(:func:`char_alignment`):

**A (input side).** With x_b the big module's inputs and z = A_anchor x_a the anchor's
rank-space activations on matched tokens (:func:`fit_projection`)::

    A_big = argmin_{A Aᵀ = I_r}  Σ_t ||A x_t − z_t||² / Σ_t ||z_t||²

Rows orthonormal like the anchor's A, so that the two rank-space activations keep
comparable scales whatever the widths and activation norms of the two models, and P, Q
averaged across them act on inputs of the same size. Started from the least-squares
solution re-orthonormalised by ``polar`` (A = U S Vᵀ -> U Vᵀ, the nearest matrix with
orthonormal rows, the official ``closest_row_orthonormal``; this changes the fit), then
Adam on A = Gram–Schmidt(W), which keeps the rows orthonormal at every step. Why not the
official recipe, MSE + an orthogonality penalty, then the projection: the penalty is met
only approximately and the final projection moves the fit. On MiniLM -> SmolLM2 (256
SST-2 sentences, r = 8, 4 blocks, 28 modules) the held-out relative MSE (median over
modules) is 0.61 with the constraint, 0.76-0.88 with λ ||A Aᵀ − I||²_F (λ in 0.1, 1, 10,
300 Adam steps) and 0.80 for least squares + projection; a random orthonormal A gives 1.26
(``benchmarks/align_quality.py``).

**B (output side).** With y_a, y_b the two modules' outputs on matched tokens, a linear map
G: R^{d_a} → R^{d_b} sends an anchor output direction to the big model's output space, and
``B_big = polar(G B_anchor)`` (orthonormal columns, like B_anchor), so that B_big h changes
the big model's output the way B_anchor h changes the anchor's (:func:`fit_output_map`,
:func:`output_map`). Outputs are centred: B adds a change to the output, so only the linear
part of the relation matters, not an offset.

- ``lstsq``: G = Mᵀ, M = argmin ||Y_a M − Y_b||² + ρ ||M||² = (Y_aᵀY_a + ρ I)⁻¹ Y_aᵀ Y_b.
- ``cca`` (the paper's choice): regularised CCA (:func:`regularized_cca`) with covariances
  Σ_aa + ρ I, Σ_bb + ρ I and Σ_ab gives canonical directions W_a, W_b whose variates
  u = W_aᵀ y_a, v = W_bᵀ y_b have identity covariance and correlations ρ_1 ≥ ρ_2 ≥ ... .
  The map reads the anchor's canonical variates as the big model's and reconstructs y_b
  from them, G = Σ_bb W_b W_aᵀ (Σ_bb W_b = Cov(y_b, v)); this is the official code's
  ``mapping_mat = Σ_bb^{1/2} V Uᵀ Σ_aa^{-1/2}`` with T = Σ_aa^{-1/2} Σ_ab Σ_bb^{-1/2} = U S Vᵀ.
  When y_b = M*ᵀ y_a exactly (d_b ≥ d_a), G = M*ᵀ.

Both ridges ρ are relative: ``ridge`` times the mean variance (mean eigenvalue of the
Gram matrix), so one value serves layers whose activation scales differ by orders of
magnitude. Defaults (``lstsq``, ridge 0.1) were chosen on held-out sentences (SST-2 train
rows 256-383) for MiniLM -> SmolLM2: held-out R² of G, median over modules, 0.31 for
``lstsq`` against 0.08 for ``cca`` (0.12 at ridge 1), which treats every canonical pair as
perfectly correlated, the weak ones too; ``cca`` is also ~4x slower here (eigh and SVD of
1536×1536 covariances).

PQ-LoRA sits in the :func:`~fedloom.models.pqlora.pq_layers` of the adapted blocks;
:data:`fedloom.models.pqlora.ROLES` names each role's module per ``model_type``. Llama's
gate_proj, which BERT lacks, is matched with the anchor's MLP up
projection (:data:`ANCHOR_ROLE`). :func:`align_pair` returns flat ``Params``-style names,
``anchor.block{k}.{role}.{A|B}`` and ``big.block{k}.{role}.{A|B}``; :func:`pq_targets` maps
``block{k}.{role}`` to the module name in a model. :func:`cached` saves them with
safetensors, keyed by a description of the inputs (:func:`alignment_meta`).

Differences from the official code (``train_abalign.py``, ``federated_methods/
AB_init_cross_model_arch.py``, ``utils/align_tokens.py``):

- Tokens: it matches token *strings* with FuseLLM's greedy dynamic matching (minimal
  spans of equal concatenated text, after stripping "Ġ") and mean-pools the anchor's
  tokens of a span for every big-model token in it. Here tokens are matched by character
  offsets: one pair per common end offset (see :func:`char_alignment`), which does not
  depend on how a tokenizer marks spaces or on lowercasing (MiniLM is uncased, SmolLM2 is
  not), and pairs the last token of each span, the first position of a causal model that
  has read the whole span.
- A: it trains ``lora_A`` through the Hugging Face Trainer (a forward pass of both models
  per step, bf16) on MSE plus 0.5 × the mean squared off-diagonal cosine similarity of
  ``F.normalize(A, dim=0)`` — for PEFT's (r, d_in) weight that compares the d_in columns,
  not the r rows its comment describes, and fixes no scale — then projects onto
  orthonormal rows. Here activations are collected once, the objective runs on Gram
  matrices (cost independent of the number of tokens), starts at the projected
  least-squares optimum and keeps the rows orthonormal exactly (see "A" above).
- B: it runs CCA between the ``lora_B`` outputs (B A x with P = I, rank r) of both models,
  in bf16, with an absolute ridge 1e-4 on unnormalised scatter matrices, and does not
  re-orthonormalise B_big. Here ridge least squares (default) or CCA runs between the
  frozen modules' own outputs W x, in float64, with a relative ridge, and B_big's columns are
  made orthonormal like the anchor's.
- Models: it aligns Llama/Qwen decoders (same module names); here a BERT encoder anchor
  and a Llama decoder, roles mapped by :data:`fedloom.models.pqlora.ROLES`. The anchor's
  A and B come from a saved random initialisation there, from a seeded QR per module here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal, NamedTuple, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from fedloom.models.blocks import block_list
from fedloom.models.pqlora import ROLES, adapted_blocks, orthonormal, pq_layers

Method = Literal["cca", "lstsq"]
Offsets = Sequence[tuple[int, int]]

#: a big model's role -> the anchor's role it is aligned with, where the names differ
ANCHOR_ROLE: dict[str, str] = {"mlp_gate": "mlp_up"}

_META_KEY = "fedloom.alignment"


class AlignmentCacheError(ValueError):
    """An alignment cache file exists but cannot be read."""


# ----------------------------------------------------------------------------- targets


def _model_type(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    if model_type not in ROLES:
        raise ValueError(f"PQ-LoRA alignment knows model types {sorted(ROLES)}, not {model_type!r}")
    return model_type


def pq_targets(model: nn.Module, num_blocks: int) -> dict[str, str]:
    """``"block{k}.{role}"`` -> module name (as in ``model.named_modules()``) for every
    PQ-LoRA module of ``model``."""
    model_type = _model_type(model)
    layers = block_list(model)
    adapted = adapted_blocks(model) or list(
        range(len(cast(nn.ModuleList, model.get_submodule(layers))))
    )
    return {
        f"block{k}.{role}": f"{layers}.{layer}.{suffix}"
        for k, layer in enumerate(pq_layers(adapted, num_blocks))
        for role, suffix in ROLES[model_type].items()
    }


# ----------------------------------------------------------------------------- tokens


def char_alignment(offsets_a: Offsets, offsets_b: Offsets) -> list[tuple[int, int]]:
    """Pairs (i, j) of tokens of two tokenizations of the same text that end at the same
    character (``offsets_*``: a fast tokenizer's ``offset_mapping``), in text order.

    Between two consecutive common end offsets both tokenizations cover the same span of
    text; the pair is the last token of the span on each side. Special tokens and other
    empty tokens (start == end, e.g. (0, 0)) are skipped. Where several tokens of one side
    end at the same character (a multi-byte character split into bytes), the last one
    counts. Start offsets are ignored: tokenizers differ in whether a token owns the space
    before it (BERT (3, 4) vs byte-level BPE (2, 4) for " '").
    """
    last_b = {end: j for j, (start, end) in enumerate(offsets_b) if end > start}
    last_a = {end: i for i, (start, end) in enumerate(offsets_a) if end > start}
    return [(i, last_b[end]) for end, i in sorted(last_a.items()) if end in last_b]


def paired(
    rows_a: Sequence[torch.Tensor],
    rows_b: Sequence[torch.Tensor],
    pairs: Sequence[Sequence[tuple[int, int]]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the matched token rows of every text: ``rows_*[t]`` is text t's (tokens, d)
    activations, ``pairs[t]`` its :func:`char_alignment`."""
    take_a, take_b = [], []
    for a, b, text_pairs in zip(rows_a, rows_b, pairs, strict=True):
        i, j = zip(*text_pairs, strict=True) if text_pairs else ((), ())
        take_a.append(a[list(i)])
        take_b.append(b[list(j)])
    return torch.cat(take_a), torch.cat(take_b)


# ----------------------------------------------------------------------------- linear algebra


def polar(m: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor U Vᵀ of m = U S Vᵀ: the nearest matrix (Frobenius) with
    orthonormal rows (wide m) or columns (tall m); same row and column space as m."""
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    return u @ vh


def _ridge(gram: torch.Tensor, ridge: float) -> torch.Tensor:
    """gram + ridge · (mean eigenvalue) · I."""
    d = gram.shape[0]
    return gram + ridge * (torch.trace(gram) / d) * torch.eye(d, dtype=gram.dtype)


def _inv_sqrt(s: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(s)
    return (vectors * values.rsqrt()) @ vectors.T


def _centred(y: torch.Tensor) -> torch.Tensor:
    y = y.double()
    return y - y.mean(dim=0)


# ----------------------------------------------------------------------------- A


def _orthonormal_rows(w: torch.Tensor) -> torch.Tensor:
    """L⁻¹ W with W Wᵀ = L Lᵀ (Cholesky): Gram–Schmidt of W's rows, orthonormal rows spanning
    the same space; differentiable (unlike the polar factor at W Wᵀ = I)."""
    return torch.linalg.solve_triangular(torch.linalg.cholesky(w @ w.T), w, upper=False)


def fit_projection(
    x_big: torch.Tensor, z_anchor: torch.Tensor, steps: int = 200, lr: float = 1e-3
) -> torch.Tensor:
    """A_big (rank, d_big) with orthonormal rows such that A_big x_big ≈ z_anchor, from
    matched rows ``x_big`` (n, d_big) and ``z_anchor`` (n, rank) (module docstring, "A").

    Start: the least-squares solution, re-orthonormalised (:func:`polar`). That changes
    the fit, and is done because the anchor's A has orthonormal rows: with both A's
    orthonormal, the two models' rank-space activations have comparable scales and
    averaged P, Q act on inputs of the same size. Then ``steps`` full-batch Adam steps on
    Σ||A x − z||² / Σ||z||² over A = Gram–Schmidt(W), so every iterate keeps orthonormal
    rows and recovers what the projection lost. The loss goes through the Gram matrices
    XᵀX, XᵀZ: a step costs O(rank · d²) whatever n. Deterministic (no random start).
    """
    x, z = x_big.double(), z_anchor.double()
    sxx, sxz, szz = x.T @ x, x.T @ z, (z * z).sum()
    w = nn.Parameter(polar(torch.linalg.solve(_ridge(sxx, 1e-8), sxz).T))
    optimizer = torch.optim.Adam([w], lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        a = _orthonormal_rows(w)
        ((torch.sum((a @ sxx) * a) - 2 * torch.sum(a * sxz.T) + szz) / szz).backward()
        optimizer.step()
    return _orthonormal_rows(w.detach()).float()


# ----------------------------------------------------------------------------- B


class CCA(NamedTuple):
    """Canonical directions (columns) and correlations, strongest first: the variates
    (y_a − ȳ_a) W_a and (y_b − ȳ_b) W_b have identity covariance (with the ridge)."""

    dirs_a: torch.Tensor  # (d_a, k), k = min(d_a, d_b)
    dirs_b: torch.Tensor  # (d_b, k)
    correlations: torch.Tensor  # (k,)


def _covariance(y: torch.Tensor, ridge: float) -> torch.Tensor:
    return _ridge(y.T @ y / y.shape[0], ridge)


def regularized_cca(y_a: torch.Tensor, y_b: torch.Tensor, ridge: float = 0.1) -> CCA:
    """Regularised CCA of paired rows y_a (n, d_a), y_b (n, d_b) in closed form, float64:
    T = Σ_aa^{-1/2} Σ_ab Σ_bb^{-1/2} = U S Vᵀ, W_a = Σ_aa^{-1/2} U, W_b = Σ_bb^{-1/2} V,
    correlations S (Σ with ``ridge`` × mean variance on the diagonal)."""
    # Hand-written rather than sklearn's CCA: that one is NIPALS, iterative, one component
    # at a time, and takes minutes for hundreds of dimensions; this is two eigh and one SVD.
    a, b = _centred(y_a), _centred(y_b)
    inv_a = _inv_sqrt(_covariance(a, ridge))
    inv_b = _inv_sqrt(_covariance(b, ridge))
    u, s, vh = torch.linalg.svd(inv_a @ (a.T @ b / a.shape[0]) @ inv_b, full_matrices=False)
    return CCA(inv_a @ u, inv_b @ vh.T, s)


def output_map(
    y_anchor: torch.Tensor, y_big: torch.Tensor, ridge: float = 0.1, method: Method = "lstsq"
) -> torch.Tensor:
    """G (d_big, d_anchor), float64: the linear map from the anchor's (centred) module
    outputs to the big model's (module docstring, "B")."""
    if method == "lstsq":
        a, b = _centred(y_anchor), _centred(y_big)
        return torch.linalg.solve(_ridge(a.T @ a, ridge), a.T @ b).T
    if method == "cca":
        cca = regularized_cca(y_anchor, y_big, ridge)
        return _covariance(_centred(y_big), ridge) @ cca.dirs_b @ cca.dirs_a.T
    raise ValueError(f"method must be 'cca' or 'lstsq', not {method!r}")


def fit_output_map(
    y_anchor: torch.Tensor,
    y_big: torch.Tensor,
    b_anchor: torch.Tensor,
    ridge: float = 0.1,
    method: Method = "lstsq",
) -> torch.Tensor:
    """B_big (d_big, rank) = polar(G B_anchor) with G = :func:`output_map`: the anchor's
    B carried into the big model's output space, columns made orthonormal like B_anchor's."""
    g = output_map(y_anchor, y_big, ridge, method)
    return polar(g @ b_anchor.double()).float()


# ----------------------------------------------------------------------------- activations


class Captured(NamedTuple):
    """One module's activations per text: ``inputs[t]`` (tokens, d_in), ``outputs[t]``
    (tokens, d_out), and the text's token ``offsets[t]`` (one (start, end) per row)."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    offsets: list[list[tuple[int, int]]]


def collect(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    module_names: Iterable[str],
    batch_size: int = 32,
    max_length: int = 128,
) -> dict[str, Captured]:
    """Inputs and outputs of the named single-tensor modules (e.g. ``nn.Linear``) for every
    token of every text, from forward hooks on the frozen model in eval mode, no grad.

    Runs ``model.base_model`` (no LM head) on the model's device; the activations are kept
    on the host in fp32. Texts are batched by length and right-padded
    (a causal model's real tokens then see no padding and keep their positions); padding
    rows are dropped, so ``inputs[t]`` has one row per token of text t, special tokens
    included, in the order of ``offsets[t]``.
    """
    names = list(module_names)
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(f"no modules {missing} in the model")
    encoded = tokenizer(
        list(texts), truncation=True, max_length=max_length, return_offsets_mapping=True
    )
    ids, offsets = encoded["input_ids"], [list(map(tuple, o)) for o in encoded["offset_mapping"]]
    inputs = {n: [torch.empty(0)] * len(ids) for n in names}
    outputs = {n: [torch.empty(0)] * len(ids) for n in names}
    batch_io: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def store(_module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            batch_io[name] = (args[0], output)

        return store

    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        order = sorted(range(len(ids)), key=lambda t: len(ids[t]))
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            input_ids, mask = _right_padded([ids[t] for t in batch], tokenizer.pad_token_id or 0)
            batch_io.clear()
            with torch.no_grad():
                cast(nn.Module, model.base_model)(
                    input_ids=input_ids.to(device), attention_mask=mask.to(device)
                )
            if len(batch_io) < len(names):
                silent = sorted(set(names) - set(batch_io))
                raise ValueError(f"modules {silent} are not run by the model's base transformer")
            for name, (x, y) in batch_io.items():
                for row, t in enumerate(batch):
                    length = len(ids[t])
                    # on the host, in fp32: the alignment's solves run there
                    inputs[name][t] = x[row, :length].to("cpu", torch.float32, copy=True)
                    outputs[name][t] = y[row, :length].to("cpu", torch.float32, copy=True)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return {n: Captured(inputs[n], outputs[n], offsets) for n in names}


def _right_padded(ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return input_ids, mask


# ----------------------------------------------------------------------------- the pair


def _key_generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def anchor_adapters(
    model: nn.Module, rank: int, num_blocks: int, seed: int
) -> dict[str, torch.Tensor]:
    """The anchor's own frozen factors, ``anchor.block{k}.{role}.A`` (rank, d_in) with
    orthonormal rows and ``.B`` (d_out, rank) with orthonormal columns: random, a function
    of (seed, name) only, so every anchor client builds the same ones."""
    params = {}
    for slot, name in pq_targets(model, num_blocks).items():
        d_out, d_in = cast(nn.Linear, model.get_submodule(name)).weight.shape
        a_gen, b_gen = _key_generator(seed, f"{slot}.A"), _key_generator(seed, f"{slot}.B")
        params[f"anchor.{slot}.A"] = orthonormal(rank, d_in, a_gen)
        params[f"anchor.{slot}.B"] = orthonormal(d_out, rank, b_gen)
    return params


class Match(NamedTuple):
    """A PQ-LoRA module of the big model and the anchor module it is aligned with."""

    big_slot: str  # "block{k}.{role}"
    big_module: str
    anchor_slot: str
    anchor_module: str


def matched_targets(anchor: nn.Module, big: nn.Module, num_blocks: int) -> list[Match]:
    """Block k of the big model with block k of the anchor, module by role."""
    anchor_targets, big_targets = pq_targets(anchor, num_blocks), pq_targets(big, num_blocks)
    matches = []
    for slot, module in big_targets.items():
        block, role = slot.split(".")
        anchor_slot = f"{block}.{ANCHOR_ROLE.get(role, role)}"
        if anchor_slot not in anchor_targets:
            raise ValueError(f"the anchor has no module for the big model's role {role!r}")
        matches.append(Match(slot, module, anchor_slot, anchor_targets[anchor_slot]))
    return matches


class PairActivations(NamedTuple):
    """Both models' activations on the same texts, their matched modules, and the
    :func:`char_alignment` of each text."""

    matches: list[Match]
    anchor: dict[str, Captured]
    big: dict[str, Captured]
    pairs: list[list[tuple[int, int]]]

    def rows(
        self, match: Match, field: Literal["inputs", "outputs"]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The anchor's and the big model's ``field`` rows of ``match`` on matched tokens."""
        a = getattr(self.anchor[match.anchor_module], field)
        b = getattr(self.big[match.big_module], field)
        return paired(a, b, self.pairs)


def collect_pair(
    anchor: tuple[nn.Module, PreTrainedTokenizerBase],
    big: tuple[nn.Module, PreTrainedTokenizerBase],
    texts: Sequence[str],
    num_blocks: int,
    batch_size: int = 32,
    max_length: int = 128,
) -> PairActivations:
    """Run both frozen models on ``texts`` and keep what the fits need (:func:`collect`)."""
    (anchor_model, anchor_tok), (big_model, big_tok) = anchor, big
    matches = matched_targets(anchor_model, big_model, num_blocks)
    anchor_modules = sorted({m.anchor_module for m in matches})
    acts_a = collect(anchor_model, anchor_tok, texts, anchor_modules, batch_size, max_length)
    big_modules = [m.big_module for m in matches]
    acts_b = collect(big_model, big_tok, texts, big_modules, batch_size, max_length)
    offsets_a, offsets_b = acts_a[anchor_modules[0]].offsets, acts_b[matches[0].big_module].offsets
    pairs = [char_alignment(oa, ob) for oa, ob in zip(offsets_a, offsets_b, strict=True)]
    return PairActivations(matches, acts_a, acts_b, pairs)


def fit_pair(
    acts: PairActivations,
    anchor_params: Mapping[str, torch.Tensor],
    *,
    method: Method = "lstsq",
    ridge: float = 0.1,
    steps: int = 200,
    lr: float = 1e-3,
) -> dict[str, torch.Tensor]:
    """The big model's aligned factors, ``big.block{k}.{role}.A`` (:func:`fit_projection`)
    and ``.B`` (:func:`fit_output_map`), against the anchor's ``anchor_params``."""
    params = {}
    for m in acts.matches:
        x_a, x_b = acts.rows(m, "inputs")
        z = x_a @ anchor_params[f"anchor.{m.anchor_slot}.A"].T
        params[f"big.{m.big_slot}.A"] = fit_projection(x_b, z, steps, lr)
        y_a, y_b = acts.rows(m, "outputs")
        b_anchor = anchor_params[f"anchor.{m.anchor_slot}.B"]
        params[f"big.{m.big_slot}.B"] = fit_output_map(y_a, y_b, b_anchor, ridge, method)
    return params


def align_pair(
    anchor: tuple[nn.Module, PreTrainedTokenizerBase],
    big: tuple[nn.Module, PreTrainedTokenizerBase],
    texts: Sequence[str],
    rank: int,
    num_blocks: int,
    seed: int,
    *,
    method: Method = "lstsq",
    ridge: float = 0.1,
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 32,
    max_length: int = 128,
) -> dict[str, torch.Tensor]:
    """The anchor's seeded factors (:func:`anchor_adapters`) and the big model's aligned
    ones (:func:`fit_pair`), fitted on ``texts`` read by both frozen models."""
    params = anchor_adapters(anchor[0], rank, num_blocks, seed)
    acts = collect_pair(anchor, big, texts, num_blocks, batch_size, max_length)
    fits = fit_pair(acts, params, method=method, ridge=ridge, steps=steps, lr=lr)
    return params | fits


# ----------------------------------------------------------------------------- cache


def texts_hash(texts: Iterable[str]) -> str:
    """SHA-256 of the texts, each length-prefixed (so no two lists collide by joining)."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def alignment_meta(
    anchor_name: str,
    big_name: str,
    texts: Sequence[str],
    rank: int,
    num_blocks: int,
    seed: int,
    **settings: object,
) -> dict[str, str]:
    """What an alignment depends on: both backbone names, rank, blocks, seed, the texts
    (count and hash) and any fit ``settings`` (method, ridge, ...), as strings."""
    meta = {
        "anchor": anchor_name,
        "big": big_name,
        "rank": rank,
        "num_blocks": num_blocks,
        "seed": seed,
        "num_texts": len(texts),
        "texts_sha256": texts_hash(texts),
        **settings,
    }
    return {key: str(value) for key, value in meta.items()}


def save_alignment(
    path: str | Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]
) -> None:
    """Write ``tensors`` with ``meta`` to a safetensors file (atomically: a temporary file
    renamed into place, so a killed run leaves no half-written cache)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    contiguous = {key: value.contiguous() for key, value in tensors.items()}
    save_file(contiguous, str(tmp), metadata={_META_KEY: json.dumps(dict(meta))})
    os.replace(tmp, path)


def load_alignment(
    path: str | Path, expected_meta: Mapping[str, str]
) -> dict[str, torch.Tensor] | None:
    """The cached tensors, or None when there is no file or its meta differs from
    ``expected_meta`` (a stale cache, to be recomputed). A file that is not a readable
    alignment cache raises :class:`AlignmentCacheError` naming it."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[_META_KEY])
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise AlignmentCacheError(
            f"{path}: not a readable PQ-LoRA alignment cache ({type(err).__name__}: {err}); "
            "delete it to recompute"
        ) from None
    return tensors if meta == dict(expected_meta) else None


def cached(
    path: str | Path, meta: Mapping[str, str], compute: Callable[[], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The alignment cached at ``path`` if its meta is ``meta``, else ``compute()``, saved
    there with ``meta``."""
    tensors = load_alignment(path, meta)
    if tensors is None:
        tensors = compute()
        save_alignment(path, tensors, meta)
    return tensors

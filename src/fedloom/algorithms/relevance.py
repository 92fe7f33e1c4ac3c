"""The math of RELA, FedMosaic's relevance-guided aggregation: pure functions on tensors.

FedMosaic (Seo et al., arXiv 2506.11024; at ICLR 2026 as "Co-LoRA: Collaborative Model
Personalization on Heterogeneous Multi-Modal Clients"; official code
github.com/snumprlab/fedmosaic, RELA in federated_methods/fedmosaic_utils.py and the task
similarity in train_VLM_CL.py) gives every client its own aggregate of the
adapters of the clients whose tasks are relevant to it. Relevance is judged from each
client's *task vector*, a sanitized summary of its gradients.

Task vector of client i, each round (on the client):

    g_i    = the client's gradient matrix, (d_out, d_in): the gradient of the anchor's last
             MLP output projection (fedloom.train.task_vector), as the reference's
             (Llama's last mlp.down_proj, averaged over steps sampled every grad_freq)
    c_i    = compress(g_i)                        project(g_i, rows, cols, seed), or keep_rows
    s_i    = c_i / ||c_i|| + N(0, σ² I)           sanitize: unit norm, then Gaussian noise
    v_i    = β v_i + (1 − β) s_i                  ema (v_i = s_i the first time; β = 1/2)

Relevance and aggregation (on the server), over the known clients K (those that have sent
a task vector and an adapter):

    S_ij   = (1/C) Σ_c cos(v_i[:, c], v_j[:, c])  relevance, mode "columns" (or the cosine
                                                  of the flattened vectors, mode "flat")
    w_ij   = softmax_{j ∈ K, j ≠ i}(S_ij / T)     mixing_weights / relevance_weights
    θ_i    = Σ_{j ∈ K, j ≠ i} w_ij θ_j            personalized_aggregates (all i at once)

Client i's own adapter never enters θ_i. A client that is not known itself (no task
vector yet) gets uniform weights over the known clients.

Privacy of the release: s_i is the Gaussian mechanism applied to c_i / ||c_i||, whose norm
is 1 whatever the client's data, so any change of the data moves it by at most 2 in L2
norm (replacement) and at most 1 relative to a zero vector; the noise std is σ times that
unit sensitivity. The EMA is post-processing. No privacy accounting happens here (the
releases compose over rounds, one per round a client trains; fedloom has no
privacy accountant yet, so the ε of a run is not reported).

Differences from the paper and the official code:

- Compression: the reference keeps the first 40 % of the rows of the gradient
  (:func:`keep_rows`, offered here too; it takes ⌈0.4 d_out⌉ rows where the code takes
  ⌊0.4 d_out⌋). The default here is a seeded two-sided Gaussian random projection
  (:func:`project`), which preserves inner products in expectation and sees every row.
- Sanitization: the reference adds N(0, 10⁻⁸) noise (std 1e-4) to the unscaled gradient
  of every step, with no clipping or norm bound and no accounting, and averages the steps.
  Here the compressed gradient is scaled to norm 1 before noise of a stated multiplier σ
  is added, so σ has a meaning as a Gaussian mechanism.
- Participants: the reference aggregates over all clients' last local states, including
  the never-trained initial adapters of clients that have not been sampled yet (its
  homogeneous-model path: over the clients sampled in the round, with the softmax still
  taken over all). Here only known clients take part, and the softmax runs over them.
- Shapes: the reference shares P and Q of the PQ blocks across architectures, the k-th
  PQ block of one model with the k-th of the other (fedmosaic_utils.py:115-142), and
  every other tensor within an architecture only; FedMosaic maps names the same way
  (:func:`fedloom.algorithms.fedmosaic.pq_keys`, modules also matched by role). Here a
  client whose tensor has another shape than the target's (or lacks it) does not take
  part for that tensor: :func:`personalized_aggregates` renormalizes the weights over
  those that do, as the reference, or gives the others' weight to an ``absent`` value.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Literal

import torch
import torch.nn.functional as F

from fedloom.params import Params


# --- compression -------------------------------------------------------------------------
def _seed_for(seed: int, d_out: int, d_in: int) -> int:
    """A 63-bit generator seed derived from (seed, d_out, d_in), the same on every machine."""
    digest = hashlib.sha256(f"{seed},{d_out},{d_in}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@lru_cache(maxsize=64)
def _projections(
    seed: int, d_out: int, d_in: int, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """R_out (rows, d_out) ~ N(0, 1/rows) and R_in (cols, d_in) ~ N(0, 1/cols), float32 on CPU
    (a CPU generator draws the same numbers on every machine)."""
    generator = torch.Generator().manual_seed(_seed_for(seed, d_out, d_in))
    r_out = torch.randn(rows, d_out, generator=generator) / math.sqrt(rows)
    r_in = torch.randn(cols, d_in, generator=generator) / math.sqrt(cols)
    return r_out, r_in


def project(grad: torch.Tensor, rows: int, cols: int, seed: int) -> torch.Tensor:
    """R_out @ grad @ R_in.T, (rows, cols), float32: a two-sided Gaussian random projection of
    the (d_out, d_in) matrix ``grad``, with R_out (rows, d_out) of entries N(0, 1/rows) and
    R_in (cols, d_in) of entries N(0, 1/cols), drawn from a CPU generator seeded with
    (seed, d_out, d_in). Same seed and shape give the same matrices on every client, so
    E[<project(a), project(b)>] = <a, b> (Johnson-Lindenstrauss). The matrices are cached."""
    if grad.dim() != 2:
        raise ValueError(f"project needs a 2-D gradient matrix, got shape {tuple(grad.shape)}")
    if rows < 1 or cols < 1:
        raise ValueError(f"project needs rows, cols >= 1 (got {rows}, {cols})")
    d_out, d_in = grad.shape
    r_out, r_in = _projections(seed, d_out, d_in, rows, cols)
    r_out, r_in = r_out.to(grad.device), r_in.to(grad.device)
    return r_out @ grad.float() @ r_in.T


def keep_rows(grad: torch.Tensor, fraction: float) -> torch.Tensor:
    """The first ⌈fraction · d_out⌉ rows of ``grad`` (the reference's compression, fraction
    0.4), 0 < fraction <= 1."""
    if not 0 < fraction <= 1:
        raise ValueError(f"keep_rows needs 0 < fraction <= 1 (got {fraction})")
    # rounded first so that e.g. 0.7 * 10 = 7.000000000000001 keeps 7 rows, not 8
    kept = math.ceil(round(fraction * grad.shape[0], 9))
    return grad[:kept]


# --- sanitization --------------------------------------------------------------------------
def sanitize(
    vector: torch.Tensor, noise_multiplier: float, generator: torch.Generator
) -> torch.Tensor:
    """vector / ||vector|| + N(0, noise_multiplier²) per entry, float32 (a zero vector stays
    zero before the noise). The scaled vector has norm 1 whatever the data, so the release
    has L2 sensitivity <= 2 under replacement of the data and 1 relative to a zero vector:
    this is the Gaussian mechanism with noise ``noise_multiplier`` times the unit bound.
    The noise is drawn from ``generator`` on its device."""
    if noise_multiplier < 0:
        raise ValueError(f"sanitize needs noise_multiplier >= 0 (got {noise_multiplier})")
    vector = vector.float()
    norm = torch.linalg.vector_norm(vector)
    scaled = vector / norm if norm > 0 else torch.zeros_like(vector)
    if noise_multiplier == 0:
        return scaled
    noise = torch.randn(vector.shape, generator=generator, device=generator.device)
    return scaled + noise_multiplier * noise.to(vector.device)


def ema(previous: torch.Tensor | None, current: torch.Tensor, decay: float = 0.5) -> torch.Tensor:
    """decay · previous + (1 − decay) · current; ``current`` when there is no previous value
    (the reference's (new + old) / 2 is decay 0.5)."""
    if not 0 <= decay <= 1:
        raise ValueError(f"ema needs 0 <= decay <= 1 (got {decay})")
    if previous is None:
        return current
    if previous.shape != current.shape:
        raise ValueError(f"ema of shapes {tuple(previous.shape)} and {tuple(current.shape)}")
    return decay * previous + (1 - decay) * current


# --- relevance and weights -----------------------------------------------------------------
def relevance(
    vectors: Sequence[torch.Tensor], mode: Literal["columns", "flat"] = "columns"
) -> torch.Tensor:
    """(n, n) float64 similarity S of n task vectors of the same shape.

    "columns": S_ij = (1/C) Σ_c cos(v_i[:, c], v_j[:, c]) over the C columns of the (rows, C)
    vectors (the reference's rule; a zero column contributes cosine 0, so S_ii is the
    fraction of nonzero columns of v_i). "flat": S_ij = cos(vec v_i, vec v_j) (0 when either
    is zero). S is symmetric; S_ii = 1 for a vector without zero columns ("columns") or any
    nonzero vector ("flat")."""
    if not vectors:
        raise ValueError("relevance of no task vectors")
    shapes = {tuple(v.shape) for v in vectors}
    if len(shapes) != 1:
        raise ValueError(f"task vectors of different shapes: {sorted(shapes)}")
    stacked = torch.stack([v.double() for v in vectors])
    if mode == "columns":
        if stacked.dim() != 3:
            raise ValueError(f"mode 'columns' needs (rows, cols) task vectors, got {shapes.pop()}")
        unit = F.normalize(stacked, dim=1)
        similarity = torch.einsum("irc,jrc->ij", unit, unit) / stacked.shape[2]
    elif mode == "flat":
        unit = F.normalize(stacked.flatten(1), dim=1)
        similarity = unit @ unit.T
    else:
        raise ValueError(f"relevance mode must be 'columns' or 'flat' (got {mode!r})")
    return (similarity + similarity.T) / 2


def mixing_weights(
    similarity_row: torch.Tensor,
    self_index: int | None,
    temperature: float,
    eligible: torch.Tensor | None = None,
) -> torch.Tensor:
    """w_j = softmax_j(S_ij / T) over the j ≠ ``self_index`` with ``eligible[j]``, 0 elsewhere
    (float64, sums to 1). ValueError when no j is eligible."""
    if temperature <= 0:
        raise ValueError(f"mixing_weights needs temperature > 0 (got {temperature})")
    mask = (
        torch.ones(similarity_row.shape, dtype=torch.bool)
        if eligible is None
        else eligible.to(dtype=torch.bool, device="cpu").clone()
    )
    if mask.shape != similarity_row.shape:
        raise ValueError(
            f"eligible mask {tuple(mask.shape)} for a row {tuple(similarity_row.shape)}"
        )
    if self_index is not None:
        mask[self_index] = False
    if not mask.any():
        raise ValueError("mixing_weights: no eligible client besides the target")
    logits = similarity_row.detach().double().cpu() / temperature
    return torch.softmax(logits.masked_fill(~mask, -math.inf), dim=0)


def relevance_weights(
    similarity: torch.Tensor, clients: Sequence[int], temperature: float, known: Mapping[int, bool]
) -> dict[int, dict[int, float]]:
    """Each client's weights over the others: {i: {j: w_ij}} for i in ``clients``, the row and
    column order of ``similarity``. A known client (``known[i]``: it has sent a task vector
    and an adapter) weights the known others by :func:`mixing_weights` of its row; a client
    not known itself weights them uniformly. Unknown clients get no weight (a missing key
    counts as unknown); a client without known others gets an empty mapping."""
    n = len(clients)
    if similarity.shape != (n, n):
        raise ValueError(f"similarity {tuple(similarity.shape)} for {n} clients")
    is_known = torch.tensor([bool(known.get(c, False)) for c in clients], dtype=torch.bool)
    weights: dict[int, dict[int, float]] = {}
    for index, client in enumerate(clients):
        others = [j for j in range(n) if j != index and is_known[j]]
        if not others:
            weights[client] = {}
        elif is_known[index]:
            row = mixing_weights(similarity[index], index, temperature, is_known)
            weights[client] = {clients[j]: float(row[j]) for j in others}
        else:
            weights[client] = {clients[j]: 1 / len(others) for j in others}
    return weights


# --- the personalized aggregate ----------------------------------------------------------
def personalized_aggregates(
    client_params: Mapping[int, Params],
    weights: Mapping[int, Mapping[int, float]],
    shapes: Mapping[str, torch.Size],
    absent: Params | None = None,
) -> dict[int, Params]:
    """Every target i of ``weights`` (its weights {j: w_ij} over the others) gets
    θ_i[name] = Σ_j w_ij θ_j[name] / Σ_j w_ij over the j ≠ i with a positive weight whose
    tensor ``name`` has shape ``shapes[name]`` (the weights renormalized over those that
    take part); names nobody else qualifies for are left out of θ_i. The target's own
    tensors never enter; ValueError when a target gives itself a nonzero weight or any
    weight is negative.

    With ``absent`` (a value for every name of ``shapes``) nothing is renormalized: the
    weight of the clients that lack the tensor goes to ``absent[name]``,
    θ_i[name] = Σ_{j has it} w_ij θ_j[name] + (Σ_{j lacks it} w_ij) absent[name],
    with the weights first scaled to sum to 1 over all of i's others.

    All targets at once, one matrix product per name: the tensors of the clients that
    have it are stacked once (C x numel, float32) and W (targets x C, row i the weights
    above, 0 in i's own column) times them gives every θ_i[name], so each client's memory
    is read once for all targets instead of once per target. A zero weight times a
    target's own tensor is an exact 0 only for finite values: ValueError on a non-finite
    tensor (the runtime rejects those updates before they reach the server state).
    Returned in the dtype of the first client (by id) that has the tensor."""
    for target, row in weights.items():
        if row.get(target, 0.0) != 0:
            raise ValueError(f"weights give the target client {target} weight {row[target]}")
        negative = {j: w for j, w in row.items() if w < 0}
        if negative:
            raise ValueError(f"negative aggregation weights: {negative}")
    targets = list(weights)
    result: dict[int, Params] = {t: {} for t in targets}
    for name, shape in shapes.items():
        shape = torch.Size(shape)
        have = [
            j
            for j in sorted(client_params)
            if name in client_params[j] and client_params[j][name].shape == shape
        ]
        matrix = torch.tensor(
            [[weights[t].get(j, 0.0) for j in have] for t in targets], dtype=torch.float64
        ).reshape(len(targets), len(have))
        taking_part = matrix > 0
        rows = taking_part.any(dim=1)
        if not rows.any():
            continue
        if absent is None:
            totals = matrix.sum(dim=1)
        else:
            totals = torch.tensor(
                [math.fsum(weights[t].values()) for t in targets], dtype=torch.float64
            )
        matrix = matrix[rows] / totals[rows, None]
        first = client_params[have[0]][name]
        stacked = torch.stack(
            [client_params[j][name].to(first.device, torch.float32).reshape(-1) for j in have]
        )
        if not torch.isfinite(stacked).all():
            raise ValueError(f"personalized_aggregates: a non-finite value in {name!r}")
        mixed = matrix.float().to(first.device) @ stacked
        if absent is not None:
            missing = (1.0 - matrix.sum(dim=1)).clamp_min(0.0).float().to(first.device)
            mixed += missing[:, None] * absent[name].to(first.device, torch.float32).reshape(1, -1)
        for index, target in enumerate(t for t, keep in zip(targets, rows.tolist()) if keep):
            result[target][name] = mixed[index].reshape(shape).to(first.dtype)
    return result


# --- diagnostics ---------------------------------------------------------------------------
def own_group_share(
    weights: Mapping[int, Mapping[int, float]], groups: Mapping[int, int]
) -> dict[str, float]:
    """ "own_share": the mean over clients i of the share of i's weight mass on others j with
    groups[j] == groups[i]; "uniform_share": the same under uniform weights over i's
    candidates (the keys of weights[i]), i.e. the mean of #same-group / #candidates. Clients
    without candidates or weight mass are left out; empty when none remains."""
    own: list[float] = []
    uniform: list[float] = []
    for i, row in weights.items():
        mass = math.fsum(row.values())
        if mass <= 0:
            continue
        same = [j for j in row if groups[j] == groups[i]]
        own.append(math.fsum(row[j] for j in same) / mass)
        uniform.append(len(same) / len(row))
    if not own:
        return {}
    return {"own_share": sum(own) / len(own), "uniform_share": sum(uniform) / len(uniform)}


def within_minus_cross(
    similarity: torch.Tensor, clients: Sequence[int], groups: Mapping[int, int]
) -> float | None:
    """Mean S_ij over pairs i ≠ j in the same group minus the mean over pairs in different
    groups (``clients`` gives the row order of S); None when either set of pairs is empty."""
    n = len(clients)
    if similarity.shape != (n, n):
        raise ValueError(f"similarity {tuple(similarity.shape)} for {n} clients")
    label = torch.tensor([groups[c] for c in clients])
    same = label[:, None] == label[None, :]
    off_diagonal = ~torch.eye(n, dtype=torch.bool)
    within, cross = similarity[same & off_diagonal], similarity[~same]
    if within.numel() == 0 or cross.numel() == 0:
        return None
    return float(within.double().mean() - cross.double().mean())

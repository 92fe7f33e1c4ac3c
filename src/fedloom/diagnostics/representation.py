"""Input-space heterogeneity, read off frozen-backbone embeddings (no training).

Both probes take one (n_k, d) array of example embeddings per client (from
:meth:`fedloom.models.fedmodel.FedModel.embed`).

* **Feature shift** (covariate shift, P_k(x) differs). With μ the mean of all N pooled
  embeddings, V = (1/N) Σ_i ‖x_i − μ‖² their per-example variance (the trace of the
  pooled covariance) and μ_k client k's mean,

      shift_k = ‖μ_k − μ‖² / V.

  The client-size-weighted mean Σ_k (n_k/N) shift_k is the share of the embedding
  variance that client identity explains (between-client / total, in [0, 1]). For
  clients that are random subsets of one pool, E‖μ_k − μ‖² = (V/n_k)(N − n_k)/(N − 1)
  (the variance of a mean sampled without replacement), so shift_k sits near
  :func:`iid_feature_shift` ≈ 1/n_k — close to 0 for clients of useful size.

* **Label consistency** (concept shift, P_k(y | x) differs). For each of client k's
  examples, the share of its k nearest neighbours (cosine distance) that carry its label,
  once among the OTHER clients' examples ("cross") and once among the client's own other
  examples ("within"); each averaged over the client's examples. A client whose labels
  mean something else (e.g. permuted) agrees with itself but not with its neighbours
  elsewhere. Each agreement is compared with its chance level, the agreement of
  neighbours drawn at random — within: Σ_y (n_y/n)(n_y − 1)/(n − 1) over the client's
  label counts n_y; cross: Σ_y p_k(y) q_k(y), q_k the other clients' label mix — and

      gap = (within − within_chance) − (cross − cross_chance).

  Without the chance levels, label skew alone would open a gap wherever the embedding
  hardly separates the classes (a one-label client agrees with itself trivially: on
  MRPC with MiniLM at Dirichlet α = 0.05, within − cross reached 0.8 with no concept
  shift); with balanced labels both chance levels are ≈ the same and the gap is
  ≈ within − cross. Labels must be class ids, not regression targets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def iid_feature_shift(sizes: Sequence[int]) -> np.ndarray:
    """E[shift_k] when the clients are random disjoint subsets of one pool:
    (N − n_k) / (n_k (N − 1)) for each client size n_k."""
    n = np.asarray(sizes, dtype=np.float64)
    total = n.sum()
    if (n < 1).any() or total < 2:
        raise ValueError(
            f"iid_feature_shift: every client needs an example, two in all: {list(sizes)}"
        )
    return (total - n) / (n * (total - 1))


def feature_shift(embeddings_by_client: Mapping[int, np.ndarray]) -> dict:
    """{"per_client": {k: shift_k}, "mean": unweighted mean over clients, "max",
    "iid_mean": the mean of :func:`iid_feature_shift` for these sizes}."""
    if len(embeddings_by_client) < 2:
        raise ValueError("feature_shift needs at least two clients")
    arrays = {c: np.asarray(x, dtype=np.float64) for c, x in embeddings_by_client.items()}
    pooled = np.concatenate(list(arrays.values()))
    mu = pooled.mean(0)
    variance = float(((pooled - mu) ** 2).sum(1).mean())
    per_client = {
        c: float(((x.mean(0) - mu) ** 2).sum() / variance) if variance > 0 else 0.0
        for c, x in arrays.items()
    }
    values = list(per_client.values())
    return {
        "per_client": per_client,
        "mean": float(np.mean(values)),
        "max": max(values),
        "iid_mean": float(iid_feature_shift([len(x) for x in arrays.values()]).mean()),
    }


def _agreement(neighbour_labels: np.ndarray, labels: np.ndarray) -> float:
    """Mean over examples of the share of neighbours with the example's label."""
    return float((neighbour_labels == labels[:, None]).mean())


def _chance(labels: np.ndarray, pool: np.ndarray | None) -> float:
    """Agreement with random neighbours: from the other examples of ``labels`` itself
    (``pool`` None) or from ``pool``."""
    values, counts = np.unique(labels, return_counts=True)
    n = len(labels)
    if pool is None:
        return float((counts * (counts - 1)).sum() / (n * (n - 1)))
    return float(sum(c / n * np.mean(pool == v) for v, c in zip(values, counts, strict=True)))


def label_consistency(
    embeddings_by_client: Mapping[int, np.ndarray],
    labels_by_client: Mapping[int, Sequence[int] | np.ndarray],
    k: int = 5,
) -> dict:
    """{"per_client": {c: {"cross", "within", "cross_chance", "within_chance", "gap"}},
    "max_gap", "mean_gap", "k"} (see the module docstring). Within a client, k is capped
    at n_c − 1; across, at the number of other examples."""
    from sklearn.neighbors import NearestNeighbors  # imported here: slow to import

    if embeddings_by_client.keys() != labels_by_client.keys():
        raise ValueError("label_consistency: embeddings and labels name different clients")
    if len(embeddings_by_client) < 2:
        raise ValueError("label_consistency needs at least two clients")
    if k < 1:
        raise ValueError(f"label_consistency: k must be >= 1 (got {k})")
    x = {c: np.asarray(e, dtype=np.float64) for c, e in embeddings_by_client.items()}
    y = {c: np.asarray(labels_by_client[c]) for c in x}
    for c, own in x.items():
        if len(own) != len(y[c]) or len(own) < 2:
            raise ValueError(
                f"label_consistency: client {c} has {len(own)} embeddings and {len(y[c])} "
                "labels (needs the same number, at least 2)"
            )
    per_client: dict[int, dict[str, float]] = {}
    for c, own in x.items():
        others = [o for o in x if o != c]
        foreign_x = np.concatenate([x[o] for o in others])
        foreign_y = np.concatenate([y[o] for o in others])
        cross_nn = NearestNeighbors(n_neighbors=min(k, len(foreign_x)), metric="cosine")
        cross_idx = cross_nn.fit(foreign_x).kneighbors(own, return_distance=False)
        own_nn = NearestNeighbors(n_neighbors=min(k, len(own) - 1), metric="cosine")
        own_idx = own_nn.fit(own).kneighbors(return_distance=False)  # excludes itself
        cross = _agreement(foreign_y[cross_idx], y[c])
        within = _agreement(y[c][own_idx], y[c])
        cross_chance, within_chance = _chance(y[c], foreign_y), _chance(y[c], None)
        per_client[c] = {
            "cross": cross,
            "within": within,
            "cross_chance": cross_chance,
            "within_chance": within_chance,
            "gap": (within - within_chance) - (cross - cross_chance),
        }
    gaps = [v["gap"] for v in per_client.values()]
    return {
        "per_client": per_client,
        "max_gap": max(gaps),
        "mean_gap": float(np.mean(gaps)),
        "k": k,
    }

"""From heterogeneity measurements to a recommendation of federated methods.

:func:`advise` applies one rule per kind of heterogeneity to a :class:`Measures`; every
rule that fires adds a :class:`Finding` that quotes the numbers that triggered it, and
names methods, each marked available (its ``algorithm.name`` in the
:mod:`fedloom.algorithms` registry) or planned. When no rule fires the federation looks
IID and FedAvg is the one recommendation. Thresholds (module constants):

* **Label skew** — mean Jensen–Shannon divergence (base 2, in [0, 1]) of the clients'
  label distributions to the global label mix. Below ``JS_MODERATE`` = 0.05 the mixes
  differ by a few percent (FedAvg is fine); from 0.05 client optima start to pull
  apart and drift-correcting methods help (FedProx, SCAFFOLD); above ``JS_SEVERE`` = 0.2
  (e.g. Dirichlet α ≲ 0.3 over two labels, or clients missing whole classes) no single
  model serves every client well: give each client an adapter of its own, trained alone
  (``local``), with a shared body (FedPer), Ditto or local fine-tuning. Training alone is
  the bar: on fedloom's label-skew tables (SST-2, Dirichlet 0.1 and 0.3, 12 clients)
  those tie it and none of the methods built for label skew beats it beyond noise, since
  a few federated rounds on label-skewed clients learn weaker features than the pooled
  data would. The finding quotes how many clients hold a single label (their own adapter
  predicts it already).
* **Quantity skew** — coefficient of variation std(n_k)/mean(n_k) of the client sizes
  above ``SIZE_CV`` = 0.5: aggregation must weight by examples, and if local steps
  follow the size (``train.local_epochs``) FedNova removes the objective
  inconsistency of unequal local progress (Wang et al. 2020).
* **Feature skew** — mean feature shift (see :mod:`.representation`) in excess of what
  random clients of these sizes show, above ``FEATURE_SHIFT_EXCESS`` = 0.1 (the
  clients' means are spread by a tenth of the per-example variance): keep
  input-specific parts personal (FedPer: shared body, personal head; FedBN-style local
  normalization).
* **Concept shift** — largest label-consistency gap above ``CONSISTENCY_GAP`` = 0.4 (a
  client's agreement above chance with its own nearest neighbours' labels exceeds that
  with other clients' by 40 points; a client with swapped binary labels scores ≈ 1, the
  others ≈ its share of their neighbours): clients disagree on P(y | x), so one model
  cannot fit them; cluster them (IFCA, CFL) or personalize (Ditto).
* **Distinct client groups** — the client-gradient cosine matrix clusters: the best
  average-linkage clustering into 2..max(2, K/2) groups (on 1 − cosine) has silhouette
  above ``GROUP_SILHOUETTE`` = 0.5 AND mean cosine within groups exceeds that between
  them by ``GROUP_COSINE_GAP`` = 0.2 (the silhouette is scale-free, so without the gap
  it would find "groups" among near-identical gradients) AND, where the gradients'
  minibatch noise was measured, at most ``GROUP_NOISE_SHARE`` = 0.5 of the raw G² is
  noise (otherwise the cosines mostly compare noise; for IID clients the share is ≈ 1):
  clustered FL (IFCA, CFL).
* **Task heterogeneity** — more than one task: multi-task federated learning (MOCHA,
  FedEM) or relevance-guided aggregation (FedMosaic).
* **Gradient disagreement** — B² above ``B2_HIGH`` = 2, i.e. G² > ‖∇F‖²: the clients'
  disagreement outweighs the direction they share, so local steps drift (SCAFFOLD,
  FedProx). B² is the one with the minibatch noise of the gradient estimates removed
  (``b2_debiased``, see :mod:`.gradients`) where that was measured: on a few small
  batches the raw B² of IID clients can be 10. Both are quoted, with G² and the noise
  share. Measure G² and B² at the initial model: near a stationary point ∇F → 0 and
  B² grows without bound even for IID clients.
* **IID** — none of the above: "the federation looks IID", FedAvg (B² near 1 — the
  debiased one where measured, with the raw one beside it — a small G² and the noise
  share are quoted as the evidence when measured).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedloom import algorithms
from fedloom.diagnostics.gradients import Dissimilarity
from fedloom.diagnostics.representation import iid_feature_shift

JS_MODERATE = 0.05
JS_SEVERE = 0.2
SIZE_CV = 0.5
FEATURE_SHIFT_EXCESS = 0.1
CONSISTENCY_GAP = 0.4
GROUP_SILHOUETTE = 0.5
GROUP_COSINE_GAP = 0.2
GROUP_NOISE_SHARE = 0.5
B2_HIGH = 2.0

#: display name -> the name the method has (or will have) in the algorithm registry
METHODS: dict[str, str] = {
    "FedAvg": "fedavg",
    "FedProx": "fedprox",
    "SCAFFOLD": "scaffold",
    "FedNova": "fednova",
    "Ditto": "ditto",
    "pFedMe": "pfedme",
    "local fine-tuning": "fedavg_ft",
    "local training (an adapter of its own, never shared)": "local",
    "FedPer (shared body, personal head)": "fedper",
    "FedBN-style local normalization": "fedbn",
    "IFCA": "ifca",
    "CFL": "cfl",
    "MOCHA": "mocha",
    "FedEM": "fedem",
    "FedMosaic": "fedmosaic",
}


def method(name: str) -> str:
    """``name`` marked with its availability in the registry, e.g.
    "FedProx (available: algorithm.name = 'fedprox')" or
    "FedBN-style local normalization (planned)"."""
    key = METHODS[name]
    if key in algorithms.available():
        return f"{name} (available: algorithm.name = '{key}')"
    return f"{name} (planned)"


@dataclass(frozen=True)
class Measures:
    """What :func:`advise` reads; ``None`` = not measured (its rule is skipped).

    ``sizes`` maps client id -> training examples; ``gradient_cosine`` has its rows and
    columns in the order of ``sizes``' keys; ``task_shares`` maps client id -> {task:
    share of its examples}; ``feature_shift_iid`` is the mean feature shift random
    clients of the embedded sizes would show (``feature_shift(...)["iid_mean"]``; None:
    the embeddings covered every example, so it follows from ``sizes``). ``g2`` and ``b2``
    are the raw (plug-in) G² and B²; ``g2_debiased``, ``b2_debiased`` and ``noise_share``
    are their minibatch-noise-corrected values and the share of the raw G² that is noise
    (:class:`.Dissimilarity`)."""

    num_clients: int
    sizes: Mapping[int, int]
    label_js_mean: float | None = None
    label_js_max: float | None = None
    one_label_clients: int | None = None
    num_tasks: int = 1
    task_shares: Mapping[int, Mapping[str, float]] | None = None
    feature_shift: float | None = None
    feature_shift_iid: float | None = None
    consistency_gap_max: float | None = None
    consistency_gap_mean: float | None = None
    g2: float | None = None
    b2: float | None = None
    g2_debiased: float | None = None
    b2_debiased: float | None = None
    noise_share: float | None = None
    gradient_cosine: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.num_clients != len(self.sizes) or self.num_clients < 1:
            raise ValueError(f"Measures: num_clients {self.num_clients} != {len(self.sizes)} sizes")
        if min(self.sizes.values()) < 1:
            raise ValueError(f"Measures: every client needs examples: {dict(self.sizes)}")
        k = self.num_clients
        if self.gradient_cosine is not None and np.shape(self.gradient_cosine) != (k, k):
            raise ValueError(
                f"Measures: gradient_cosine is {np.shape(self.gradient_cosine)}, expected {(k, k)}"
            )

    @classmethod
    def from_stats(
        cls,
        stats: Mapping[str, Any],
        gradient: Dissimilarity | None = None,
        feature: Mapping[str, Any] | None = None,
        consistency: Mapping[str, Any] | None = None,
    ) -> Measures:
        """Measures from partition statistics (``stats["clients"]``: ``client_id``,
        ``train``, ``js_to_global``, optional ``task_counts``; ``mean_js_to_global``) and
        the results of :func:`.gradient_dissimilarity`, :func:`.feature_shift` and
        :func:`.label_consistency`. Clients without training examples are left out; the
        gradient cosine matrix is reordered to the clients' order here."""
        clients = [c for c in stats["clients"] if c["train"] > 0]
        sizes = {int(c["client_id"]): int(c["train"]) for c in clients}
        cosine = None
        if gradient is not None:
            if set(gradient.clients) != set(sizes):
                raise ValueError(
                    f"Measures: gradients of clients {sorted(gradient.clients)}, "
                    f"partition clients with data {sorted(sizes)}"
                )
            index = [gradient.clients.index(c) for c in sizes]
            cosine = gradient.cosine[np.ix_(index, index)]
        tasks = [{t: n for t, n in (c.get("task_counts") or {}).items() if n > 0} for c in clients]
        task_names = {t for counts in tasks for t in counts}
        shares = {
            cid: {t: n / sum(counts.values()) for t, n in counts.items()}
            for cid, counts in zip(sizes, tasks, strict=True)
            if counts
        }
        return cls(
            num_clients=len(sizes),
            sizes=sizes,
            label_js_mean=float(stats["mean_js_to_global"]),
            label_js_max=max(float(c["js_to_global"]) for c in clients),
            one_label_clients=_one_label_clients(clients),
            num_tasks=max(1, len(task_names)),
            task_shares=shares or None,
            feature_shift=None if feature is None else float(feature["mean"]),
            feature_shift_iid=None if feature is None else float(feature["iid_mean"]),
            consistency_gap_max=None if consistency is None else float(consistency["max_gap"]),
            consistency_gap_mean=None if consistency is None else float(consistency["mean_gap"]),
            g2=None if gradient is None else gradient.g2,
            b2=None if gradient is None else gradient.b2,
            g2_debiased=None if gradient is None else gradient.g2_debiased,
            b2_debiased=None if gradient is None else gradient.b2_debiased,
            noise_share=None if gradient is None else gradient.noise_share,
            gradient_cosine=cosine,
        )


@dataclass(frozen=True)
class Finding:
    kind: str
    message: str
    evidence: Mapping[str, float]
    recommendations: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "evidence": {k: _json_number(v) for k, v in self.evidence.items()},
            "recommendations": list(self.recommendations),
        }


@dataclass(frozen=True)
class Advice:
    findings: list[Finding] = field(default_factory=list)
    recommendations: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "findings": [f.to_dict() for f in self.findings],
            "recommendations": list(self.recommendations),
        }

    def render(self) -> str:
        lines = ["Findings:"]
        for f in self.findings:
            lines.append(f"- {f.message}")
            lines.extend(f"    -> {r}" for r in f.recommendations)
        lines.append("Recommended:")
        lines.extend(f"- {r}" for r in self.recommendations)
        return "\n".join(lines)


def _one_label_clients(clients: list[Mapping[str, Any]]) -> int | None:
    """How many of ``clients`` train on a single class (None: label counts not recorded,
    e.g. a regression task)."""
    counts: list[list[int]] = []
    for client in clients:
        labels = client.get("label_counts")
        if labels is None:
            return None
        counts.append(labels)
    return sum(sum(n > 0 for n in c) == 1 for c in counts)


def _json_number(x: float) -> float | None:
    """JSON has no infinity or NaN: those become null."""
    return float(x) if math.isfinite(x) else None


def _label_skew(m: Measures) -> Finding | None:
    js = m.label_js_mean
    if js is None or js < JS_MODERATE:
        return None
    tail = "" if m.label_js_max is None else f"; max {m.label_js_max:.3g}"
    evidence = {"label_js_mean": js}
    if m.label_js_max is not None:
        evidence["label_js_max"] = m.label_js_max
    if js > JS_SEVERE:
        single = m.one_label_clients
        if single is not None:
            evidence["one_label_clients"] = single
            tail += f"; {single} of {m.num_clients} clients hold one label"
        return Finding(
            "label_skew",
            f"label skew: mean JS to the global label mix {js:.3g} (severe > {JS_SEVERE}{tail})",
            evidence,
            (
                method("local training (an adapter of its own, never shared)"),
                method("FedPer (shared body, personal head)"),
                method("Ditto"),
                method("local fine-tuning"),
            ),
        )
    return Finding(
        "label_skew",
        f"label skew: mean JS to the global label mix {js:.3g} "
        f"(moderate {JS_MODERATE}-{JS_SEVERE}{tail})",
        evidence,
        (method("FedProx"), method("SCAFFOLD")),
    )


def _quantity_skew(m: Measures) -> Finding | None:
    sizes = np.asarray(list(m.sizes.values()), dtype=np.float64)
    cv = float(sizes.std() / sizes.mean())
    if cv <= SIZE_CV:
        return None
    return Finding(
        "quantity_skew",
        f"quantity skew: client sizes {int(sizes.min())}-{int(sizes.max())}, "
        f"coefficient of variation {cv:.3g} (> {SIZE_CV})",
        {"size_cv": cv},
        (
            (
                "weight aggregation by examples (available: algorithm.weighting = 'examples', "
                "FedAvg's default)"
            ),
            f"{method('FedNova')} if local steps differ (train.local_epochs with unequal sizes)",
        ),
    )


def _feature_skew(m: Measures) -> Finding | None:
    if m.feature_shift is None:
        return None
    expected = m.feature_shift_iid
    if expected is None:
        expected = float(iid_feature_shift(list(m.sizes.values())).mean())
    excess = m.feature_shift - expected
    if excess <= FEATURE_SHIFT_EXCESS:
        return None
    return Finding(
        "feature_skew",
        f"feature skew: mean feature shift {m.feature_shift:.3g} vs {expected:.3g} expected "
        f"for random clients of these sizes (excess {excess:.3g} > {FEATURE_SHIFT_EXCESS})",
        {"feature_shift": m.feature_shift, "iid_feature_shift": expected},
        (method("FedPer (shared body, personal head)"), method("FedBN-style local normalization")),
    )


def _concept_shift(m: Measures) -> Finding | None:
    gap = m.consistency_gap_max
    if gap is None or gap <= CONSISTENCY_GAP:
        return None
    tail = "" if m.consistency_gap_mean is None else f"; mean {m.consistency_gap_mean:.3g}"
    evidence = {"consistency_gap_max": gap}
    if m.consistency_gap_mean is not None:
        evidence["consistency_gap_mean"] = m.consistency_gap_mean
    return Finding(
        "concept_shift",
        f"concept shift: label-consistency gap up to {gap:.3g} (> {CONSISTENCY_GAP}{tail}): "
        "some clients label similar inputs differently",
        evidence,
        (method("IFCA"), method("CFL"), method("Ditto")),
    )


def client_groups(cosine: np.ndarray) -> tuple[np.ndarray, float, float] | None:
    """The best average-linkage clustering of the clients on 1 − cosine into
    2..max(2, K/2) groups: (group label per client, silhouette, mean cosine within groups
    − mean cosine between them); ``None`` for fewer than 3 clients."""
    # imported here: scikit-learn took about a second of every run's start-up
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform
    from sklearn.metrics import silhouette_score

    k = len(cosine)
    if k < 3:
        return None
    distance = np.clip(1.0 - (cosine + cosine.T) / 2, 0.0, None)
    np.fill_diagonal(distance, 0.0)
    tree = linkage(squareform(distance, checks=False), method="average")
    best: tuple[np.ndarray, float] | None = None
    for groups in range(2, max(2, k // 2) + 1):
        labels = fcluster(tree, groups, criterion="maxclust")
        if not 2 <= len(set(labels)) < k:
            continue
        score = float(silhouette_score(distance, labels, metric="precomputed"))
        if best is None or score > best[1]:
            best = (labels, score)
    if best is None:
        return None
    labels, score = best
    same = labels[:, None] == labels[None, :]
    off_diagonal = ~np.eye(k, dtype=bool)
    gap = float(cosine[same & off_diagonal].mean() - cosine[~same].mean())
    return labels, score, gap


def _client_groups(m: Measures) -> Finding | None:
    if m.gradient_cosine is None:
        return None
    if m.noise_share is not None and m.noise_share > GROUP_NOISE_SHARE:
        return None
    found = client_groups(np.asarray(m.gradient_cosine, dtype=np.float64))
    if found is None:
        return None
    labels, score, gap = found
    if score <= GROUP_SILHOUETTE or gap <= GROUP_COSINE_GAP:
        return None
    ids = list(m.sizes)
    groups = [[ids[i] for i in np.flatnonzero(labels == g)] for g in sorted(set(labels))]
    evidence = {"silhouette": score, "cosine_gap": gap, "num_groups": float(len(groups))}
    noise = ""
    if m.noise_share is not None:
        noise = f"; noise share of G² {m.noise_share:.3g} <= {GROUP_NOISE_SHARE}"
        evidence["noise_share"] = m.noise_share
    cause = ""
    if m.label_js_mean is not None and m.label_js_mean < JS_MODERATE:
        # alike label mixes cannot explain opposed gradients: the clients map inputs to
        # labels differently (concept shift) or see different inputs (feature shift)
        cause = (
            f"; label mixes are alike (mean JS {m.label_js_mean:.3g} < "
            f"{JS_MODERATE}), so the groups disagree on P(Y|X) or P(X)"
        )
    return Finding(
        "client_groups",
        f"distinct client groups: client gradients form {len(groups)} groups {groups} "
        f"(silhouette {score:.3g} > {GROUP_SILHOUETTE}; cosine within - between "
        f"{gap:.3g} > {GROUP_COSINE_GAP}{noise}){cause}",
        evidence,
        (method("IFCA"), method("CFL")),
    )


def _tasks(m: Measures) -> Finding | None:
    if m.num_tasks <= 1:
        return None
    message = f"task heterogeneity: {m.num_tasks} tasks over {m.num_clients} clients"
    evidence = {"num_tasks": float(m.num_tasks)}
    if m.task_shares:
        dominant = float(np.mean([max(s.values()) for s in m.task_shares.values()]))
        message += f" (mean share of a client's main task {dominant:.3g})"
        evidence["dominant_task_share"] = dominant
    return Finding(
        "task_heterogeneity",
        message,
        evidence,
        (method("MOCHA"), method("FedEM"), method("FedMosaic")),
    )


def _b2(m: Measures) -> float | None:
    """The B² the gradient rules judge: without minibatch noise where that was measured."""
    return m.b2 if m.b2_debiased is None else m.b2_debiased


def _b2_quote(m: Measures, threshold: str) -> str:
    """'B² x (threshold)', x the debiased B² (the raw one beside it) where measured."""
    if m.b2_debiased is None:
        return f"B² {m.b2:.3g} ({threshold})"
    raw = "" if m.b2 is None else f"; raw B² {m.b2:.3g}"
    return f"B² {m.b2_debiased:.3g} without minibatch noise ({threshold}{raw})"


def _g2_quotes(m: Measures) -> list[str]:
    """G² (the debiased one, the raw one beside it, where measured) and the noise share."""
    parts = []
    if m.g2_debiased is not None:
        raw = "" if m.g2 is None else f" (raw {m.g2:.3g})"
        parts.append(f"G² {m.g2_debiased:.3g} without minibatch noise{raw}")
    elif m.g2 is not None:
        parts.append(f"G² {m.g2:.3g}")
    if m.noise_share is not None:
        parts.append(f"noise share of G² {m.noise_share:.3g}")
    return parts


def _gradient_evidence(m: Measures) -> dict[str, float]:
    """The measured gradient numbers, raw and debiased, for a finding's evidence."""
    values = {
        "b2": m.b2,
        "b2_debiased": m.b2_debiased,
        "g2": m.g2,
        "g2_debiased": m.g2_debiased,
        "noise_share": m.noise_share,
    }
    return {k: v for k, v in values.items() if v is not None}


def _gradient_disagreement(m: Measures) -> Finding | None:
    b2 = _b2(m)
    if b2 is None or b2 <= B2_HIGH:
        return None
    parts = [_b2_quote(m, f"> {B2_HIGH}: G² exceeds ‖∇F‖²"), *_g2_quotes(m)]
    return Finding(
        "gradient_disagreement",
        "client gradients disagree: " + "; ".join(parts),
        _gradient_evidence(m),
        (method("SCAFFOLD"), method("FedProx")),
    )


RULES = (
    _label_skew,
    _quantity_skew,
    _feature_skew,
    _concept_shift,
    _client_groups,
    _tasks,
    _gradient_disagreement,
)


def _iid(m: Measures) -> Finding:
    quoted: dict[str, float] = {}
    parts = []
    if m.label_js_mean is not None:
        parts.append(f"mean label JS {m.label_js_mean:.3g} (< {JS_MODERATE})")
        quoted["label_js_mean"] = m.label_js_mean
    if _b2(m) is not None:
        parts.append(_b2_quote(m, f"near 1, <= {B2_HIGH}"))
    parts.extend(_g2_quotes(m))
    quoted.update(_gradient_evidence(m))
    evidence = "; ".join(parts) or "no heterogeneity rule fired"
    return Finding("iid", f"federation looks IID: {evidence}", quoted, (method("FedAvg"),))


def advise(measures: Measures) -> Advice:
    """Findings from every rule that fires (see the module docstring) and the union of
    their recommendations in order; FedAvg alone when none fires."""
    findings = [f for rule in RULES if (f := rule(measures)) is not None]
    if not findings:
        findings = [_iid(measures)]
    recommendations = list(dict.fromkeys(r for f in findings for r in f.recommendations))
    return Advice(findings, recommendations)

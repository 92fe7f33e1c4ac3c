"""Each non-IID skew produces what it promises: label shards, quantity laws, natural feature
partitions, concept shift, task heterogeneity and temporal drift."""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedloom.config import (
    ConceptConfig,
    ConfigError,
    PartitionConfig,
    QuantityConfig,
    TasksConfig,
    TemporalConfig,
    to_toml_dict,
    validate,
)
from fedloom.data import (
    ClientSplit,
    Drift,
    PartitionPool,
    client_label_counts,
    get_task,
    label_histogram,
    load_glue,
    make_clients,
)
from fedloom.data.partition import draw_sizes, js_to_global


def pool_of(labels: np.ndarray, **columns: np.ndarray) -> PartitionPool:
    labels = np.asarray(labels)
    lengths = np.random.default_rng(99).integers(3, 60, size=len(labels))
    return PartitionPool(labels=labels, columns=columns, lengths=lengths)


def held(split: ClientSplit) -> np.ndarray:
    return np.concatenate([split.train, split.test])


def sizes_of(splits: list[ClientSplit]) -> np.ndarray:
    return np.array([len(held(s)) for s in splits])


def assert_exact_cover(splits: list[ClientSplit], n: int) -> None:
    every = np.concatenate([held(s) for s in splits])
    assert len(every) == n and np.array_equal(np.sort(every), np.arange(n))


TEN_LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 400))
BINARY = np.random.default_rng(0).permutation(np.array([0] * 1194 + [1] * 2474))


@functools.cache
def load_stsb(glue_dir: Path) -> PartitionPool:
    return PartitionPool.from_examples(load_glue(get_task("STS-B"), "train", glue_dir))


@pytest.fixture
def stsb(glue_dir: Path) -> PartitionPool:
    """The real STS-B training pool (scores and genre/source metadata), loaded once."""
    return load_stsb(glue_dir)


# --- shards ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("labels", "num_labels", "k", "num_clients"),
    [
        (TEN_LABELS, 10, 1, 10),
        (TEN_LABELS, 10, 2, 10),
        (TEN_LABELS, 10, 3, 12),
        (BINARY, 2, 1, 5),
        (BINARY, 2, 2, 5),
    ],
)
def test_shards_give_exactly_k_labels(labels, num_labels, k, num_clients) -> None:
    cfg = PartitionConfig(scheme="shards", num_clients=num_clients, shards_per_client=k)
    splits = make_clients(pool_of(labels), cfg, seed=1)
    assert_exact_cover(splits, len(labels))
    holders = np.zeros(num_labels, dtype=int)
    for split in splits:
        seen = np.unique(labels[held(split)])
        assert len(seen) == k
        holders[seen] += 1
    expected = num_clients * k / num_labels  # balanced: every label used by ≈ K·k/L clients
    assert holders.min() >= math.floor(expected) and holders.max() <= math.ceil(expected)
    # Each label is split evenly among its holders.
    for label in range(num_labels):
        shares = [np.sum(labels[held(s)] == label) for s in splits]
        shares = [x for x in shares if x]
        assert max(shares) - min(shares) <= 1


def test_shards_with_quantity_keep_k_labels_and_follow_sizes() -> None:
    labels = np.random.default_rng(2).integers(0, 10, size=30000)
    law = QuantityConfig(sigma=1.0)
    cfg = PartitionConfig(scheme="shards", num_clients=60, shards_per_client=3, quantity=law)
    splits = make_clients(pool_of(labels), cfg, seed=5)
    assert_exact_cover(splits, len(labels))
    assert all(len(np.unique(labels[held(s)])) == 3 for s in splits)
    # The sizes drawn first (the first draw of the seed's stream) are followed closely.
    target = draw_sizes(len(labels), 60, law, cfg.min_size, np.random.default_rng(5))
    got = sizes_of(splits)
    assert np.corrcoef(np.log(target), np.log(got))[0, 1] > 0.9
    assert got.max() / got.min() > 10


def test_shards_impossible_requests() -> None:
    with pytest.raises(ValueError, match="shards_per_client=3 exceeds the 2 labels"):
        make_clients(pool_of(BINARY), PartitionConfig(scheme="shards", shards_per_client=3), 0)
    cfg = PartitionConfig(scheme="shards", num_clients=3, shards_per_client=2)
    with pytest.raises(ValueError, match="3 clients x shards_per_client=2 cannot cover all 10"):
        make_clients(pool_of(TEN_LABELS), cfg, 0)


# --- quantity ----------------------------------------------------------------------------

BIG = 500_000


@pytest.fixture(scope="module")
def big_pool() -> PartitionPool:
    return PartitionPool(np.zeros(BIG, dtype=np.int64), {}, np.ones(BIG, dtype=np.int64))


@pytest.mark.parametrize("sigma", [0.5, 1.0])
def test_lognormal_sizes_follow_the_law(big_pool: PartitionPool, sigma: float) -> None:
    cfg = PartitionConfig(num_clients=500, quantity=QuantityConfig(law="lognormal", sigma=sigma))
    sizes = sizes_of(make_clients(big_pool, cfg, seed=0))
    assert sizes.sum() == BIG and sizes.min() >= cfg.min_size
    logs = np.log(sizes)
    assert np.std(logs) == pytest.approx(sigma, rel=0.1)
    assert stats.kstest(logs, "norm", args=(logs.mean(), sigma)).pvalue > 0.01


@pytest.mark.parametrize("exponent", [1.5, 2.5])
def test_powerlaw_sizes_follow_the_law(big_pool: PartitionPool, exponent: float) -> None:
    law = QuantityConfig(law="powerlaw", exponent=exponent)
    cfg = PartitionConfig(num_clients=500, quantity=law)
    sizes = sizes_of(make_clients(big_pool, cfg, seed=0)).astype(float)
    assert sizes.sum() == BIG
    # Pareto(exponent) scaled by x_min: the maximum-likelihood tail index (Hill with all
    # points above the minimum) has standard error exponent / sqrt(K).
    x_min = sizes.min()
    tail = len(sizes) / np.sum(np.log(sizes / x_min))
    assert tail == pytest.approx(exponent, abs=4 * exponent / np.sqrt(len(sizes)))
    assert stats.kstest(sizes, "pareto", args=(exponent, 0, x_min)).pvalue > 0.01


def test_realistic_sizes_range_from_tens_to_thousands() -> None:
    # SST-2's 67,349 training sentences over 100 clients, lognormal sigma 1.5.
    sizes = draw_sizes(67349, 100, QuantityConfig(sigma=1.5), 10, np.random.default_rng(0))
    assert sizes.sum() == 67349 and sizes.min() >= 10
    assert sizes.min() < 100 and sizes.max() >= 1000


def test_sizes_floor_at_min_size_and_sum_exactly() -> None:
    for seed in range(20):
        sizes = draw_sizes(1000, 30, QuantityConfig(sigma=3.0), 20, np.random.default_rng(seed))
        assert sizes.sum() == 1000 and sizes.min() >= 20
    with pytest.raises(ValueError, match="min_size=50 is impossible"):
        draw_sizes(1000, 30, QuantityConfig(), 50, np.random.default_rng(0))


def test_iid_quantity_uses_the_drawn_sizes_exactly() -> None:
    law = QuantityConfig(law="powerlaw", exponent=1.2)
    cfg = PartitionConfig(num_clients=40, quantity=law)
    splits = make_clients(pool_of(BINARY), cfg, seed=4)
    target = draw_sizes(len(BINARY), 40, law, cfg.min_size, np.random.default_rng(4))
    assert sizes_of(splits).tolist() == target.tolist()


def test_dirichlet_quantity_sizes_and_skew() -> None:
    labels = TEN_LABELS
    law = QuantityConfig(sigma=0.8)
    skewed = PartitionConfig(scheme="dirichlet", num_clients=30, alpha=1e-3, quantity=law)
    splits = make_clients(pool_of(labels), skewed, seed=2)
    assert_exact_cover(splits, len(labels))
    target = draw_sizes(len(labels), 30, law, skewed.min_size, np.random.default_rng(2))
    assert sizes_of(splits).tolist() == target.tolist()
    counts = np.array([np.bincount(labels[held(s)], minlength=10) for s in splits])
    assert np.median(counts.max(axis=1) / counts.sum(axis=1)) >= 0.95  # near one-hot mixes
    assert js_to_global(counts).mean() > 0.5
    # alpha large: every client's class counts within multinomial noise of the global mix.
    flat = skewed.model_copy(update={"alpha": 1e4})
    counts = np.array(
        [np.bincount(labels[held(s)], minlength=10) for s in make_clients(pool_of(labels), flat, 2)]
    )
    n = counts.sum(axis=1, keepdims=True)
    assert np.all(np.abs(counts - 0.1 * n) <= 6 * np.sqrt(0.09 * n))
    assert js_to_global(counts).mean() < 0.05


# --- feature -----------------------------------------------------------------------------


def test_feature_whole_genres_per_client(stsb: PartitionPool) -> None:
    genre = stsb.columns["genre"]
    # Largest genre first, each to the currently smallest client: 3 clients hold one genre
    # each; with 2, news (3299) stays alone and captions (2000) + forum (450) share.
    for num_clients, sizes in ((3, [450, 2000, 3299]), (2, [2450, 3299])):
        cfg = PartitionConfig(scheme="feature", feature="genre", num_clients=num_clients)
        splits = make_clients(stsb, cfg, seed=0)
        assert_exact_cover(splits, len(stsb))
        owners = [{s.client_id for s in splits if g in set(genre[held(s)])} for g in set(genre)]
        assert all(len(clients) == 1 for clients in owners)  # no genre is cut
        assert sorted(sizes_of(splits).tolist()) == sizes


def test_feature_fewer_genres_than_clients(stsb: PartitionPool) -> None:
    genre = stsb.columns["genre"]
    cfg = PartitionConfig(scheme="feature", feature="genre", num_clients=8)
    splits = make_clients(stsb, cfg, seed=0)
    assert_exact_cover(splits, len(stsb))
    per_client = [set(genre[held(s)]) for s in splits]
    assert all(len(genres) == 1 for genres in per_client)  # each client holds its genre only
    clients_per_genre = Counter(next(iter(g)) for g in per_client)
    # Proportional to the counts 3299 : 2000 : 450, at least one each.
    assert clients_per_genre == {"main-news": 4, "main-captions": 3, "main-forum": 1}
    with pytest.raises(ValueError, match="no metadata column 'topic'.*available: .*genre"):
        make_clients(stsb, cfg.model_copy(update={"feature": "topic"}), seed=0)


def test_feature_length_bands_are_ordered(stsb: PartitionPool) -> None:
    cfg = PartitionConfig(scheme="feature", feature="length", num_clients=5)
    splits = make_clients(stsb, cfg, seed=0)
    assert_exact_cover(splits, len(stsb))
    bands = [stsb.lengths[held(s)] for s in splits]
    for shorter, longer in itertools.pairwise(bands):
        assert shorter.max() <= longer.min()
    assert bands[0].mean() < bands[-1].mean()
    assert sizes_of(splits).max() - sizes_of(splits).min() <= 1


# --- concept -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "num_clients", "expected"),
    [(0.3, 10, 3), (0.25, 10, 3), (0.01, 10, 1), (1.0, 4, 4)],
)
def test_concept_permute(fraction: float, num_clients: int, expected: int) -> None:
    pool = pool_of(TEN_LABELS)
    cfg = PartitionConfig(num_clients=num_clients, concept=ConceptConfig(fraction=fraction))
    splits = make_clients(pool, cfg, seed=3)
    mapped = [s for s in splits if s.label_map is not None]
    assert len(mapped) == expected
    raw = label_histogram(pool.labels, splits, 10)
    seen = client_label_counts(pool, splits, 10)
    for row, split in enumerate(splits):
        if split.label_map is None:
            assert np.array_equal(seen[row], raw[row])
            continue
        assert sorted(split.label_map.tolist()) == list(range(10))
        assert not np.any(split.label_map == np.arange(10))  # a derangement
        moved = np.zeros(10, dtype=int)
        moved[split.label_map] = raw[row]  # class y counted as label_map[y]
        assert np.array_equal(seen[row], moved)


def test_concept_swap() -> None:
    pool = pool_of(np.random.default_rng(0).integers(0, 4, size=2000))
    cfg = PartitionConfig(
        num_clients=6, concept=ConceptConfig(kind="swap", classes=[1, 3], fraction=0.5)
    )
    splits = make_clients(pool, cfg, seed=0)
    assert sum(s.label_map is not None for s in splits) == 3
    raw, seen = label_histogram(pool.labels, splits, 4), client_label_counts(pool, splits, 4)
    for row, split in enumerate(splits):
        if split.label_map is not None:
            assert split.label_map.tolist() == [0, 3, 2, 1]
            assert seen[row].tolist() == raw[row][[0, 3, 2, 1]].tolist()
    default = make_clients(pool, cfg.model_copy(update={"concept": ConceptConfig(kind="swap")}), 0)
    assert next(s.label_map for s in default if s.label_map is not None).tolist() == [1, 0, 2, 3]


def test_concept_fraction_draws_the_same_clients_as_before() -> None:
    """``fraction`` (no ``clients``) chooses as it did before ``clients`` existed: these
    are the clients the earlier code drew for the same seeds."""
    pool = pool_of(np.random.default_rng(0).integers(0, 4, size=2000))
    cfg = PartitionConfig(num_clients=12, concept=ConceptConfig(kind="swap", fraction=0.5))
    for seed, expected in ((0, [0, 3, 5, 7, 8, 11]), (1, [0, 1, 5, 7, 9, 11])):
        splits = make_clients(pool, cfg, seed=seed)
        assert [s.client_id for s in splits if s.label_map is not None] == expected


@pytest.mark.parametrize("kind", ["swap", "permute"])
def test_concept_named_clients_relabel_and_no_others(kind: str) -> None:
    """``clients`` names exactly who relabels, whatever the seed; ``fraction`` resolves to
    None; the other clients keep their labels and their splits are the same as without
    the shift."""
    pool = pool_of(np.random.default_rng(0).integers(0, 4, size=2000))
    concept = ConceptConfig(kind=kind, clients=[0, 1, 2, 3, 8, 9])
    assert concept.fraction is None
    cfg = PartitionConfig(num_clients=12, concept=concept)
    plain = make_clients(pool, cfg.model_copy(update={"concept": None}), seed=0)
    for seed in (0, 5):
        splits = make_clients(pool, cfg, seed=seed)
        assert [s.client_id for s in splits if s.label_map is not None] == [0, 1, 2, 3, 8, 9]
        for split in splits:
            if split.label_map is not None and kind == "swap":
                assert split.label_map.tolist() == [1, 0, 2, 3]
            elif split.label_map is not None:
                assert not np.any(split.label_map == np.arange(4))
    splits = make_clients(pool, cfg, seed=0)
    assert [s.train.tolist() for s in splits] == [s.train.tolist() for s in plain]


def test_concept_named_clients_are_validated() -> None:
    """Ids outside ``0..num_clients-1``, a client named twice, and ``clients`` beside
    ``fraction`` are refused, each with one line naming the key; a resolved config (its
    ``fraction`` dropped) validates again."""
    def raw(concept: dict) -> dict:
        return {"partition": {"num_clients": 12, "concept": {"kind": "swap", **concept}}}

    cases = [
        (
            {"clients": [0, 12]},
            (
                r"^partition\.concept\.clients: \[12\] are not clients of "
                r"partition\.num_clients = 12 \(ids 0\.\.11\)$"
            ),
        ),
        ({"clients": [-1, 3]}, r"^partition\.concept\.clients: \[-1\] are not clients"),
        ({"clients": [3, 3]}, r"^partition\.concept\.clients: \[3, 3\] lists a client twice$"),
        ({"clients": [1], "fraction": 0.3}, r"^partition\.concept\.clients: .* not both$"),
        ({"clients": []}, r"^partition\.concept\.clients: "),
    ]
    for concept, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate(raw(concept))
    cfg = validate(raw({"clients": [0, 8]}))
    assert cfg.partition.concept.clients == [0, 8] and cfg.partition.concept.fraction is None
    written = to_toml_dict(cfg)["partition"]["concept"]
    assert "fraction" not in written
    assert validate(to_toml_dict(cfg)) == cfg
    assert validate(raw({})).partition.concept.fraction == 0.3  # the default, unchanged
    with pytest.raises(ValueError, match=r"concept\.clients: \[7\] are not clients"):
        make_clients(pool_of(BINARY), PartitionConfig(num_clients=4).model_copy(
            update={"concept": ConceptConfig(clients=[7])}), seed=0)


def test_concept_impossible_requests(stsb: PartitionPool) -> None:
    pool = pool_of(BINARY)
    bad = PartitionConfig(concept=ConceptConfig(kind="swap", classes=[0, 2]))
    with pytest.raises(ValueError, match=r"concept.classes must be two different labels in 0..1"):
        make_clients(pool, bad, seed=0)
    with pytest.raises(ValueError, match="concept shift needs class labels"):
        make_clients(stsb, PartitionConfig(concept=ConceptConfig()), seed=0)


def test_concept_permutes_within_each_task() -> None:
    labels = np.random.default_rng(1).integers(0, 6, size=3000)
    pool = pool_of(labels, task=np.where(labels < 2, "MRPC", "OTHER"))
    cfg = PartitionConfig(
        num_clients=4,
        tasks=TasksConfig(names=["MRPC", "OTHER"]),
        concept=ConceptConfig(fraction=1.0),
    )
    for split in make_clients(pool, cfg, seed=0):
        assert split.label_map[:2].tolist() == [1, 0]
        assert sorted(split.label_map[2:].tolist()) == [2, 3, 4, 5]
        assert not np.any(split.label_map == np.arange(6))


# --- tasks -------------------------------------------------------------------------------


def task_pool(n: int = 12000) -> PartitionPool:
    rng = np.random.default_rng(0)
    task = rng.choice(["MRPC", "RTE", "SST-2"], size=n)
    labels = {"MRPC": 0, "RTE": 2, "SST-2": 4}
    return pool_of(np.array([labels[t] for t in task]) + rng.integers(0, 2, size=n), task=task)


@pytest.mark.parametrize("mix", [0.0, 0.2, 0.4])
def test_tasks_primary_task_and_mix(mix: float) -> None:
    pool = task_pool()
    names = ["SST-2", "MRPC", "RTE"]
    cfg = PartitionConfig(
        scheme="dirichlet", alpha=1.0, num_clients=7, tasks=TasksConfig(names=names, mix=mix)
    )
    splits = make_clients(pool, cfg, seed=0)
    assert_exact_cover(splits, len(pool))
    task = pool.columns["task"]
    foreign = 0
    for split in splits:
        counts = Counter(task[held(split)].tolist())
        primary = names[split.client_id % 3]
        assert counts.most_common(1)[0][0] == primary
        foreign += len(held(split)) - counts[primary]
    # Each example moves independently with probability mix: binomial tolerance (5 sd).
    tolerance = 5 * np.sqrt(mix * (1 - mix) / len(pool))
    assert foreign / len(pool) == pytest.approx(mix, abs=tolerance)


def test_tasks_clients_per_task_in_blocks() -> None:
    pool = task_pool()
    names = ["MRPC", "SST-2", "RTE"]
    cfg = PartitionConfig(num_clients=6, tasks=TasksConfig(names=names, clients=[1, 3, 2]))
    splits = make_clients(pool, cfg, seed=0)
    assert_exact_cover(splits, len(pool))
    task = pool.columns["task"]
    held_tasks = [set(task[held(split)].tolist()) for split in splits]
    assert held_tasks == [{"MRPC"}, {"SST-2"}, {"SST-2"}, {"SST-2"}, {"RTE"}, {"RTE"}]
    assert len(held(splits[0])) == (task == "MRPC").sum()  # the one MRPC client holds all


def test_tasks_clients_must_fit() -> None:
    pool = task_pool(3000)
    cfg = PartitionConfig(num_clients=6, tasks=TasksConfig(names=["MRPC", "RTE", "SST-2"],
                                                           clients=[1, 1, 1]))
    with pytest.raises(ValueError, match=r"tasks.clients: \[1, 1, 1\] add up to 3 clients"):
        make_clients(pool, cfg, seed=0)
    with pytest.raises(ValueError, match="2 counts for 3 tasks"):
        TasksConfig(names=["MRPC", "RTE", "SST-2"], clients=[1, 2])
    with pytest.raises(ValueError, match="lists a task twice"):
        TasksConfig(names=["MRPC", "MRPC"])


def test_tasks_impossible_requests() -> None:
    pool = task_pool(3000)
    cfg = PartitionConfig(num_clients=6, tasks=TasksConfig(names=["MRPC", "RTE", "SST-2"]))
    with pytest.raises(ValueError, match="no 'task' column"):
        make_clients(pool_of(BINARY), cfg, seed=0)
    missing = cfg.model_copy(update={"tasks": TasksConfig(names=["MRPC", "CoLA"])})
    with pytest.raises(ValueError, match=r"tasks.names \['CoLA'\] not in the pool"):
        make_clients(pool, missing, seed=0)
    with pytest.raises(ValueError, match="3 tasks need at least 3 clients, got num_clients=2"):
        make_clients(pool, cfg.model_copy(update={"num_clients": 2}), seed=0)
    unnamed = cfg.model_copy(update={"tasks": TasksConfig(names=["MRPC", "RTE"])})
    with pytest.raises(ValueError, match=r"tasks \['SST-2'\] that tasks.names does not list"):
        make_clients(pool, unnamed, seed=0)


# --- temporal ----------------------------------------------------------------------------


def test_drift_share() -> None:
    empty = np.empty(0, dtype=np.int64)
    drift = Drift(empty, empty, start_round=2, end_round=6)
    assert [drift.share(r) for r in range(8)] == [0, 0, 0, 0.25, 0.5, 0.75, 1, 1]
    step = Drift(empty, empty, start_round=3, end_round=3)
    assert [step.share(r) for r in range(5)] == [0, 0, 0, 1, 1]


def test_drift_mixture_is_documented() -> None:
    own, target = np.arange(0, 10), np.arange(100, 107)
    split = ClientSplit(
        0, own, np.array([50, 51]), drift=Drift(target, np.array([60]), 2, 5, seed=9)
    )
    assert np.array_equal(split.train_at(0), own) and np.array_equal(split.train_at(2), own)
    assert np.array_equal(split.train_at(5), target) and np.array_equal(split.train_at(9), target)
    previous_own, previous_target = own, np.empty(0, dtype=np.int64)
    for r in (3, 4):
        t = (r - 2) / 3
        mixed = split.train_at(r)
        kept, came = mixed[mixed < 100], mixed[mixed >= 100]
        assert len(kept) == math.ceil((1 - t) * 10) and len(came) == math.floor(t * 7)
        # One fixed shuffle: who leaves first and who arrives first never changes.
        assert set(kept) <= set(previous_own) and set(previous_target) <= set(came)
        previous_own, previous_target = kept, came
        assert np.array_equal(mixed, split.train_at(r)) and np.all(np.diff(mixed) > 0)
    assert split.test_at(3).tolist() == [50, 51]  # ceil(2/3·2) own + floor(1/3·1) target
    assert len(split.test_at(4)) == 1 and set(split.test_at(4)) <= {50, 51}  # ceil(1/3·2) + 0
    assert split.test_at(5).tolist() == [60]


def test_temporal_clients_drift_to_the_second_partition() -> None:
    pool = pool_of(TEN_LABELS)
    temporal = TemporalConfig(start_round=1, end_round=4, fraction=0.4, scheme="shards")
    cfg = PartitionConfig(scheme="iid", num_clients=10, shards_per_client=1, temporal=temporal)
    splits = make_clients(pool, cfg, seed=0)
    base = make_clients(pool, cfg.model_copy(update={"temporal": None}), seed=0)
    second = make_clients(
        pool, cfg.model_copy(update={"temporal": None, "scheme": "shards"}), seed=1
    )
    drifting = [s for s in splits if s.drift is not None]
    assert len(drifting) == 4
    for split, before, after in zip(splits, base, second):
        assert np.array_equal(split.train, before.train)
        assert np.array_equal(split.train_at(0), before.train)
        if split.drift is None:
            assert np.array_equal(split.train_at(10), before.train)
            continue
        # the second partition's part, re-split by the first partition's test membership
        target = np.sort(held(after))
        in_a_test = np.isin(target, np.concatenate([s.test for s in base]))
        assert np.array_equal(split.drift.target_train, target[~in_a_test])
        assert np.array_equal(split.train_at(4), target[~in_a_test])
        assert np.array_equal(split.test_at(4), target[in_a_test])
        assert (split.drift.start_round, split.drift.end_round) == (1, 4)
    # Seen at the end, the drifted clients hold one label each (shards_per_client = 1).
    counts = client_label_counts(pool, splits, 10, round_=4)
    for split in drifting:
        assert np.count_nonzero(counts[split.client_id]) == 1
    assert all(np.count_nonzero(row) == 10 for row in client_label_counts(pool, splits, 10))


def test_temporal_second_partition_errors_name_it() -> None:
    temporal = TemporalConfig(start_round=0, end_round=1, scheme="shards", shards_per_client=3)
    cfg = PartitionConfig(num_clients=4, temporal=temporal)
    with pytest.raises(ValueError, match="temporal: the second partition: shards_per_client=3"):
        make_clients(pool_of(BINARY), cfg, seed=0)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards"])
def test_temporal_drift_never_trains_on_a_held_out_example(scheme: str) -> None:
    """For every round and every client, what it trains on is no client's test split at any
    round (a drift target drawn from the whole pool used to hand clients other clients' test
    examples), and every test split stays out of every training split."""
    pool = pool_of(TEN_LABELS[:1200])
    temporal = TemporalConfig(start_round=1, end_round=5, fraction=1.0, scheme=scheme)
    cfg = PartitionConfig(scheme="iid", num_clients=8, shards_per_client=2, alpha=0.3,
                          test_fraction=0.25, temporal=temporal)
    splits = make_clients(pool, cfg, seed=0)
    rounds = range(7)
    held_out = set(np.concatenate([s.test_at(r) for s in splits for r in rounds]).tolist())
    for split in splits:
        for r in rounds:
            leaked = held_out & set(split.train_at(r).tolist())
            assert not leaked, (split.client_id, r, len(leaked))
    # the drifted clients still hold a test split shaped like their training data
    for split in splits:
        assert len(split.test_at(6)) > 0
        ratio = len(split.test_at(6)) / (len(split.test_at(6)) + len(split.train_at(6)))
        assert 0.1 < ratio < 0.4, (split.client_id, ratio)

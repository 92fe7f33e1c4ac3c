"""Client partitions: the pool, IID and Dirichlet splits, coverage of every scheme and
composition, determinism and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.config import (
    ConceptConfig,
    PartitionConfig,
    QuantityConfig,
    TasksConfig,
    TemporalConfig,
)
from fedloom.data import (
    ClientSplit,
    Example,
    PartitionPool,
    get_task,
    label_histogram,
    load_glue,
    make_clients,
    partition_dirichlet,
    partition_iid,
    split_train_test,
)

# MRPC-like labels: 3,668 examples, about one third negative.
MRPC_LABELS = np.array([0] * 1194 + [1] * 2474)


def pool_of(labels: np.ndarray, **columns: np.ndarray) -> PartitionPool:
    labels = np.asarray(labels)
    lengths = np.random.default_rng(99).integers(3, 60, size=len(labels))
    return PartitionPool(labels=labels, columns=columns, lengths=lengths)


def mixed_pool(n: int = 4000) -> PartitionPool:
    """10 labels; a 4-valued ``genre`` column of unequal sizes; tasks A (labels 0-4), B (5-9)."""
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 10, size=n)
    genre = rng.choice(["news", "forum", "captions", "wiki"], p=[0.5, 0.3, 0.15, 0.05], size=n)
    return pool_of(labels, genre=genre, task=np.where(labels < 5, "A", "B"))


def all_indices(splits: list[ClientSplit]) -> np.ndarray:
    return np.concatenate([np.concatenate([s.train, s.test]) for s in splits])


def assert_exact_cover(splits: list[ClientSplit], n: int) -> None:
    """train ∪ test over all clients is the pool, and nothing is held twice."""
    every = all_indices(splits)
    assert len(every) == n, "an example is lost or duplicated"
    assert np.array_equal(np.sort(every), np.arange(n))
    for split in splits:
        for part in (split.train, split.test):
            assert part.dtype == np.int64 and np.all(np.diff(part) > 0)


def test_iid_sizes_and_coverage() -> None:
    parts = partition_iid(3668, 3, np.random.default_rng(0))
    assert [len(p) for p in parts] == [1223, 1223, 1222]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(3668))
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    assert not np.array_equal(parts[0], np.arange(1223))  # shuffled, not contiguous


def test_pool_from_examples() -> None:
    examples = [
        Example("a b c", "d e", 1, {"genre": "news"}),
        Example("x", None, 0, {"source": "s1"}),
    ]
    pool = PartitionPool.from_examples(examples)
    assert pool.labels.tolist() == [1, 0] and not pool.is_regression
    assert sorted(pool.columns) == ["genre", "source"]
    assert pool.columns["genre"].tolist() == ["news", ""]
    assert pool.columns["source"].tolist() == ["", "s1"]
    assert pool.lengths.tolist() == [5, 1]
    with pytest.raises(ValueError, match="one entry per label"):
        PartitionPool(np.zeros(3, dtype=int), {"genre": np.array(["a"])}, np.ones(3))


def test_pool_from_real_stsb(glue_dir) -> None:
    pool = PartitionPool.from_examples(load_glue(get_task("STS-B"), "train", glue_dir))
    assert pool.is_regression and len(pool) == 5749
    assert {"genre", "source1", "year"} <= set(pool.columns)
    assert set(pool.columns["genre"]) == {"main-news", "main-captions", "main-forum"}
    assert sorted(np.unique(pool.classes).tolist()) == [0, 1, 2, 3, 4]  # quantile bins


#: every scheme and the compositions the toolbox promises, on :func:`mixed_pool`
CONFIGS = {
    "iid": {"scheme": "iid", "num_clients": 7},
    "dirichlet": {"scheme": "dirichlet", "num_clients": 7, "alpha": 0.5},
    "shards": {"scheme": "shards", "num_clients": 7, "shards_per_client": 2},
    "feature-genre-few": {"scheme": "feature", "num_clients": 3, "feature": "genre"},
    "feature-genre-many": {"scheme": "feature", "num_clients": 9, "feature": "genre"},
    "feature-length": {"scheme": "feature", "num_clients": 6, "feature": "length"},
    "iid+quantity": {"scheme": "iid", "num_clients": 20, "quantity": QuantityConfig(sigma=1.0)},
    "dirichlet+quantity": {
        "scheme": "dirichlet",
        "num_clients": 20,
        "alpha": 0.3,
        "quantity": QuantityConfig(law="powerlaw"),
    },
    "shards+quantity": {
        "scheme": "shards",
        "num_clients": 20,
        "shards_per_client": 3,
        "quantity": QuantityConfig(sigma=0.8),
    },
    "tasks+dirichlet": {
        "scheme": "dirichlet",
        "num_clients": 6,
        "alpha": 0.3,
        "tasks": TasksConfig(names=["A", "B"], mix=0.3),
    },
    "tasks+shards+quantity": {
        "scheme": "shards",
        "num_clients": 8,
        "shards_per_client": 2,
        "quantity": QuantityConfig(sigma=0.5),
        "tasks": TasksConfig(names=["B", "A"], mix=0.1),
    },
    "tasks+feature": {
        "scheme": "feature",
        "num_clients": 6,
        "feature": "genre",
        "tasks": TasksConfig(names=["A", "B"]),
    },
    "concept+dirichlet": {"scheme": "dirichlet", "num_clients": 7, "concept": ConceptConfig()},
    "temporal+concept+quantity": {
        "scheme": "dirichlet",
        "num_clients": 10,
        "alpha": 0.2,
        "quantity": QuantityConfig(sigma=0.7),
        "concept": ConceptConfig(kind="swap", fraction=0.5),
        "temporal": TemporalConfig(start_round=2, end_round=6, scheme="shards", fraction=0.5),
    },
}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_example_once_in_every_scheme(name: str) -> None:
    pool = mixed_pool()
    cfg = PartitionConfig(test_fraction=0.2, min_size=10, **CONFIGS[name])
    splits = make_clients(pool, cfg, seed=3)
    assert [s.client_id for s in splits] == list(range(cfg.num_clients))
    assert_exact_cover(splits, len(pool))
    for split in splits:
        size = len(split.train) + len(split.test)
        assert size >= cfg.min_size
        assert len(split.test) == pytest.approx(0.2 * size, abs=1)
        if split.drift is not None:  # the drift target is a partition of the pool too
            assert len(np.intersect1d(split.drift.target_train, split.drift.target_test)) == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_make_clients_is_determined_by_seed(name: str) -> None:
    pool = mixed_pool()
    cfg = PartitionConfig(**CONFIGS[name])

    def fingerprint(splits: list[ClientSplit]) -> list[tuple]:
        return [
            (
                s.train.tolist(),
                s.test.tolist(),
                None if s.label_map is None else s.label_map.tolist(),
                None if s.drift is None else (s.drift.target_train.tolist(), s.drift.seed),
                s.train_at(4).tolist(),
            )
            for s in splits
        ]

    first = fingerprint(make_clients(pool, cfg, seed=11))
    assert fingerprint(make_clients(pool, cfg, seed=11)) == first
    if name != "feature-genre-few":  # whole genres to clients: nothing random to vary
        assert fingerprint(make_clients(pool, cfg, seed=12)) != first


@pytest.mark.parametrize("seed", range(5))
def test_tiny_alpha_gives_each_client_one_label(seed: int) -> None:
    labels = np.repeat(np.arange(3), 200)
    parts = partition_dirichlet(labels, 3, alpha=1e-3, rng=np.random.default_rng(seed))
    for part in parts:
        counts = np.bincount(labels[part], minlength=3)
        assert counts.max() / counts.sum() > 0.9


@pytest.mark.parametrize("seed", range(3))
def test_dirichlet_alpha_to_zero_one_dominant_label(seed: int) -> None:
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(10), 300))
    cfg = PartitionConfig(scheme="dirichlet", num_clients=10, alpha=1e-3)
    splits = make_clients(pool_of(labels), cfg, seed)
    for split in splits:
        counts = np.bincount(labels[np.concatenate([split.train, split.test])], minlength=10)
        assert counts.max() / counts.sum() >= 0.95


def test_dirichlet_large_alpha_is_near_iid() -> None:
    labels = np.random.default_rng(0).integers(0, 10, size=20000)
    cfg = PartitionConfig(scheme="dirichlet", num_clients=10, alpha=1e4)
    global_mix = np.bincount(labels, minlength=10) / len(labels)
    for split in make_clients(pool_of(labels), cfg, seed=0):
        idx = np.concatenate([split.train, split.test])
        mix = np.bincount(labels[idx], minlength=10) / len(idx)
        assert np.abs(mix - global_mix).max() < 0.02
        assert len(idx) == pytest.approx(2000, rel=0.05)


def test_huge_alpha_is_close_to_iid() -> None:
    parts = partition_dirichlet(MRPC_LABELS, 4, alpha=1e4, rng=np.random.default_rng(0))
    global_share = MRPC_LABELS.mean()
    for part in parts:
        assert abs(MRPC_LABELS[part].mean() - global_share) < 0.03
        assert len(part) == pytest.approx(len(MRPC_LABELS) / 4, rel=0.05)


def test_min_size_is_respected() -> None:
    labels = np.repeat(np.arange(4), [500, 300, 150, 50])
    for seed in range(5):
        parts = partition_dirichlet(labels, 8, 0.1, np.random.default_rng(seed), min_size=40)
        assert min(len(p) for p in parts) >= 40
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_impossible_requests_raise() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="min_size=100 is impossible"):
        partition_dirichlet(np.zeros(250, dtype=int), 3, 0.5, rng, min_size=100)
    # Two labels cannot fill three clients when every label goes to a single client.
    with pytest.raises(ValueError, match="no Dirichlet.*in 20 tries"):
        partition_dirichlet(MRPC_LABELS, 3, 1e-3, rng, max_tries=20)
    small = pool_of(np.zeros(50, dtype=int))
    with pytest.raises(ValueError, match="min_size=20 is impossible: 3 clients x 20 > 50"):
        make_clients(small, PartitionConfig(num_clients=3, min_size=20), seed=0)
    # Whole genres to 2 clients: the 'wiki'-only client would be far below min_size.
    pool = pool_of(np.zeros(300, dtype=int), genre=np.array(["news"] * 295 + ["wiki"] * 5))
    cfg = PartitionConfig(scheme="feature", feature="genre", num_clients=2, min_size=10)
    with pytest.raises(ValueError, match="client 1 gets 5 examples.*min_size=10.*feature"):
        make_clients(pool, cfg, seed=0)
    # Configs built without validation get the same checks as validated ones.
    unchecked = PartitionConfig.model_construct(
        **{**PartitionConfig().model_dump(), "scheme": "feature"}
    )
    with pytest.raises(ValueError, match="scheme 'feature' needs feature"):
        make_clients(pool, unchecked, seed=0)


def test_float_labels_are_binned() -> None:
    scores = np.random.default_rng(1).uniform(0, 5, size=1000)
    parts = partition_dirichlet(scores, 4, 1e-3, np.random.default_rng(0))
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1000))
    for part in parts:  # one-hot Dirichlet draws: each client holds few score bins
        bins = np.digitize(scores[part], np.quantile(scores, [0.2, 0.4, 0.6, 0.8]))
        assert len(np.unique(bins)) <= 2


def test_real_mrpc_dirichlet(glue_dir) -> None:
    pool = PartitionPool.from_examples(load_glue(get_task("MRPC"), "train", glue_dir))
    cfg = PartitionConfig(scheme="dirichlet", num_clients=10, alpha=0.1)
    splits = make_clients(pool, cfg, seed=0)
    assert_exact_cover(splits, len(pool))
    shares = [pool.labels[s.train].mean() for s in splits]
    assert min(shares) < 0.2 and max(shares) > 0.9  # strongly skewed at alpha 0.1


def test_split_train_test() -> None:
    rng = np.random.default_rng(0)
    train, test = split_train_test(np.array([4, 9]), 0.01, rng)
    assert len(train) == 1 and len(test) == 1
    train, test = split_train_test(np.arange(100, 110), 0.3, rng)
    assert len(test) == 3
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(100, 110))
    train, test = split_train_test(np.arange(5), 0.0, rng)
    assert np.array_equal(train, np.arange(5)) and len(test) == 0
    with pytest.raises(ValueError, match="test_fraction"):
        split_train_test(np.arange(5), 1.0, rng)


def test_label_histogram() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    splits = [
        ClientSplit(0, train=np.array([0, 3, 4]), test=np.array([1])),
        ClientSplit(1, train=np.array([2, 5]), test=np.array([], dtype=np.int64)),
    ]
    assert label_histogram(labels, splits, num_labels=4).tolist() == [[1, 0, 2, 0], [0, 1, 1, 0]]
    with pytest.raises(ValueError, match="0..1"):
        label_histogram(labels, splits, num_labels=2)


def test_sequential_blocks_in_file_order() -> None:
    """Client k holds rows [k·m, (k+1)·m) in file order, for any seed; with client_size the
    rows past K·m are unused; without, the pool is split evenly."""
    pool = mixed_pool(100)
    cfg = PartitionConfig(scheme="sequential", num_clients=4, client_size=8, test_fraction=0,
                          min_size=8)
    splits = make_clients(pool, cfg, seed=0)
    assert [s.train.tolist() for s in splits] == [list(range(8 * k, 8 * k + 8)) for k in range(4)]
    assert [s.train.tolist() for s in make_clients(pool, cfg, seed=9)] == \
        [s.train.tolist() for s in splits]
    even = make_clients(pool, PartitionConfig(scheme="sequential", num_clients=3,
                                              test_fraction=0, min_size=1), seed=0)
    assert [(s.train[0], len(s.train)) for s in even] == [(0, 33), (33, 33), (66, 33)]


def test_sequential_errors_name_the_setting() -> None:
    pool = mixed_pool(50)
    cfg = PartitionConfig(scheme="sequential", num_clients=4, client_size=20, min_size=1)
    with pytest.raises(ValueError, match="client_size=20 is impossible: 4 clients x 20 rows > 50"):
        make_clients(pool, cfg, seed=0)
    with pytest.raises(ValueError, match="client_size is the sequential scheme's block size"):
        PartitionConfig(scheme="iid", client_size=8)
    with pytest.raises(ValueError, match="quantity skew composes .* not sequential"):
        PartitionConfig(scheme="sequential", quantity=QuantityConfig())

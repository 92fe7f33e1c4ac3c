"""Client partitions: sizes, coverage, determinism and label skew."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.data import (
    ClientSplit,
    label_histogram,
    make_clients,
    partition_dirichlet,
    partition_iid,
    split_train_test,
)

# MRPC-like labels: 3,668 examples, about one third negative.
MRPC_LABELS = np.array([0] * 1194 + [1] * 2474)


def _all_indices(splits) -> np.ndarray:
    return np.sort(np.concatenate([np.concatenate([s.train, s.test]) for s in splits]))


def test_iid_sizes_and_coverage() -> None:
    parts = partition_iid(3668, 3, np.random.default_rng(0))
    assert [len(p) for p in parts] == [1223, 1223, 1222]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(3668))
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    assert not np.array_equal(parts[0], np.arange(1223))  # shuffled, not contiguous


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_make_clients_covers_every_example_once(scheme: str) -> None:
    splits = make_clients(MRPC_LABELS, scheme, num_clients=5, seed=3, test_fraction=0.2)
    assert [s.client_id for s in splits] == list(range(5))
    assert np.array_equal(_all_indices(splits), np.arange(len(MRPC_LABELS)))
    for split in splits:
        assert len(np.intersect1d(split.train, split.test)) == 0
        assert split.train.dtype == split.test.dtype == np.int64
        assert len(split.test) == pytest.approx(0.2 * (len(split.train) + len(split.test)), abs=1)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_make_clients_is_determined_by_seed(scheme: str) -> None:
    first = make_clients(MRPC_LABELS, scheme, 4, seed=11, test_fraction=0.1)
    again = make_clients(MRPC_LABELS, scheme, 4, seed=11, test_fraction=0.1)
    other = make_clients(MRPC_LABELS, scheme, 4, seed=12, test_fraction=0.1)
    for a, b in zip(first, again):
        assert np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test)
    assert any(not np.array_equal(a.train, c.train) for a, c in zip(first, other))


@pytest.mark.parametrize("seed", range(5))
def test_tiny_alpha_gives_each_client_one_label(seed: int) -> None:
    labels = np.repeat(np.arange(3), 200)
    parts = partition_dirichlet(labels, 3, alpha=1e-3, rng=np.random.default_rng(seed))
    for part in parts:
        counts = np.bincount(labels[part], minlength=3)
        assert counts.max() / counts.sum() > 0.9


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


def test_impossible_min_size_raises() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="min_size=100 is impossible"):
        partition_dirichlet(np.zeros(250, dtype=int), 3, 0.5, rng, min_size=100)
    # Two labels cannot fill three clients when every label goes to a single client.
    with pytest.raises(ValueError, match="no Dirichlet.*in 20 tries"):
        partition_dirichlet(MRPC_LABELS, 3, 1e-3, rng, max_tries=20)
    with pytest.raises(ValueError, match="min_size=20 is impossible"):
        make_clients(np.zeros(50, dtype=int), "iid", 3, seed=0, test_fraction=0.0, min_size=20)


def test_float_labels_are_binned() -> None:
    scores = np.random.default_rng(1).uniform(0, 5, size=1000)
    parts = partition_dirichlet(scores, 4, 1e-3, np.random.default_rng(0))
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1000))
    for part in parts:  # one-hot Dirichlet draws: each client holds few score bins
        bins = np.digitize(scores[part], np.quantile(scores, [0.2, 0.4, 0.6, 0.8]))
        assert len(np.unique(bins)) <= 2


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


def test_unknown_scheme() -> None:
    with pytest.raises(ValueError, match="unknown partition scheme 'shards'"):
        make_clients(MRPC_LABELS, "shards", 3, seed=0, test_fraction=0.1)

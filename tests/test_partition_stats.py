"""Partition statistics (label counts as seen, Jensen–Shannon skew, JSON summary) and the
label heatmap."""

from __future__ import annotations

import json
from pathlib import Path

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
    REGRESSION_BINS,
    ClientSplit,
    Drift,
    PartitionPool,
    client_label_counts,
    get_task,
    load_glue,
    make_clients,
    partition_stats,
    plot_label_heatmap,
    regression_bin_names,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def pool_of(labels: np.ndarray, **columns: np.ndarray) -> PartitionPool:
    labels = np.asarray(labels)
    return PartitionPool(labels, columns, np.arange(len(labels)) % 17 + 1)


def test_js_is_zero_for_identical_mixes() -> None:
    labels = np.tile([0, 1, 1, 2], 30)  # every block of 4 has the global mix 1:2:1
    splits = [
        ClientSplit(k, np.arange(40 * k, 40 * k + 40), np.empty(0, np.int64)) for k in range(3)
    ]
    stats = partition_stats(pool_of(labels), splits, ["a", "b", "c"])
    assert [c["js_to_global"] for c in stats["clients"]] == [0.0, 0.0, 0.0]
    assert stats["mean_js_to_global"] == 0.0


def test_js_for_disjoint_two_label_clients_matches_hand_value() -> None:
    # Client 0 holds only label 0, client 1 only label 1, equally many: the global mix is
    # (1/2, 1/2) and each client's midpoint with it is M = (3/4, 1/4), so
    # JS = H(M) - (H(client) + H(global)) / 2 = H(3/4, 1/4) - 1/2 = 3/2 - (3/4)·log2(3) bits.
    # (Between the two clients themselves it would be the full 1 bit.)
    labels = np.array([0] * 50 + [1] * 50)
    splits = [
        ClientSplit(0, np.arange(0, 50), np.empty(0, np.int64)),
        ClientSplit(1, np.arange(50, 100), np.empty(0, np.int64)),
    ]
    stats = partition_stats(pool_of(labels), splits, ["neg", "pos"])
    expected = 1.5 - 0.75 * np.log2(3)
    for client in stats["clients"]:
        assert client["js_to_global"] == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(0.311278, abs=1e-6)


def test_stats_are_json_and_complete() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 6, size=3000)
    pool = pool_of(labels, task=np.where(labels < 3, "A", "B"), genre=rng.choice(["x", "y"], 3000))
    cfg = PartitionConfig(
        scheme="dirichlet",
        num_clients=6,
        alpha=0.3,
        quantity=QuantityConfig(sigma=0.5),
        tasks=TasksConfig(names=["A", "B"], mix=0.1),
        concept=ConceptConfig(fraction=0.5),
        temporal=TemporalConfig(start_round=1, end_round=3, scheme="iid", fraction=0.5),
    )
    splits = make_clients(pool, cfg, seed=0)
    names = [f"l{i}" for i in range(6)]
    stats = json.loads(json.dumps(partition_stats(pool, splits, names, round_=2, cfg=cfg)))
    assert stats["num_clients"] == 6 and stats["scheme"] == "dirichlet"
    assert stats["skews"] == ["quantity", "concept", "tasks", "temporal"]
    assert stats["label_names"] == names and stats["round"] == 2
    sizes = np.array([c["train"] + c["test"] for c in stats["clients"]])
    assert stats["sizes"] == pytest.approx(
        {
            "mean": sizes.mean(),
            "min": sizes.min(),
            "max": sizes.max(),
            "cv": sizes.std() / sizes.mean(),
        }
    )
    seen = client_label_counts(pool, splits, 6, round_=2)
    for client, split, row in zip(stats["clients"], splits, seen):
        assert client["label_counts"] == row.tolist()
        assert client["train"] == len(split.train_at(2)) == sum(client["task_counts"].values())
        assert set(client["task_counts"]) == {"A", "B"}
        assert (client["label_map"] is None) == (split.label_map is None)
        assert (client["drift"] is None) == (split.drift is None)
        if split.drift is not None:
            assert client["drift"] == {"start_round": 1, "end_round": 3}
        assert 0 <= client["js_to_global"] <= 1
    js = [c["js_to_global"] for c in stats["clients"]]
    assert stats["max_js_to_global"] == pytest.approx(max(js))
    assert stats["mean_js_to_global"] == pytest.approx(np.mean(js))
    # Without the config the skews visible on the splits are still reported.
    assert partition_stats(pool, splits, names)["skews"] == ["concept", "temporal"]


def test_feature_counts_on_real_stsb(glue_dir: Path) -> None:
    pool = PartitionPool.from_examples(load_glue(get_task("STS-B"), "train", glue_dir))
    cfg = PartitionConfig(scheme="feature", feature="genre", num_clients=4)
    splits = make_clients(pool, cfg, seed=0)
    bins = regression_bin_names(pool.labels)
    assert len(bins) == REGRESSION_BINS
    stats = json.loads(json.dumps(partition_stats(pool, splits, bins, cfg=cfg)))
    for client in stats["clients"]:
        assert len(client["feature_counts"]) == 1  # one genre per client
        assert sum(client["feature_counts"].values()) == client["train"]
        assert sum(client["label_counts"]) == client["train"]
    # Regression scores are counted in REGRESSION_BINS quantile bins, nothing else.
    with pytest.raises(ValueError, match=f"pass num_labels={REGRESSION_BINS}, got 2"):
        client_label_counts(pool, splits, 2)
    lengths = cfg.model_copy(update={"feature": "length"})
    stats = partition_stats(pool, make_clients(pool, lengths, 0), bins, cfg=lengths)
    longest = [max(map(int, c["feature_counts"])) for c in stats["clients"]]
    assert longest == sorted(longest)


def test_label_counts_follow_the_drift() -> None:
    labels = np.repeat([0, 1], 50)
    split = ClientSplit(
        0,
        np.arange(0, 40),
        np.arange(40, 50),
        drift=Drift(np.arange(50, 90), np.arange(90, 100), start_round=0, end_round=2),
    )
    pool = pool_of(labels)
    assert client_label_counts(pool, [split], 2, round_=0).tolist() == [[40, 0]]
    assert client_label_counts(pool, [split], 2, round_=1).tolist() == [[20, 20]]
    assert client_label_counts(pool, [split], 2, round_=2).tolist() == [[0, 40]]


def test_heatmap_writes_a_png(tmp_path: Path) -> None:
    counts = np.array([[10, 0, 3], [0, 7, 1]])
    path = plot_label_heatmap(counts, ["a", "b", "c"], tmp_path / "plots" / "labels.png", "skew")
    assert path == tmp_path / "plots" / "labels.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in path.parent.iterdir()] == ["labels.png"]  # no temporary left
    many = np.random.default_rng(0).integers(0, 100, size=(50, 10))  # too many cells to label
    assert plot_label_heatmap(many, list("abcdefghij"), path).read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="3 count columns but 2 label names"):
        plot_label_heatmap(counts, ["a", "b"], path)

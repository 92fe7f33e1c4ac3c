"""Dev-weighted client scores: the weights of a label mix (hand computed), relabelling by a
client's label map, unbiasedness and the precision gained over a small test split
(statistical), and the runtime's choice and recording of the mode (tiny-bert runs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_glue

from fedloom.config import ConfigError
from fedloom.data import TASKS, compute_metrics
from fedloom.evaluation.dev_weighted import dev_weighted, label_proportions
from fedloom.evaluation.score import evaluate
from fedloom.evaluation.splits import scored_splits
from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate


def features(labels: list[int]) -> list[dict]:
    return [{"input_ids": [i], "label": y} for i, y in enumerate(labels)]


def test_weights_are_the_client_mix_over_the_dev_class_counts() -> None:
    dev = features([0, 0, 0, 1])  # n_dev(0) = 3, n_dev(1) = 1
    weighted, lost = dev_weighted(dev, np.array([0.25, 0.75]))
    assert lost == 0.0
    assert [f["weight"] for f in weighted] == pytest.approx([0.25 / 3] * 3 + [0.75])
    one_class, _ = dev_weighted(dev, np.array([1.0, 0.0]))
    assert [f["label"] for f in one_class] == [0, 0, 0]  # classes it does not hold are dropped
    assert sum(f["weight"] for f in one_class) == pytest.approx(1.0)


def test_a_label_map_relabels_the_dev_set_before_weighting() -> None:
    dev = features([0, 0, 0, 1])
    swapped, _ = dev_weighted(dev, np.array([0.25, 0.75]), label_map=np.array([1, 0]))
    assert [f["label"] for f in swapped] == [1, 1, 1, 0]
    # n_dev after the map: class 1 has 3 examples, class 0 has 1
    assert [f["weight"] for f in swapped] == pytest.approx([0.75 / 3] * 3 + [0.25])


def test_a_class_missing_from_the_dev_set_is_reported_and_renormalized() -> None:
    weighted, lost = dev_weighted(features([0, 0, 2]), np.array([0.5, 0.3, 0.2]))
    assert lost == pytest.approx(0.3)
    assert [f["weight"] for f in weighted] == pytest.approx([0.5 / 0.7 / 2] * 2 + [0.2 / 0.7])
    assert dev_weighted(features([1, 1]), np.array([1.0, 0.0])) == ([], 1.0)


def test_label_proportions() -> None:
    assert label_proportions([0, 2, 2, 2], 3) == pytest.approx([0.25, 0.0, 0.75])


def test_unbiased_and_far_more_precise_than_a_16_example_split() -> None:
    """A fixed classifier right on 90 % of class 0 and 60 % of class 1; a client holding
    20 % / 80 %. Its true accuracy is 0.2·0.9 + 0.8·0.6 = 0.66. Scored on random 16-example
    test splits of its distribution the estimate is unbiased but has std ≈ 0.12; the
    dev-weighted estimate on a 400-example dev set is within a few points with one draw."""
    rng = np.random.default_rng(0)
    mix, acc = np.array([0.2, 0.8]), np.array([0.9, 0.6])
    truth = float(mix @ acc)

    def draw(n: int, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.choice(2, size=n, p=p)
        right = rng.random(n) < acc[labels]
        return np.where(right, labels, 1 - labels), labels

    split_scores, dev_scores, unweighted = [], [], []
    for _ in range(400):
        preds, labels = draw(16, mix)
        split_scores.append(compute_metrics(TASKS["RTE"], preds, labels)["accuracy"])
        preds, labels = draw(400, np.array([0.5, 0.5]))  # a dev set of another label mix
        weighted, _ = dev_weighted(features(labels.tolist()), mix)
        weights = np.array([f["weight"] for f in weighted])
        dev_scores.append(compute_metrics(TASKS["RTE"], preds, labels, weights)["accuracy"])
        unweighted.append(compute_metrics(TASKS["RTE"], preds, labels)["accuracy"])
    split_scores, dev_scores = np.array(split_scores), np.array(dev_scores)
    for scores in (split_scores, dev_scores):  # both unbiased: mean within 3 standard errors
        assert abs(scores.mean() - truth) < 3 * scores.std() / np.sqrt(len(scores))
    assert split_scores.std() == pytest.approx(np.sqrt(truth * (1 - truth) / 16), rel=0.15)
    assert dev_scores.std() < split_scores.std() / 3
    # unweighted, the dev set measures its own mix (0.5·0.9 + 0.5·0.6 = 0.75), not the client's
    assert np.mean(unweighted) == pytest.approx(0.75, abs=0.01)


@needs_glue
def test_auto_mode_scores_clients_on_their_weighted_dev_set(make_config, tmp_path: Path) -> None:
    cfg = make_config("partition.scheme=\"dirichlet\"", "partition.alpha=0.3",
                      "partition.concept={fraction=0.34, kind=\"swap\"}", "federation.rounds=1",
                      "data.max_dev_examples=60")
    exp = Experiment.build(cfg)
    assert exp.data.client_mode == "dev_weighted"
    for client in exp.clients:
        splits = scored_splits(exp, client)
        assert splits["clients_split"] is client.test
        labels = [f["label"] for f in client.train]
        held = set(labels)
        assert {f["label"] for f in splits["clients"]} == held
        mapped = [int(client.split.label_map[f["label"]]) if client.split.label_map is not None
                  else f["label"] for f in exp.dev]
        assert len(splits["clients"]) == sum(y in held for y in mapped)
        for c in held:  # each class carries the client's share of it
            share = sum(f["weight"] for f in splits["clients"] if f["label"] == c)
            assert share == pytest.approx(labels.count(c) / len(labels))
    run = RunDir.create(tmp_path / "runs", "dw")
    summary = simulate(exp, run)
    assert summary["client_mode"] == "dev_weighted"
    # the global adapter's client scores reuse its dev predictions: the same numbers as
    # scoring each client's weighted dev set directly
    final = load_params(run.checkpoints / "global.safetensors")
    per_client = json.loads((run.path / "metrics.jsonl").read_text().splitlines()[-3])
    assert per_client["scope"] == "global/clients"
    for client in exp.clients:
        direct = evaluate(exp.model, final, scored_splits(exp, client)["clients"], 32)
        logged = per_client["per_client"][str(client.client_id)]
        assert logged["accuracy"] == pytest.approx(direct["accuracy"])
        assert logged["loss"] == pytest.approx(direct["loss"], rel=1e-5)
    assert set(summary["global"]) == {"dev", "clients", "clients_split"}
    rows = [json.loads(line) for line in
            next((tmp_path / "runs").glob("dw-*/metrics.jsonl")).read_text().splitlines()]
    per = next(r for r in rows if r.get("scope") == "global/clients")["per_client"]
    assert all(v["n"] >= 10 for v in per.values())  # the dev set, not 4 test examples


@needs_glue
def test_split_mode_and_refusals(make_config, tmp_path: Path) -> None:
    assert Experiment.build(make_config("eval.client_mode=\"split\"")).data.client_mode == "split"
    temporal = 'partition.temporal={start_round=1, end_round=2}'
    assert Experiment.build(make_config(temporal)).data.client_mode == "split"  # auto
    with pytest.raises(ConfigError, match="eval.client_mode: .*temporal drift"):
        make_config(temporal, "eval.client_mode=\"dev_weighted\"")
    with pytest.raises(ConfigError, match="eval.client_mode: .*numeric label"):
        Experiment.build(make_config("data.task=\"STS-B\"", "eval.client_mode=\"dev_weighted\""))


@needs_glue
def test_each_split_is_scored_on_its_own(make_config, tmp_path: Path) -> None:
    """No test split (test_fraction 0) with a validation split: val is still scored (a
    sweep used to fail every point)."""
    cfg = make_config("partition.test_fraction=0.0", "partition.val_fraction=0.25",
                      "eval.client_mode=\"split\"", "federation.rounds=1")
    summary = simulate(Experiment.build(cfg), RunDir.create(tmp_path / "runs", "val-only"))
    assert summary["global"]["val"]["accuracy"]["n"] == 3
    assert "clients" not in summary["global"]

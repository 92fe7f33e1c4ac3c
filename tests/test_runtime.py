"""The embedded simulator on tiny-bert and a small real MRPC subset: the run directory,
reproducibility, client sampling, dropping diverged clients, centralized pooling."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import needs_glue
from safetensors import safe_open

from fedloom.algorithms import ClientContext, ClientResult, register
from fedloom.algorithms.fedavg import FedAvg
from fedloom.config import load_config
from fedloom.experiment import Experiment
from fedloom.runtime.clients import client_seed
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import AllClientsFailed, sample_clients, simulate


def run_experiment(cfg, tmp_path: Path, exp: Experiment | None = None) -> tuple[Experiment, RunDir, dict]:
    exp = exp or Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    return exp, run, summary


def metrics_rows(run: RunDir) -> list[dict]:
    return [json.loads(line) for line in run.metrics_path.read_text().splitlines()]


def checkpoint_round(path: Path) -> int:
    with safe_open(str(path), "pt") as f:
        return int(f.metadata()["round"])


# --- sample_clients (no data needed) ------------------------------------------------------


def test_sample_clients_is_deterministic() -> None:
    ids = list(range(10))
    a = sample_clients(ids, 0.3, 1, seed=5, round_=2)
    assert a == sample_clients(ids, 0.3, 1, seed=5, round_=2)
    assert a == sorted(a) and len(set(a)) == len(a) and set(a) <= set(ids)
    # the stream depends on the round and the seed
    by_round = {tuple(sample_clients(ids, 0.3, 1, seed=5, round_=r)) for r in range(10)}
    assert len(by_round) > 1
    by_seed = {tuple(sample_clients(ids, 0.3, 1, seed=s, round_=2)) for s in range(10)}
    assert len(by_seed) > 1


@pytest.mark.parametrize(
    ("k", "fraction", "min_clients", "expected"),
    [
        (10, 0.3, 1, 3),
        (10, 0.25, 1, 3),  # ceil(2.5)
        (10, 0.01, 1, 1),
        (10, 0.3, 5, 5),  # min_clients wins
        (10, 0.3, 20, 10),  # never more than there are
        (10, 1.0, 1, 10),
        (1, 0.5, 1, 1),
    ],
)
def test_sample_clients_respects_fraction_and_min_clients(
    k: int, fraction: float, min_clients: int, expected: int
) -> None:
    ids = [3 * i + 1 for i in range(k)]  # ids need not be 0..K-1
    for r in range(5):
        chosen = sample_clients(ids, fraction, min_clients, seed=0, round_=r)
        assert len(chosen) == expected
        assert set(chosen) <= set(ids)


def test_full_participation_samples_everyone() -> None:
    assert sample_clients([0, 1, 2], 1.0, 1, seed=3, round_=0) == [0, 1, 2]


def test_client_seed_is_deterministic_and_distinct() -> None:
    assert client_seed(0, 1, 2) == client_seed(0, 1, 2)
    seeds = {client_seed(0, r, c) for r in range(4) for c in range(4)}
    assert len(seeds) == 16


# --- simulate on MRPC ---------------------------------------------------------------------


@needs_glue
def test_simulate_writes_a_complete_run_dir(make_config, tmp_path: Path) -> None:
    cfg = make_config("diagnostics.every=1")
    exp, run, summary = run_experiment(cfg, tmp_path)
    path = run.path
    assert path.parent == tmp_path / "runs" and path.name.startswith("tiny-")
    for name in ("config.toml", "partition.json", "partition.png", "metrics.jsonl",
                 "summary.json", "run.log"):
        assert (path / name).is_file(), name
    assert not list(path.rglob("*.tmp"))  # no leftovers of atomic writes

    # config.toml is the resolved config and loads back to the same thing
    assert load_config(path / "config.toml") == cfg

    partition = json.loads((path / "partition.json").read_text())
    assert [c["client_id"] for c in partition["clients"]] == [0, 1, 2]
    assert sum(c["train"] + c["test"] for c in partition["clients"]) == 60
    assert partition["label_names"] == ["not_equivalent", "equivalent"]
    for c, client in zip(partition["clients"], exp.clients):
        assert c["train"] == len(client.train) and c["test"] == len(client.test)
        assert sum(c["label_counts"]) == c["train"]

    rows = metrics_rows(run)
    # clients: the dev set weighted to each client's label mix (auto); clients_split: its own
    assert [(r["round"], r["scope"]) for r in rows] == [
        (1, "train"), (1, "diagnostics"), (1, "global/dev"), (1, "global/clients"),
        (1, "global/clients_split"),
        (2, "train"), (2, "diagnostics"), (2, "global/dev"), (2, "global/clients"),
        (2, "global/clients_split"), (2, "global/others"),  # Others: at the final evaluation
    ]
    for r in rows:
        if r["scope"] == "diagnostics":
            drift = r["drift"]
            assert set(drift["per_client"]) == {"0", "1", "2"}
            assert all(d > 0 for d in drift["per_client"].values())
            assert drift["mean"] == pytest.approx(sum(drift["per_client"].values()) / 3)
            assert drift["max"] == max(drift["per_client"].values())
            per_step = r["drift_per_step"]["per_client"]  # 2 local steps each (tiny config)
            assert per_step == {c: pytest.approx(d / 2) for c, d in drift["per_client"].items()}
            partition_js = [c["js_to_global"] for c in partition["clients"]]
            assert r["label_js"]["per_client"] == {str(i): js for i, js in enumerate(partition_js)}
            gradient = r["gradient"]
            assert set(gradient["per_client"]) == {"0", "1", "2"}
            assert gradient["g2"] > 0 and gradient["mean_gradient_norm"] > 0
        elif r["scope"] == "train":
            assert r["clients"] == [0, 1, 2] and r["failed"] == []
            assert set(r["per_client"]) == {"0", "1", "2"}
            assert r["train_loss"] == pytest.approx(sum(r["per_client"].values()) / 3)
        elif r["scope"] == "global/dev":
            assert r["n"] == 30
            assert {"accuracy", "f1", "loss"} <= set(r)
        else:
            assert set(r["per_client"]) == {"0", "1", "2"}
            assert set(r["metrics"]) == {"accuracy", "f1"}
            assert set(r["metrics"]["accuracy"]) >= {"mean", "min", "max"}

    on_disk = json.loads((path / "summary.json").read_text())
    assert on_disk == summary
    assert summary["task"] == "MRPC" and summary["algorithm"] == "fedavg" and summary["rounds"] == 2
    assert summary["main_metric"] == "accuracy"
    assert summary["global"]["dev"] == {k: v for k, v in rows[-4].items() if k not in ("round", "scope")}
    assert "personal" not in summary

    ckpt = path / "checkpoints" / "global.safetensors"
    assert ckpt.is_file()
    assert not (path / "checkpoints" / "personal").exists()
    params = load_params(ckpt)
    assert set(params) == set(exp.model.param_names)
    assert checkpoint_round(ckpt) == 2
    # the checkpoint is the adapter that was scored: re-scoring it gives the logged numbers
    from fedloom.evaluation.score import evaluate

    again = evaluate(exp.model, params, exp.dev, 32)
    assert again["accuracy"] == summary["global"]["dev"]["accuracy"]
    assert again["loss"] == pytest.approx(summary["global"]["dev"]["loss"], rel=1e-5)


@needs_glue
def test_eval_every_skips_rounds_but_scores_the_last(make_config, tmp_path: Path) -> None:
    cfg = make_config("federation.rounds=3", "eval.every=2", "eval.clients=false")
    _, run, _ = run_experiment(cfg, tmp_path)
    scored = [(r["round"], r["scope"]) for r in metrics_rows(run)
              if r["scope"] not in ("train", "diagnostics")]
    assert scored == [(2, "global/dev"), (3, "global/dev")]


@needs_glue
def test_training_moves_the_global_adapter(make_config, tmp_path: Path) -> None:
    cfg = make_config()
    exp = Experiment.build(cfg)
    initial = exp.model.get_params()
    _, run, _ = run_experiment(cfg, tmp_path, exp)
    final = load_params(run.checkpoints / "global.safetensors")
    assert any(not torch.equal(final[n], initial[n]) for n in initial)


@needs_glue
def test_local_algorithm_writes_personal_checkpoints_only(make_config, tmp_path: Path) -> None:
    cfg = make_config("algorithm.name=local")
    exp, run, summary = run_experiment(cfg, tmp_path)
    ckpts = run.path / "checkpoints"
    assert not (ckpts / "global.safetensors").exists()
    personal = sorted(p.name for p in (ckpts / "personal").iterdir())
    assert personal == ["client_000.safetensors", "client_001.safetensors", "client_002.safetensors"]
    adapters = [load_params(ckpts / "personal" / name) for name in personal]
    for adapter in adapters:
        assert set(adapter) == set(exp.model.param_names)
    # nothing is shared: every client trained its own adapter
    head = [a["classifier.weight"] for a in adapters]
    assert not torch.equal(head[0], head[1]) and not torch.equal(head[1], head[2])
    rows = metrics_rows(run)
    scopes = [(r["round"], r["scope"]) for r in rows]
    assert scopes == [(1, "train"), (1, "diagnostics"), (1, "personal/clients"),
                      (1, "personal/clients_split"), (2, "train"), (2, "diagnostics"),
                      (2, "personal/clients"), (2, "personal/clients_split"),
                      (2, "personal/others")]
    # no global model: drift is logged, the gradient dissimilarity (at w) is not
    assert all("gradient" not in r for r in rows if r["scope"] == "diagnostics")
    assert "global" not in summary
    assert set(summary["personal"]["clients"]) == {"accuracy", "f1"}


@needs_glue
def test_same_config_twice_gives_identical_metrics(make_config, tmp_path: Path) -> None:
    cfg = make_config("federation.fraction=0.6")
    _, run1, _ = run_experiment(cfg, tmp_path)
    _, run2, _ = run_experiment(cfg, tmp_path)
    assert run1.path != run2.path
    text = run1.metrics_path.read_text()
    assert text and text == run2.metrics_path.read_text()
    rows = metrics_rows(run1)
    sampled = [r["clients"] for r in rows if r["scope"] == "train"]
    assert all(len(c) == 2 for c in sampled)  # ceil(0.6 * 3)
    a = load_params(run1.checkpoints / "global.safetensors")
    b = load_params(run2.checkpoints / "global.safetensors")
    assert all(torch.equal(a[n], b[n]) for n in a)


@needs_glue
def test_a_different_seed_gives_different_metrics(make_config, tmp_path: Path) -> None:
    _, run1, _ = run_experiment(make_config("seed=0"), tmp_path)
    _, run2, _ = run_experiment(make_config("seed=1"), tmp_path)
    assert run1.metrics_path.read_text() != run2.metrics_path.read_text()


# --- diverging clients --------------------------------------------------------------------


@register("test-nan-client")
@dataclass(frozen=True)
class NanClient(FedAvg):
    """FedAvg whose client ``bad_client`` returns a NaN update from round ``bad_round`` on
    (``bad_client = -1``: every client)."""

    bad_client: int = 1
    bad_round: int = 1
    raise_instead: bool = False

    def local_train(self, ctx: ClientContext, payload):
        result = super().local_train(ctx, payload)
        if ctx.round >= self.bad_round and self.bad_client in (-1, ctx.client_id):
            if self.raise_instead:
                raise FloatingPointError(f"client {ctx.client_id}: non-finite loss at local step 0")
            params = {n: torch.full_like(t, float("nan")) for n, t in result.params.items()}
            return ClientResult(result.client_id, params, result.num_examples, result.metrics)
        return result


@needs_glue
@pytest.mark.parametrize("raise_instead", [False, True])
def test_diverged_client_is_dropped_and_logged(make_config, tmp_path: Path, raise_instead: bool) -> None:
    cfg = make_config(
        "algorithm.name=test-nan-client", "algorithm.bad_client=1", "algorithm.bad_round=1",
        f"algorithm.raise_instead={str(raise_instead).lower()}",
    )
    _, run, summary = run_experiment(cfg, tmp_path)
    train = [r for r in metrics_rows(run) if r["scope"] == "train"]
    assert train[0]["failed"] == [] and set(train[0]["per_client"]) == {"0", "1", "2"}
    assert train[1]["failed"] == [1] and set(train[1]["per_client"]) == {"0", "2"}
    assert train[1]["clients"] == [0, 1, 2]
    log = (run.path / "run.log").read_text()
    assert "round 2: client 1 left out" in log
    assert ("non-finite loss" if raise_instead else "rejected: ") in log
    assert train[1]["missing"]["1"].endswith("non-finite loss at local step 0" if raise_instead
                                             else "non-finite values")
    params = load_params(run.checkpoints / "global.safetensors")
    assert all(torch.isfinite(t).all() for t in params.values())
    assert checkpoint_round(run.checkpoints / "global.safetensors") == 2
    assert math.isfinite(summary["global"]["dev"]["loss"])


@needs_glue
def test_all_clients_failing_keeps_the_earlier_checkpoint(make_config, tmp_path: Path) -> None:
    cfg = make_config(
        "federation.rounds=3", "algorithm.name=test-nan-client", "algorithm.bad_client=-1",
        "algorithm.bad_round=1",
    )
    exp = Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    with pytest.raises(AllClientsFailed, match=r"round 2: every sampled client failed \(\[0, 1, 2\]\)"):
        simulate(exp, run)
    ckpt = run.checkpoints / "global.safetensors"
    assert checkpoint_round(ckpt) == 1  # round 1's adapter, intact
    params = load_params(ckpt)
    assert set(params) == set(exp.model.param_names)
    assert all(torch.isfinite(t).all() for t in params.values())
    rounds = {r["round"] for r in metrics_rows(run)}
    assert rounds == {1}
    assert not (run.path / "summary.json").exists()


# --- centralized --------------------------------------------------------------------------


@needs_glue
def test_centralized_pools_all_training_data(make_config, tmp_path: Path) -> None:
    cfg = make_config("algorithm.name=centralized")
    exp = Experiment.build(cfg)
    parties = exp.parties()
    assert len(parties) == 1 and parties[0].client_id == 0
    pooled = parties[0].train
    assert len(pooled) == sum(len(c.train) for c in exp.clients) == 48
    assert parties[0].test == []
    expected = [f for c in exp.clients for f in c.train]
    assert all(a is b for a, b in zip(pooled, expected))
    # the clients keep their own test splits for scoring
    assert len(exp.clients) == 3

    _, run, summary = run_experiment(cfg, tmp_path, exp)
    rows = metrics_rows(run)
    train = [r for r in rows if r["scope"] == "train"]
    assert [r["clients"] for r in train] == [[0], [0]]
    clients = [r for r in rows if r["scope"] == "global/clients"]
    assert set(clients[-1]["per_client"]) == {"0", "1", "2"}
    assert (run.checkpoints / "global.safetensors").is_file()
    assert summary["algorithm"] == "centralized"


@needs_glue
def test_fedavg_parties_are_the_clients(make_config) -> None:
    exp = Experiment.build(make_config())
    assert all(p is c for p, c in zip(exp.parties(), exp.clients, strict=True))
    assert [c.client_id for c in exp.clients] == [0, 1, 2]
    assert sum(len(c.train) + len(c.test) for c in exp.clients) == 60
    assert len(exp.dev) == 30

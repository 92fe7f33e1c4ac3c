"""Federation (s) of the personalization benchmark (issue 41), without training: its
config validates for every method it reports, its partition is the one stated, every
method trains the same passes per client and round, and the table's seed statistics and
paired differences read a results file as stated."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import GLUE_DIR, needs_glue

from fedloom.config import ConfigError, validate
from fedloom.federation import FederatedData

#: the rows federation (s) reports
S_METHODS = ["local", "fedavg", "fedavg_ft", "ditto", "ditto_equal", "ifca", "cfl", "fedmosaic"]
SWAPPED = [0, 1, 2, 3, 8, 9]
SMOLLM2 = [8, 9, 10, 11]


def _benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "personalization.py"
    spec = importlib.util.spec_from_file_location("personalization_benchmark_s", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _benchmark()


def s_raw(method: str, local_steps: int = 24) -> dict[str, Any]:
    """Federation (s)'s config of ``method`` at the documented size."""
    raw = bench.base_config(
        "s", method, backbone="minilm", max_train=1800, rounds=8, local_steps=local_steps
    )
    raw["data"]["data_dir"] = str(GLUE_DIR)
    return raw


def test_federation_s_config_for_every_reported_method() -> None:
    """Each reported method's config validates: 12 clients, clients 8-11 on SmolLM2
    (verbalizer, fp32, top 10 blocks cached), exactly 0-3 and 8-9 swapping the labels,
    no Self / Others scoring;
    FedMosaic (every fedmosaic row) with the frozen shared head and 20 of the 24 steps,
    every other method 24 steps (Ditto as defined, ditto_equal at equal compute)."""
    for method in [*S_METHODS, "fedmosaic_frozen_head", "fedmosaic_uniform"]:
        cfg = validate(s_raw(method))
        assert cfg.data.task == "SST-2" and cfg.data.max_train_examples == 1800
        assert cfg.data.max_dev_examples == 400 and cfg.eval.others == "never"
        assert cfg.partition.num_clients == 12 and cfg.partition.scheme == "iid"
        concept = cfg.partition.concept
        assert concept.clients == SWAPPED and concept.kind == "swap"
        assert concept.fraction is None
        (group,) = cfg.model.groups
        assert group.clients == SMOLLM2 and group.backbone == "smollm2-135m"
        assert (group.head, group.precision, group.prefix_cache) == ("verbalizer", "fp32", True)
        assert group.lora.layers == list(range(20, 30))
        assert [cfg.model.backbone_of(c) for c in range(12)] == ["minilm"] * 8 + [
            "smollm2-135m"
        ] * 4
        hyper = cfg.algorithm.hyperparameters
        if cfg.algorithm.name == "fedmosaic":
            assert hyper["head"] == "frozen" and cfg.train.local_steps == 20
        else:
            assert "head" not in hyper and cfg.train.local_steps == 24
    assert validate(s_raw("ditto_equal")).algorithm.hyperparameters == {"equal_compute": True}
    assert validate(s_raw("ifca")).algorithm.hyperparameters == {}  # k = 2 by default


@needs_glue
def test_federation_s_partition() -> None:
    """The partition (no model built): 12 IID clients of 150 SST-2 examples (120 train,
    30 test), exactly clients 0-3 and 8-9 swapping the two labels at every seed, 400 dev
    examples, dev-weighted client scores."""
    for seed in (0, 1, 2):
        raw = s_raw("fedmosaic")
        raw["seed"] = seed
        data = FederatedData.build(validate(raw))
        assert len(data.train) == 1800 and len(data.dev) == 400
        assert data.client_mode == "dev_weighted"
        assert [s.client_id for s in data.splits] == list(range(12))
        assert [(len(s.train), len(s.test)) for s in data.splits] == [(120, 30)] * 12
        swapped = [s.client_id for s in data.splits if s.label_map is not None]
        assert swapped == SWAPPED
        assert all(data.splits[c].label_map.tolist() == [1, 0] for c in SWAPPED)


def test_equal_pass_steps() -> None:
    """FedMosaic takes S' steps with S' + ceil(S'/grad_every) = S; a budget no S' meets is
    refused naming --local-steps; every other method keeps S."""
    fedmosaic = {"name": "fedmosaic", "head": "frozen"}
    assert [bench.equal_pass_steps(fedmosaic, s) for s in (24, 12, 6, 4, 2)] == [20, 10, 5, 3, 1]
    assert bench.equal_pass_steps({**fedmosaic, "grad_every": 3}, 24) == 18
    for steps in (1, 7, 25):
        with pytest.raises(ConfigError, match=rf"^--local-steps {steps}: .* multiple of 6$"):
            bench.equal_pass_steps(fedmosaic, steps)
    for method in ("ditto", "ditto_equal", "ifca", "local"):
        assert bench.equal_pass_steps(bench.METHODS[method][0], 25) == 25
    assert (
        bench.base_config(
            "c", "fedmosaic", backbone="minilm", max_train=800, rounds=8, local_steps=24
        )["train"]["local_steps"]
        == 24
    )  # only (s)


SIZE = {
    "backbone": "minilm",
    "max_train_examples": 1800,
    "rounds": 8,
    "local_steps": 24,
    "defaults": True,
}

#: method -> per seed (client test mean, p10)
SCORES = {
    "local": [(0.60, 0.50), (0.62, 0.48), (0.58, 0.52)],
    "fedavg": [(0.50, 0.40), (0.51, 0.41), (0.49, 0.39)],
    "ditto_equal": [(0.63, 0.52), (0.61, 0.53), (0.62, 0.51)],
    "fedmosaic": [(0.66, 0.55), (0.65, 0.56), (0.67, 0.54)],
}


def _row(method: str, seed: int) -> dict[str, Any]:
    mean, p10 = SCORES[method][seed]
    return {
        "federation": "s",
        "method": method,
        "size": SIZE,
        "seed": seed,
        "replicate": seed > 0,
        "index": 0,
        "overrides": {"train.lr": 0.001},
        "run_dir": "r",
        "adapter": "personal",
        "metric": "accuracy",
        "score": 0.5,
        "val": {"mean": 0.5},
        "test": {"mean": mean, "p10": p10, "min": p10 - 0.1},
        "test_split": {"mean": mean},
        "global_dev": None,
        "wall_seconds": 1.0,
        "train_passes_per_client_round": 24.0,
    }


def test_table_and_paired_differences_over_seeds(tmp_path: Path) -> None:
    """On a hand-made results file: the table's mean ± std and p10 ± std over the three
    seeds and the passes column; --against's pairs (every method against each baseline
    in the file, never itself, two baselines once); the paired mean and p10 differences
    seed by seed."""
    path = tmp_path / "pers-s.jsonl"
    rows = [_row(m, seed) for seed in (2, 0, 1) for m in SCORES]  # any order
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    line = next(x for x in bench.table(path).splitlines() if x.startswith("| fedmosaic "))
    assert "| 66.0 ± 1.0 % | 55.0 ± 1.0 % |" in line and "| 24 |" in line

    pairs = bench.against(path, ["local", "ditto_equal", "ditto", "fedavg"])
    assert pairs == [
        ("fedavg", "local"),
        ("ditto_equal", "local"),
        ("fedmosaic", "local"),
        ("fedavg", "ditto_equal"),
        ("fedmosaic", "ditto_equal"),
        ("fedmosaic", "fedavg"),
    ]
    text = bench.paired(path, pairs)
    assert "| dev-weighted p10: mean ± std (per seed) |" in text.splitlines()[0]
    line = next(x for x in text.splitlines() if "fedmosaic − local" in x)
    # mean: +6, +3, +9 (6.0 ± 3.0); p10: +5, +8, +2 (5.0 ± 3.0)
    assert line.startswith(
        "| s | fedmosaic − local | 3 | 6.0 ± 3.0 % (+6.0, +3.0, +9.0) "
        "| 5.0 ± 3.0 % (+5.0, +8.0, +2.0) |"
    )
    line = next(x for x in text.splitlines() if "fedmosaic − fedavg" in x)
    assert "| 16.0 ± 2.0 % (+16.0, +14.0, +18.0) | 15.0 ± 0.0 % (+15.0, +15.0, +15.0) |" in line


@needs_glue
def test_federation_s_trains_equal_passes_on_tiny_backbones(tmp_path: Path) -> None:
    """Federation (s) shrunk onto the tiny backbones (tiny-bert, tiny-llama for the
    SmolLM2 clients), one round of 6 passes: each method runs, and the passes its clients
    count are the same (FedMosaic: 5 steps + 1 anchor gradient)."""
    from fedloom.experiment import Experiment, build_algorithm, with_model_for
    from fedloom.runtime.rundir import RunDir
    from fedloom.server import simulate

    for method in ("local", "fedmosaic"):
        raw = bench.base_config(
            "s", method, backbone="tiny-bert", max_train=360, rounds=1, local_steps=6
        )
        raw["data"].update(data_dir=str(GLUE_DIR), max_dev_examples=40, max_length=64)
        raw["output_dir"] = str(tmp_path)
        group = raw["model"]["groups"][0]
        group.update(backbone="tiny-llama", prefix_cache=False)
        group["lora"]["layers"] = [0, 1]
        cfg = validate(raw)
        cfg = with_model_for(build_algorithm(cfg), cfg)
        summary = simulate(Experiment.build(cfg), RunDir.create(tmp_path / "runs", cfg.name))
        assert summary["compute"]["train_passes_per_client_round"] == 6.0, method
        assert summary["client_mode"] == "dev_weighted"

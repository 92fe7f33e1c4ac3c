"""The anchor workload of the performance benchmark (``benchmarks/anchor.toml``) is what
its comment and ``benchmarks.anchor_flower`` say: MRPC rows [32 k, 32 k + 32) in file
order for client k of 8, two steps of batch 16 a round, evaluation and diagnostics off;
the fast variant differs only in the fast-path settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedloom.config import load_config, to_toml_dict
from fedloom.data import get_task, load_glue
from fedloom.experiment import Experiment
from fedloom.train.local import steps_per_round

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _config(name: str, glue_dir: Path):
    return load_config(BENCHMARKS / name, [f'data.data_dir="{glue_dir}"'])


@pytest.mark.slow
def test_anchor_clients_hold_consecutive_file_rows(glue_dir: Path) -> None:
    cfg = _config("anchor.toml", glue_dir)
    exp = Experiment.build(cfg)
    rows = load_glue(get_task("MRPC"), "train", glue_dir)
    assert [c.client_id for c in exp.clients] == list(range(8))
    for client in exp.clients:
        mine = rows[32 * client.client_id: 32 * client.client_id + 32]
        assert client.test == [] and client.val == []
        # only the rows a client holds are tokenized, each as the model encodes it
        assert client.train == exp.model.encode(mine)
        assert steps_per_round(cfg.train, len(client.train)) == 2
    assert (cfg.eval.dev, cfg.eval.clients, cfg.diagnostics.every) == (False, False, 0)
    assert (cfg.train.batching, cfg.model.precision) == ("random", "fp32")


def test_fast_anchor_differs_only_in_the_fast_path(glue_dir: Path) -> None:
    plain = to_toml_dict(_config("anchor.toml", glue_dir))
    fast = to_toml_dict(_config("anchor_fast.toml", glue_dir))
    differences = {(section, key) for section in plain for key in (
        plain[section] if isinstance(plain[section], dict) else [None])
        if (plain[section].get(key) if key else plain[section])
        != (fast[section].get(key) if key else fast[section])}
    assert differences == {("name", None), ("train", "batching"), ("model", "precision")}

"""``fedloom sweep``: grid parsing and expansion, every point validated before any runs,
refusal without a validation split or with a grid that varies the data, selection on the
clients' validation scores and never on their test scores (fake run summaries, whose
validation and test scores rank the points differently), replicates of the selected point
(``--seeds``), and a real tiny-bert sweep through the CLI; the personalization benchmark's
grids, tie-breaking and replicates."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from conftest import GLUE_DIR, needs_glue, tiny_raw
from typer.testing import CliRunner

from fedloom import sweep
from fedloom.algorithms import register
from fedloom.algorithms.fedavg import FedAvg
from fedloom.cli import app
from fedloom.config import ConfigError, to_toml_dict
from fedloom.data import DataError
from fedloom.sweep import SweepError, expand, parse_axis, parse_grid, select

runner = CliRunner()


@register("test-sweep-personal")
@dataclass(frozen=True)
class PersonalWithGlobal(FedAvg):
    """Stands for Ditto-like methods: personal adapters and a global one."""

    personalized = True


def invoke(*args: Any):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def assert_bad_input(result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    flat = " ".join(lines)
    for fragment in fragments:
        assert fragment in flat, flat


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(tiny_raw("partition.val_fraction=0.25")))
    return path


# --- grid syntax and expansion --------------------------------------------------------------


def test_values_parse_as_toml_with_bare_strings_and_arrays() -> None:
    assert parse_axis("algorithm.lam=0.1,1,10").values == (0.1, 1, 10)
    assert parse_axis("train.lr = 3e-4, 1e-3").values == (3e-4, 1e-3)
    assert parse_axis("train.optimizer=adamw,sgd").values == ("adamw", "sgd")
    assert parse_axis('data.task="a,b",RTE').values == ("a,b", "RTE")
    assert parse_axis('partition.tasks.names=["MRPC","RTE"],["CoLA"]').values == (
        ["MRPC", "RTE"], ["CoLA"])
    assert parse_axis("eval.initial=true").values == (True,)


def test_cartesian_expansion_last_axis_fastest() -> None:
    axes = parse_grid(["algorithm.lam=0.1,1,10", "train.lr=3e-4,1e-3,3e-3"])
    points = expand(axes)
    assert len(points) == 9
    assert points[0] == {"algorithm.lam": 0.1, "train.lr": 3e-4}
    assert points[1] == {"algorithm.lam": 0.1, "train.lr": 1e-3}
    assert points[8] == {"algorithm.lam": 10, "train.lr": 3e-3}
    assert len({json.dumps(p, sort_keys=True) for p in points}) == 9


def test_overrides_round_trip_through_toml() -> None:
    for text in ("train.lr=3e-4,1e-3", "train.optimizer=adamw,sgd", 'x.y=["a","b"],[]'):
        axis = parse_axis(text)
        assert parse_axis(axis.item) == axis


@pytest.mark.parametrize(("item", "fragment"), [
    ("train.lr", "expected section.key=value1,value2"),
    ("train.lr=", "empty value list"),
    ("train.lr=1e-3,,3e-3", "empty value between commas"),
    ("train.lr=1e-3,3e-3,", "empty value between commas"),
    ("train..lr=1", "not a dotted config key"),
    ("train.lr=1e-3,1e-3", "a value is repeated"),
])
def test_bad_grid_syntax(item: str, fragment: str) -> None:
    with pytest.raises(SweepError, match=fragment) as err:
        parse_grid([item])
    assert f"--grid {item!r}" in str(err.value)


def test_grid_needs_an_axis_and_each_key_once() -> None:
    with pytest.raises(SweepError, match="at least one"):
        parse_grid([])
    with pytest.raises(SweepError, match="train.lr is swept twice"):
        parse_grid(["train.lr=1e-3", "train.lr=3e-3"])
    with pytest.raises(SweepError, match="set by the sweep itself"):
        parse_grid(["output_dir=a,b"])


# --- validation before anything runs (CLI: exit 2, one line naming the --grid item) ---------


@pytest.mark.parametrize(("grid", "fragments"), [
    (["train.lr=1e-3,3e-3", "train.lrr=1,2"], ["--grid train.lrr=1,2", "train.lrr: unknown key"]),
    (["algorithm.lamm=0.1,1"], ["--grid algorithm.lamm=0.1,1", "unknown hyperparameter"]),
    (["train.lr=1e-3,-1"], ["--grid train.lr=0.001,-1", "train.lr"]),
    (["train.lr="], ["--grid 'train.lr='", "empty value list"]),
    (["eval.clients=true,false"], ["--grid eval.clients=true,false", "eval.clients: is false"]),
    # keys that define the data: the points would be scored on different validation sets
    (["train.lr=1e-3,3e-3", "seed=0,1"],
     ["--grid seed=0,1: seed defines the clients' data", "different validation sets",
      "seeds are replicates, not candidates: use --seeds N"]),
    (["partition.num_clients=3,4"],
     ["--grid partition.num_clients=3,4: partition.num_clients defines the clients' data",
      "different validation sets", "fix it with --set"]),
    (["data.max_train_examples=60,120"], ["--grid data.max_train_examples=60,120",
                                          "different validation sets"]),
])
def test_bad_points_exit_2_before_any_run(config: Path, tmp_path: Path, grid: list[str],
                                          fragments: list[str]) -> None:
    args = [a for item in grid for a in ("--grid", item)]
    result = invoke("sweep", config, *args, "--output-dir", tmp_path / "out")
    assert_bad_input(result, *fragments)
    assert not (tmp_path / "out").exists()  # nothing ran, not even a sweep directory


def test_a_bad_combination_names_its_point(config: Path, tmp_path: Path) -> None:
    """Each value is valid alone (against the base config); one combination is not."""
    result = invoke("sweep", config, "--set", "algorithm.name=ditto",
                    "--grid", "algorithm.name=ditto,fedavg", "--grid", "algorithm.lam=0.1,1",
                    "--output-dir", tmp_path / "out")
    assert_bad_input(result, '--grid point algorithm.name="fedavg", algorithm.lam=0.1:',
                     "algorithm.lam")
    assert not (tmp_path / "out").exists()


@needs_glue
def test_data_keys_with_one_value_are_fixed_settings(tmp_path: Path) -> None:
    """A data key with one value is not a candidate: the grid may fix it (the benchmark
    harness passes ``--set partition.x=...`` as such an axis), and a bad one is the
    partition's own error."""
    raw = tiny_raw("partition.val_fraction=0.25")
    axes = [sweep.Axis("partition.num_clients", (4,)), sweep.Axis("train.lr", (1e-3, 3e-3))]
    the_plan = sweep.plan(raw, axes)
    assert [p.config.partition.num_clients for p in the_plan.points] == [4, 4]
    bench = _personalization_benchmark()
    fixed = (sweep.Axis("partition.val_fraction", (0.25,)),)
    harness = sweep.plan(bench.base_config("a", "fedavg", backbone="tiny-bert", max_train=200,
                                           rounds=1), bench.grid("fedavg", fixed=fixed),
                         [f"data.data_dir={json.dumps(str(GLUE_DIR))}"])
    assert {p.config.partition.val_fraction for p in harness.points} == {0.25}
    with pytest.raises(ConfigError, match="min_size=5 is impossible"):  # 40 x 5 > 60 examples
        sweep.plan(raw, [sweep.Axis("partition.num_clients", (40,))])


def test_every_seeds_federation_is_checked_before_any_run(monkeypatch, config: Path,
                                                          tmp_path: Path) -> None:
    from fedloom.federation import FederatedData

    def build(cfg):
        if cfg.seed == 2:
            raise DataError("partition: an impossible split at this seed")

    monkeypatch.setattr(FederatedData, "build", build)
    result = invoke("sweep", config, "--grid", "train.lr=1e-3,3e-3", "--seeds", 3,
                    "--output-dir", tmp_path / "out")
    assert_bad_input(result, "--seeds 3: seed 2: partition: an impossible split")
    assert not (tmp_path / "out").exists()


def test_refuses_without_a_validation_split(config: Path, tmp_path: Path) -> None:
    result = invoke("sweep", config, "--set", "partition.val_fraction=0",
                    "--grid", "train.lr=1e-3,3e-3", "--output-dir", tmp_path / "out")
    assert_bad_input(result, "partition.val_fraction: is 0")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "fragment"), [
    (["--select", "global", "--set", "algorithm.name=local"], "local has no global adapter"),
    (["--select", "personal"], "fedavg has no personal adapters"),
    (["--select", "best"], "--select 'best'"),
    (["--metric", "matthews"], "--metric 'matthews': MRPC is scored by accuracy, f1"),
])
def test_selection_settings_are_checked(config: Path, tmp_path: Path, args: list[str],
                                        fragment: str) -> None:
    result = invoke("sweep", config, "--grid", "train.lr=1e-3,3e-3", *args,
                    "--output-dir", tmp_path / "out")
    assert_bad_input(result, fragment)


# --- selection: validation only ---------------------------------------------------------------


def fake_summary(val: dict[str, float], test: dict[str, float]) -> dict[str, Any]:
    """summary.json as the runtime writes it, for adapter kinds -> mean accuracy."""
    def stats(mean: float) -> dict[str, Any]:
        return {"accuracy": {"mean": mean, "min": mean - 0.2, "max": mean + 0.1, "p10": mean - 0.1}}

    out: dict[str, Any] = {"wall_seconds": 1.0}
    for kind, score in val.items():
        out[kind] = {"val": stats(score), "clients": stats(test[kind])}
    if "global" in out:
        out["global"]["dev"] = {"accuracy": 0.5, "n": 30}
    return out


def run_with_fakes(monkeypatch, config: Path, out: Path, summaries: dict[float, Any],
                   *args: str):
    """A sweep over train.lr whose runs return ``summaries[lr]`` instead of training."""
    def fake_run(cfg, path: Path) -> dict[str, Any]:
        path.mkdir(parents=True)
        outcome = summaries[cfg.train.lr]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(sweep, "run_point", fake_run)
    grid = "train.lr=" + ",".join(map(str, summaries))
    result = invoke("sweep", config, "--grid", grid, "--output-dir", out, *args)
    (sweep_dir,) = out.iterdir()
    return result, sweep_dir


def test_better_test_but_worse_val_is_not_selected(monkeypatch, config: Path,
                                                    tmp_path: Path) -> None:
    summaries = {
        0.001: fake_summary({"global": 0.70}, {"global": 0.95}),  # best test, worse val
        0.003: fake_summary({"global": 0.80}, {"global": 0.60}),
        0.01: fake_summary({"global": 0.75}, {"global": 0.90}),
    }
    result, sweep_dir = run_with_fakes(monkeypatch, config, tmp_path / "out", summaries)
    assert result.exit_code == 0, result.stderr
    assert sweep_dir.name.startswith("tiny-sweep-")
    report = json.loads((sweep_dir / "sweep.json").read_text())
    assert report["selected"] == 1 and report["finished"]
    assert [p["score"] for p in report["points"]] == [0.70, 0.80, 0.75]
    assert [p["test"]["mean"] for p in report["points"]] == [0.95, 0.60, 0.90]  # stored anyway
    chosen = report["points"][1]
    assert chosen["overrides"] == {"train.lr": 0.003} and chosen["adapter"] == "global"
    assert chosen["global_dev"] == 0.5
    assert Path(chosen["run_dir"]).parent == sweep_dir
    table = (sweep_dir / "sweep.md").read_text().splitlines()
    rows = table[4:7]  # after the caption, the header and the alignment row
    assert table[7:] == []
    assert rows[1].startswith("| ★ | 0.003 | global | 0.8000 | 0.6000 | 0.5000 | 0.4000 | 0.5000")
    assert "0.9500" not in "\n".join(table)  # non-selected test scores are not shown
    assert "0.9500" not in result.stdout
    # one seed: the selected run is the only replicate, no std, no line in the table
    assert report["replicates"]["seeds"] == [0]
    assert report["replicates"]["test_mean"] == {"mean": 0.60, "std": None, "n": 1}
    assert "seeds" not in "\n".join(table)


def test_auto_selects_on_the_adapter_the_clients_use(monkeypatch, config: Path,
                                                      tmp_path: Path) -> None:
    """A method with personal adapters and a global one: auto reads personal/val."""
    summaries = {  # on each adapter, test ranks the points the other way round
        0.001: fake_summary({"global": 0.90, "personal": 0.60}, {"global": 0.4, "personal": 0.9}),
        0.003: fake_summary({"global": 0.50, "personal": 0.70}, {"global": 0.8, "personal": 0.5}),
    }
    set_personal = ("--set", "algorithm.name=test-sweep-personal")
    result, auto_dir = run_with_fakes(monkeypatch, config, tmp_path / "auto", summaries,
                                      *set_personal)
    assert result.exit_code == 0, result.stderr
    auto = json.loads((auto_dir / "sweep.json").read_text())
    assert auto["selected"] == 1 and auto["points"][1]["adapter"] == "personal"
    result, global_dir = run_with_fakes(monkeypatch, config, tmp_path / "global", summaries,
                                        *set_personal, "--select", "global")
    forced = json.loads((global_dir / "sweep.json").read_text())
    assert forced["selected"] == 0 and forced["points"][0]["score"] == 0.90


def test_failed_points_are_recorded_and_never_selected(monkeypatch, config: Path,
                                                        tmp_path: Path) -> None:
    summaries = {0.001: fake_summary({"global": 0.6}, {"global": 0.6}),
                 0.003: RuntimeError("round 1: every sampled client failed ([0, 1, 2])")}
    result, sweep_dir = run_with_fakes(monkeypatch, config, tmp_path / "out", summaries)
    assert result.exit_code == 0
    report = json.loads((sweep_dir / "sweep.json").read_text())
    assert report["selected"] == 0
    assert "every sampled client failed" in report["points"][1]["error"]
    assert "failed" in result.stderr

    everything_fails = {0.001: FloatingPointError("nan"), 0.003: RuntimeError("diverged")}
    result, _ = run_with_fakes(monkeypatch, config, tmp_path / "all", everything_fails)
    assert result.exit_code == 1 and "every point of the sweep failed" in result.stderr


def test_sweep_json_is_written_after_every_point(monkeypatch, config: Path,
                                                 tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    def fake_run(cfg, path: Path) -> dict[str, Any]:
        path.mkdir(parents=True)
        progress = path.parent / "sweep.json"
        seen.append(json.loads(progress.read_text()) if progress.exists() else {})
        return fake_summary({"global": cfg.train.lr}, {"global": 0.5})

    monkeypatch.setattr(sweep, "run_point", fake_run)
    result = invoke("sweep", config, "--grid", "train.lr=0.1,0.3", "--output-dir", tmp_path)
    assert result.exit_code == 0, result.stderr
    assert seen[0] == {}  # nothing before the first point
    assert len(seen[1]["points"]) == 1 and not seen[1]["finished"]
    assert seen[1]["selected"] is None  # selection waits for every point


def test_select_ties_and_missing_scores() -> None:
    records = [{"index": 0, "score": None}, {"index": 1, "score": 0.7},
               {"index": 2, "score": 0.7}, {"index": 3, "score": 0.69},
               {"index": 1, "score": 0.9, "replicate": True}]  # a replicate is no candidate
    assert select(records) == 1
    assert select([{"index": 0, "score": None}]) is None
    assert select([{"index": 0, "score": 0.9, "replicate": True}]) is None
    # a loss or NLL: the lowest wins (the earlier one on a tie)
    nll = [{"index": i, "score": v, "metric": "nll"} for i, v in enumerate([2.1, 1.8, 1.8])]
    assert select(nll) == 1


def test_seeds_rerun_the_selected_point(monkeypatch, config: Path, tmp_path: Path) -> None:
    """--seeds 3: the point selected on validation (lr 0.003) runs again at seeds 1 and 2
    in replicate-seed<k>/; sweep.json has per seed its test mean and p10, and their mean
    ± sample std; a replicate's better val score does not change the selection."""
    test_by_seed = {0: 0.60, 1: 0.70, 2: 0.65}
    runs: list[tuple[float, int, str]] = []

    def fake_run(cfg, path: Path) -> dict[str, Any]:
        path.mkdir(parents=True)
        runs.append((cfg.train.lr, cfg.seed, path.name))
        if cfg.train.lr == 0.001:  # best test, worse val
            return fake_summary({"global": 0.70}, {"global": 0.95})
        val = 0.80 if cfg.seed == 0 else 0.99
        return fake_summary({"global": val}, {"global": test_by_seed[cfg.seed]})

    monkeypatch.setattr(sweep, "run_point", fake_run)
    result = invoke("sweep", config, "--grid", "train.lr=0.001,0.003", "--seeds", 3,
                    "--output-dir", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    (sweep_dir,) = (tmp_path / "out").iterdir()
    assert runs == [(0.001, 0, "00-lr=0.001"), (0.003, 0, "01-lr=0.003"),
                    (0.003, 1, "replicate-seed1"), (0.003, 2, "replicate-seed2")]
    report = json.loads((sweep_dir / "sweep.json").read_text())
    assert report["selected"] == 1 and report["finished"] and len(report["points"]) == 2
    replicates = report["replicates"]
    assert replicates["seeds"] == [0, 1, 2] and replicates["adapter"] == "global"
    assert [r["test_mean"] for r in replicates["runs"]] == [0.60, 0.70, 0.65]
    assert [r["test_p10"] for r in replicates["runs"]] == pytest.approx([0.50, 0.60, 0.55])
    assert [r["val_mean"] for r in replicates["runs"]] == [0.80, 0.99, 0.99]
    assert [r["global_dev"] for r in replicates["runs"]] == [0.5, 0.5, 0.5]
    assert Path(replicates["runs"][2]["run_dir"]) == sweep_dir / "replicate-seed2"
    # sample std (ddof = 1) of 0.60, 0.70, 0.65 is 0.05 (the population std is 0.041)
    assert replicates["test_mean"] == pytest.approx({"mean": 0.65, "std": 0.05, "n": 3})
    assert replicates["test_p10"] == pytest.approx({"mean": 0.55, "std": 0.05, "n": 3})
    expected = ("mean ± std over 3 seeds (0, 1, 2): test mean 0.6500 ± 0.0500, "
                "test p10 0.5500 ± 0.0500")
    assert expected in (sweep_dir / "sweep.md").read_text()
    assert expected in " ".join(result.stdout.split())
    assert "replicate seed 2 of point 2/2 (train.lr=0.003)" in result.stderr


# --- real runs on tiny-bert -------------------------------------------------------------------


@needs_glue
def test_tiny_bert_sweep_end_to_end(config: Path, tmp_path: Path) -> None:
    result = invoke("sweep", config, "--grid", "train.lr=1e-3,5e-3", "--set", "federation.rounds=1",
                    "--output-dir", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    (sweep_dir,) = (tmp_path / "out").iterdir()
    report = json.loads((sweep_dir / "sweep.json").read_text())
    assert len(report["points"]) == 2 and report["metric"] == "accuracy"
    for point, lr in zip(report["points"], (1e-3, 5e-3)):
        run = Path(point["run_dir"])
        summary = json.loads((run / "summary.json").read_text())
        config_text = (run / "config.toml").read_text()
        assert f"lr = {lr}" in config_text and "val_fraction = 0.25" in config_text
        assert point["score"] == summary["global"]["val"]["accuracy"]["mean"]
        assert point["test"] == summary["global"]["clients"]["accuracy"]
        assert point["global_dev"] == summary["global"]["dev"]["accuracy"]
    scores = [p["score"] for p in report["points"]]
    chosen = report["selected"]
    assert scores[chosen] == max(scores) and max(scores) not in scores[:chosen]
    assert (sweep_dir / "sweep.md").read_text().count("| ★ |") == 1
    assert "accuracy, selected (★) on the clients' validation" in result.stdout


@needs_glue
def test_parallel_jobs_give_the_same_scores(tmp_path: Path) -> None:
    """Two processes run the same points to the same numbers as one (seeded runs)."""
    raw = tiny_raw("partition.val_fraction=0.25", "federation.rounds=1", "algorithm.name=local")
    plan = sweep.plan(raw, parse_grid(["train.lr=1e-3,5e-3"]))
    scores = []
    for jobs in (1, 2):
        result = sweep.run(plan, sweep.create_dir(tmp_path / f"jobs{jobs}", "tiny"), jobs=jobs)
        scores.append([(r["score"], r["test"]) for r in result.records])
        assert all(r["adapter"] == "personal" and r["global_dev"] is None for r in result.records)
    assert scores[0] == scores[1]
    assert all(score is not None for score, _ in scores[0])


# --- the personalization benchmark's grids ---------------------------------------------------


def _personalization_benchmark():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "personalization.py"
    spec = importlib.util.spec_from_file_location("personalization_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_personalization_grids_name_real_hyperparameters() -> None:
    """Every point of every registered method's grid, on every federation, is a valid
    config for that algorithm (a renamed hyperparameter fails here, not hours into a run);
    a method not registered yet is skipped by the benchmark, not an error. At equal
    passes (federation s) FedMosaic takes 3 of 4 steps, its 4th pass an anchor gradient."""
    bench = _personalization_benchmark()
    for federation in bench.FEDERATIONS:
        for method in bench.METHODS:
            if not bench.registered(method):
                continue
            raw = bench.base_config(federation, method, backbone="tiny-bert", max_train=800,
                                    rounds=8)
            fewer = federation in bench.EQUAL_PASSES and raw["algorithm"]["name"] == "fedmosaic"
            for combo in expand(bench.grid(method)):
                cfg, _ = sweep.checked_config(raw, sweep.as_overrides(combo))
                sweep.needs_validation(cfg)
                pooled = bench.algorithms.create(raw["algorithm"]["name"]).pools_data
                assert cfg.train.local_steps == (
                    4 * cfg.partition.num_clients if pooled else 3 if fewer else 4)


def test_personalization_fixed_value_replaces_the_methods_axis() -> None:
    """``--set algorithm.num_clusters=4``: IFCA's own num_clusters axis gives way to the
    fixed value, with or without ``--defaults``; other methods gain the key unchanged."""
    bench = _personalization_benchmark()
    fixed = (sweep.Axis("algorithm.num_clusters", (4,)),)
    for defaults in (False, True):
        points = expand(bench.grid("ifca", (1e-3,), defaults, fixed))
        assert points == [{"train.lr": 1e-3, "algorithm.num_clusters": 4}]
    assert expand(bench.grid("cfl", (1e-3,), False, fixed)) == [
        {"train.lr": 1e-3, "algorithm.max_cross_similarity": v, "algorithm.num_clusters": 4}
        for v in (-0.02, 0.0)]


def test_personalization_table_selects_by_score_when_indices_repeat(tmp_path: Path) -> None:
    """A grid extended after a first run numbers its new point 0 again: the table still
    shows the point with the best validation score, not the first row with the index."""
    bench = _personalization_benchmark()
    size = {"backbone": "minilm", "max_train_examples": 800, "rounds": 8}

    def row(lam: float, val: float, test: float) -> dict:
        return {"federation": "c", "method": "pfedmac", "size": size, "index": 0,
                "overrides": {"train.lr": 0.001, "algorithm.lam": lam}, "run_dir": "r",
                "adapter": "personal", "metric": "accuracy", "score": val,
                "val": {"mean": val}, "test": {"mean": test, "p10": test, "min": test},
                "global_dev": None, "wall_seconds": 1.0}

    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (row(0.1, 0.70, 0.65),
                                                             row(0.03, 0.72, 0.61))))
    line = next(x for x in bench.table(path).splitlines() if x.startswith("| pfedmac"))
    assert "lam=0.03" in line and "61.0 %" in line


def _bench_row(method: str, overrides: dict[str, Any], val: float, test: float,
               **extra: Any) -> dict[str, Any]:
    """A results-file row as the benchmark writes it (fake scores)."""
    return {"federation": "a", "method": method,
            "size": {"backbone": "tiny-bert", "max_train_examples": 200, "rounds": 1},
            "index": 0, "overrides": overrides, "run_dir": "r", "adapter": "personal",
            "metric": "accuracy", "score": val, "val": {"mean": val},
            "test": {"mean": test, "p10": test - 0.1, "min": test - 0.2},
            "global_dev": None, "wall_seconds": 1.0, **extra}


def test_personalization_table_breaks_ties_by_grid_position(tmp_path: Path) -> None:
    """Tied validation scores go to the earlier point of the method's grid (Ditto's λ 0.1
    before 1.0; λ = 0.05, not in today's grid, after both), whatever the order in the file
    (completion order under --jobs); a replicate's score is no candidate."""
    bench = _personalization_benchmark()
    rows = [_bench_row("ditto", {"train.lr": 0.001, "algorithm.lam": 1.0}, 0.70, 0.80),
            _bench_row("ditto", {"train.lr": 0.001, "algorithm.lam": 0.05}, 0.70, 0.75),
            _bench_row("ditto", {"train.lr": 0.001, "algorithm.lam": 0.1}, 0.70, 0.61),
            _bench_row("ditto", {"train.lr": 0.001, "algorithm.lam": 1.0}, 0.99, 0.90,
                       replicate=True, seed=1)]
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
        path = tmp_path / f"results-{''.join(map(str, order))}.jsonl"
        path.write_text("".join(json.dumps(rows[i]) + "\n" for i in order))
        line = next(x for x in bench.table(path).splitlines() if x.startswith("| ditto"))
        assert "| lr=0.001, lam=0.1 |" in line and "| 61.0 % |" in line


def _bench_args(tmp_path: Path, *, defaults: bool):
    """The personalization benchmark's arguments: Ditto on federation (c), tiny, 3 seeds,
    results in ``tmp_path / "results.jsonl"``."""
    import argparse

    return argparse.Namespace(
        federation="c", methods=["ditto"], max_train_examples=200, rounds=1, local_steps=4,
        defaults=defaults, set=[], backbone="tiny-bert", data_dir=str(GLUE_DIR), lrs=(0.001,),
        jobs=1, seeds=3, out=str(tmp_path / "results.jsonl"), runs=str(tmp_path / "runs"))


@needs_glue
def test_personalization_replicates(monkeypatch, tmp_path: Path) -> None:
    """--seeds 3: after its grid, a method's point selected on validation runs at seeds 1
    and 2 as replicate rows (a second invocation runs nothing again), and the table shows
    the client test mean and p10 as mean ± sample std over the three seeds."""
    bench = _personalization_benchmark()
    runs: list[tuple[float, int]] = []

    def fake_run(cfg, path: Path) -> dict[str, Any]:
        path.mkdir(parents=True)
        lam = cfg.algorithm.hyperparameters["lam"]
        runs.append((lam, cfg.seed))
        if lam == 0.1:  # best test, worse val
            return fake_summary({"personal": 0.70}, {"personal": 0.95})
        val = 0.80 if cfg.seed == 0 else 0.99
        summary = fake_summary({"personal": val},
                               {"personal": {0: 0.60, 1: 0.70, 2: 0.65}[cfg.seed]})
        # dev-weighted test scores, the clients' own splits beside them
        summary["client_mode"] = "dev_weighted"
        summary["personal"]["clients_split"] = {"accuracy": {
            "mean": {0: 0.50, 1: 0.70, 2: 0.90}[cfg.seed], "min": 0.0, "max": 1.0, "p10": 0.1}}
        return summary

    monkeypatch.setattr(sweep, "run_point", fake_run)
    out = tmp_path / "results.jsonl"
    args = _bench_args(tmp_path, defaults=False)
    bench.run(args)
    bench.run(args)  # resumable: everything is there
    assert runs == [(0.1, 0), (1.0, 0), (1.0, 1), (1.0, 2)]
    rows = bench.read_rows(out)
    assert [(r["overrides"]["algorithm.lam"], r["seed"], r["replicate"]) for r in rows] == [
        (0.1, 0, False), (1.0, 0, False), (1.0, 1, True), (1.0, 2, True)]
    lines = bench.table(out).splitlines()
    assert "client test scores: dev-weighted" in lines[0]
    assert ("| client test mean ± std | p10 ± std | own test splits: mean ± std "
            "| other-backbone clients ± std | seeds |" in lines[2])
    line = next(x for x in lines if x.startswith("| ditto"))
    assert "| lr=0.001, lam=1.0 |" in line and "| 60.0 % |" in line
    assert "| 65.0 ± 5.0 % | 55.0 ± 5.0 % | 70.0 ± 20.0 % | — | 3 |" in line
    assert "| 2 |" in line  # the grid's points; replicates are not points


@needs_glue
def test_a_one_point_grid_runs_its_seeds_beside_it(monkeypatch, tmp_path: Path) -> None:
    """--defaults at one learning rate with --seeds 3: the point and its two replicates go
    to the runner together (under --jobs they run side by side), as rows of seeds 0, 1, 2;
    a second invocation runs nothing."""
    bench = _personalization_benchmark()
    batches: list[list[tuple[int, bool]]] = []
    real_execute = sweep.execute

    def recording_execute(points, *rest, **kwargs):
        batches.append([(p.config.seed, p.replicate) for p in points])
        return real_execute(points, *rest, **kwargs)

    def fake_run(cfg, path: Path) -> dict[str, Any]:
        path.mkdir(parents=True)
        return fake_summary({"personal": 0.8}, {"personal": 0.6 + cfg.seed / 100})

    monkeypatch.setattr(sweep, "run_point", fake_run)
    monkeypatch.setattr(sweep, "execute", recording_execute)
    out = tmp_path / "results.jsonl"
    args = _bench_args(tmp_path, defaults=True)
    bench.run(args)
    bench.run(args)
    assert batches == [[(0, False), (1, True), (2, True)]]
    rows = bench.read_rows(out)
    assert [(r["seed"], r["replicate"]) for r in rows] == [(0, False), (1, True), (2, True)]
    line = next(x for x in bench.table(out).splitlines() if x.startswith("| ditto"))
    assert "| 61.0 ± 1.0 % |" in line


def test_personalization_paired_differences_are_per_seed(tmp_path: Path) -> None:
    """a − b seed by seed (rows in any order), under both client scores: the dev-weighted
    differences +2, +4, −40 and the own-split ones −5, +10, −40 points."""
    bench = _personalization_benchmark()
    size = {"backbone": "minilm", "max_train_examples": 800, "rounds": 8}

    def row(method: str, seed: int, test: float, split: float) -> dict:
        return {"federation": "c", "method": method, "size": size, "seed": seed,
                "replicate": seed > 0, "overrides": {"train.lr": 0.001}, "score": 0.5,
                "val": {"mean": 0.5}, "test": {"mean": test}, "test_split": {"mean": split}}

    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in [
        row("local", 0, 0.60, 0.50), row("local", 1, 0.60, 0.70), row("fedavg", 2, 0.9, 0.9),
        row("fedavg", 0, 0.58, 0.55), row("fedavg", 1, 0.56, 0.60), row("local", 2, 0.5, 0.5)]))
    text = bench.paired(out, [("local", "fedavg")])
    line = next(x for x in text.splitlines() if "local − fedavg" in x)
    assert "| 3 |" in line  # seeds 0, 1, 2 shared
    assert "+2.0, +4.0, -40.0" in line and "-5.0, +10.0, -40.0" in line


def test_personalization_pairs_the_other_backbone_clients_too(tmp_path: Path) -> None:
    """In a mixed-backbone federation the paired table also differences the mean score of
    the ``[[model.groups]]`` clients, seed by seed: (0.8 + 0.6)/2 − (0.5 + 0.5)/2 = +20."""
    bench = _personalization_benchmark()
    size = {"backbone": "minilm", "max_train_examples": 800, "rounds": 8}

    def row(method: str, seed: int, six: float, seven: float) -> dict:
        return {"federation": "m", "method": method, "size": size, "seed": seed,
                "replicate": seed > 0, "overrides": {"train.lr": 0.001}, "score": 0.5,
                "val": {"mean": 0.5}, "test": {"mean": 0.7}, "test_split": {"mean": 0.7},
                "per_client": {"0": 0.9, "6": six, "7": seven}, "group_clients": [6, 7]}

    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in [
        row("fedmosaic", 0, 0.8, 0.6), row("fedmosaic_nopq", 0, 0.5, 0.5)]))
    assert bench.group_mean(row("x", 0, 0.8, 0.6)) == pytest.approx(0.7)
    line = next(x for x in bench.paired(out, [("fedmosaic", "fedmosaic_nopq")]).splitlines()
                if "fedmosaic − fedmosaic_nopq" in x)
    assert line.endswith("| 20.0 % (+20.0) |")


def test_personalization_reads_each_clients_last_score_and_the_group_clients(
        tmp_path: Path) -> None:
    bench = _personalization_benchmark()
    rows = [{"round": r, "scope": "personal/clients",
             "metrics": {"accuracy": {"mean": 0.5 + r / 10}},
             "per_client": {"0": {"accuracy": 0.5 + r / 10}, "3": {"accuracy": 0.4 + r / 10}}}
            for r in (4, 8)] + [{"round": 8, "scope": "global/clients", "metrics": {},
                                 "per_client": {"0": {"accuracy": 0.0}}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.toml").write_text(
        '[model]\nbackbone = "minilm"\n[[model.groups]]\nclients = [3, 1]\n'
        'backbone = "smollm2-135m"\n')
    found = bench.client_scores_found(tmp_path, "personal")
    assert found == {"per_client": {"0": pytest.approx(1.3), "3": pytest.approx(1.2)},
                     "group_clients": [1, 3]}
    assert bench.group_mean({**found, "group_clients": [1, 3]}) == pytest.approx(1.2)
    assert bench.client_scores_found(tmp_path, None) == {}


@needs_glue
def test_a_killed_sweep_resumes_without_rerunning_finished_points(config: Path,
                                                                  tmp_path: Path) -> None:
    result = invoke("sweep", config, "--grid", "train.lr=1e-3,5e-3", "--seeds", "2",
                    "--set", "federation.rounds=2", "--output-dir", tmp_path / "whole")
    assert result.exit_code == 0, result.stderr
    (whole,) = (tmp_path / "whole").iterdir()
    killed = tmp_path / "killed"
    shutil.copytree(whole, killed)
    # as if killed in the second point's second round: no summary, the round-1 checkpoint
    second = killed / "01-lr=0.005"
    (second / "summary.json").unlink()
    shutil.rmtree(second / "checkpoints" / "resume" / "round_0002")
    status = json.loads((second / "status.json").read_text())
    (second / "status.json").write_text(json.dumps({**status, "state": "running", "round": 1}))
    shutil.rmtree(killed / "replicate-seed1")
    (killed / "sweep.json").unlink()
    first_log = (killed / "00-lr=0.001" / "run.log").read_text()
    result = invoke("sweep", "--resume", killed)
    assert result.exit_code == 0, result.stderr
    assert (killed / "00-lr=0.001" / "run.log").read_text() == first_log  # not re-run
    assert "resumed after round 1" in (second / "run.log").read_text()

    def comparable(sweep_dir: Path) -> dict:
        report = json.loads((sweep_dir / "sweep.json").read_text())
        for record in report["points"]:
            record.pop("run_dir"), record.pop("wall_seconds")
        report["replicates"].pop("runs", None)
        return report

    assert comparable(killed) == comparable(whole)
    for point in ("01-lr=0.005", "replicate-seed1"):
        assert ((killed / point / "metrics.jsonl").read_text()
                == (whole / point / "metrics.jsonl").read_text())


def test_resume_needs_a_sweep_directory_with_its_plan(tmp_path: Path) -> None:
    assert_bad_input(invoke("sweep", "--resume", tmp_path), "is not a sweep directory",
                     "no plan.toml")
    assert_bad_input(invoke("sweep", tmp_path / "x.toml", "--resume", tmp_path),
                     "give no CONFIG, --grid, --set or --output-dir")


@needs_glue
def test_personalization_resumes_a_killed_run_in_its_directory(tmp_path: Path) -> None:
    """A benchmark killed inside a run continues that run (from its resumable checkpoint,
    in its own sweep directory) when invoked again, and records what the whole run gives."""
    import argparse

    bench = _personalization_benchmark()
    out = tmp_path / "results.jsonl"
    args = argparse.Namespace(
        federation="a", methods=["fedavg"], max_train_examples=200, rounds=2, local_steps=2,
        defaults=True, set=[], backbone="tiny-bert", data_dir=str(GLUE_DIR), lrs=(0.001,),
        jobs=1, seeds=1, out=str(out), runs=str(tmp_path / "runs"))
    bench.run(args)
    (whole,) = bench.read_rows(out)
    run = Path(whole["run_dir"])
    # as if killed in round 2: no summary, no round-2 checkpoint, no result row
    (run / "summary.json").unlink()
    shutil.rmtree(run / "checkpoints" / "resume" / "round_0002")
    (run / "status.json").write_text(json.dumps({"state": "running", "round": 1}))
    out.write_text("")
    bench.run(args)
    (again,) = bench.read_rows(out)
    assert again["run_dir"] == whole["run_dir"]  # the same run, resumed
    assert len(list((tmp_path / "runs" / "a").iterdir())) == 1
    assert "resumed after round 1" in (run / "run.log").read_text()
    for key in ("val", "test", "global_dev", "per_client"):
        assert again[key] == whole[key]


def test_personalization_reuses_a_defaults_run_as_its_grid_point(tmp_path: Path) -> None:
    """A ``--defaults`` run at Ditto's default λ = 1 is the grid point (lr, λ = 1): it is
    copied under the grid's key, marked ``reused``; λ = 0.1 still runs, and a failed row
    is never reused."""
    bench = _personalization_benchmark()
    raw = bench.base_config("c", "ditto", backbone="tiny-bert", max_train=800, rounds=8)

    def point(index: int, combo: dict[str, Any]) -> sweep.Point:
        cfg, _ = sweep.checked_config(raw, sweep.as_overrides(combo))
        return sweep.Point(index, combo, cfg, "personal")

    ran = point(0, {"train.lr": 1e-3})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(tomli_w.dumps(to_toml_dict(ran.config)))
    size = {"backbone": "tiny-bert", "max_train_examples": 800, "rounds": 8}
    defaults_row = {"federation": "c", "method": "ditto", "size": {**size, "defaults": True},
                    "index": 0, "overrides": {"train.lr": 1e-3}, "seed": 0,
                    "replicate": False, "run_dir": str(run_dir), "score": 0.7}
    head = {"federation": "c", "method": "ditto", "size": size}
    grid = [point(i, c) for i, c in enumerate(expand(bench.grid("ditto", (1e-3,))))]

    failed = tmp_path / "failed.jsonl"
    failed.write_text(json.dumps({**defaults_row, "error": "diverged"}) + "\n")
    assert bench.reuse_finished(failed, head, grid) == grid

    out = tmp_path / "results.jsonl"
    out.write_text(json.dumps(defaults_row) + "\n")
    left = bench.reuse_finished(out, head, grid)
    assert [p.overrides["algorithm.lam"] for p in left] == [0.1]
    reused = json.loads(out.read_text().splitlines()[-1])
    assert reused["size"] == size and reused["reused"] == defaults_row["size"]
    assert reused["overrides"] == {"train.lr": 1e-3, "algorithm.lam": 1.0}


def test_personalization_numbers_clusters_apart_by_backbone() -> None:
    """A mixed-backbone run's clusters come from its per-backbone server summaries, the
    labels of each backbone numbered apart (a cluster never spans backbones)."""
    bench = _personalization_benchmark()
    summary = {"server_by_backbone": {"minilm": {"clusters": {"0": 1, "1": 1, "2": 0}},
                                      "smollm2-135m": {"clusters": {"3": 0}},
                                      "other": {"relevance": {}}}}
    assert bench.final_clusters(summary) == {"0": 0, "1": 0, "2": 1, "3": 2}
    assert bench.final_clusters({"clusters": {"0": 1}}) == {"0": 1}
    assert bench.final_clusters({"server_by_backbone": {"minilm": {}}}) is None


def test_the_gap_closed_is_per_seed_and_skips_a_seed_without_a_gap(tmp_path: Path) -> None:
    """(m − local) / (oracle − local) seed by seed: 0.7 between 0.6 and 0.8 closes +50 %,
    0.9 between 0.5 and 0.7 +200 %; at seed 2 the oracle does not beat `local`: n/a, and
    the mean is over seeds 0 and 1 (125 ± 106 %)."""
    bench = _personalization_benchmark()
    size = {"backbone": "minilm", "max_train_examples": 800, "rounds": 8}

    def row(method: str, seed: int, test: float) -> dict:
        return {"federation": "sst2-0.1", "method": method, "size": size, "seed": seed,
                "replicate": seed > 0, "overrides": {"train.lr": 0.001}, "score": 0.5,
                "val": {"mean": 0.5}, "test": {"mean": test, "p10": test - 0.1}}

    scores = {"local": (0.6, 0.5, 0.7), "oracle_la": (0.8, 0.7, 0.7), "fedrod": (0.7, 0.9, 0.8)}
    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(row(m, s, v[s])) + "\n"
                           for m, v in scores.items() for s in range(3)))
    text = bench.gap_closed(out, "local", "oracle_la")
    line = next(x for x in text.splitlines() if "| fedrod |" in x)
    assert "| 3 | 125.0 ± 106.1 % (+50, +200, n/a) | 125.0 ± 106.1 % (+50, +200, n/a) |" in line
    assert "| local |" not in text and "| oracle_la |" not in text


def test_paired_differences_split_by_label_mix_per_seed(tmp_path: Path) -> None:
    """Clients whose training split holds one label and the others, decided by each seed's
    own partition: at seed 0 clients 0, 1 hold one label and client 2 both; at seed 1 only
    client 0 holds one. a − b over each group, b's level beside it."""
    bench = _personalization_benchmark()
    size = {"backbone": "minilm", "max_train_examples": 800, "rounds": 8}
    mixes = {0: {"0": [5, 0], "1": [0, 7], "2": [3, 4]},
             1: {"0": [0, 9], "1": [2, 2], "2": [1, 6]}}
    scores = {"local": {0: (1.0, 1.0, 0.8), 1: (1.0, 0.6, 0.7)},
              "oracle_la": {0: (1.0, 0.9, 0.9), 1: (1.0, 0.7, 0.9)}}

    def row(method: str, seed: int) -> dict:
        per_client = dict(zip(("0", "1", "2"), scores[method][seed]))
        return {"federation": "sst2-0.1", "method": method, "size": size, "seed": seed,
                "replicate": seed > 0, "overrides": {"train.lr": 0.001}, "score": 0.5,
                "val": {"mean": 0.5}, "test": {"mean": 0.5, "p10": 0.4},
                "per_client": per_client, "client_label_counts": mixes[seed]}

    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(row(m, s)) + "\n" for m in scores for s in (0, 1)))
    line = bench.by_label_mix(out, [("oracle_la", "local")]).splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # one-label: seed 0 mean(0, -0.1) = -0.05, seed 1: 0; mixed: seed 0 +0.1, seed 1
    # mean(+0.1, +0.2) = +0.15
    assert cells[1:3] == ["oracle_la − local", "2"]
    assert cells[3] == "-2.5 ± 3.5 % (-5.0, +0.0)" and cells[5] == "2, 1"
    assert cells[4] == "100.0 ± 0.0 %"
    assert cells[6] == "12.5 ± 3.5 % (+10.0, +15.0)" and cells[8] == "1, 2"
    assert cells[7] == "72.5 ± 10.6 %"  # local on the mixed clients: 0.8, then 0.65

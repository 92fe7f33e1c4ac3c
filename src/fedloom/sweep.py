"""Hyperparameter sweeps selected on the clients' validation splits (``fedloom sweep``).

A sweep expands a cartesian grid of config overrides (``--grid train.lr=3e-4,1e-3``,
each value parsed as TOML like ``--set``), runs every point as a normal run directory
under one sweep directory ``<output>/<name>-sweep-<timestamp>/``, and selects one point.

Selection reads the clients' **validation** splits only (``partition.val_fraction > 0``):
a point's score is the mean over clients of the main metric (or ``metric``) of the
adapter each client uses — its personal adapter where the method has one, else the
global adapter (``select = "auto"``; ``"personal"`` / ``"global"`` force one) — on its
val split, i.e. ``summary[adapter]["val"][metric]["mean"]``. The clients' test scores and
the global dev score of every point are recorded in ``sweep.json`` but never read by
:func:`select`: the selected point's test numbers are an unbiased estimate, the best test
number over a grid is not. Ties go to the earlier point; a failed point (diverged, or a
setting checked only once training starts) is recorded with its error, never selected.

Every point is scored on the same validation sets: the keys that define the data (``seed``,
``data.*``, ``partition.*``) may not take more than one value in a grid. Seeds are
replicates, not candidates: with ``seeds`` N > 1 the selected point is re-run, after the
selection, at seeds ``seed + 1 … seed + N - 1`` (its own run is the base seed's replicate),
each in ``replicate-seed<k>/``, and ``sweep.json``'s ``"replicates"`` reports per seed its
clients' test mean and p10, and their mean ± sample std (ddof = 1) over the seeds.

Before any point runs, every point's configuration is validated (schema and the
algorithm's hyperparameters; a mistake is a :class:`SweepError` naming the ``--grid``
item) and the federation of every seed is loaded and partitioned.

A sweep directory keeps its plan (``plan.toml``: the base config, the grid, the selection,
the seeds), so a killed sweep resumes (``fedloom sweep --resume DIR``): finished points are
read back, not re-run, an interrupted point continues from its resumable checkpoint
(:mod:`fedloom.runtime.checkpoint`), and the rest run.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import shutil
import statistics
import tomllib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli_w
from rich.table import Table

from fedloom import algorithm_catalog
from fedloom.config import (
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    load_config,
    parse_override,
    validate,
)
from fedloom.data import DataError, TaskSpec

if TYPE_CHECKING:
    from fedloom.algorithms import Algorithm

SELECT_MODES = ("auto", "personal", "global")

#: a base config: a TOML file (the CLI) or an unvalidated dict (benchmarks, tests)
Source = Path | dict[str, Any]


class SweepError(ConfigError):
    """A bad grid or a config that cannot be swept; ``str(err)`` is one line."""


@dataclass(frozen=True)
class Axis:
    """One ``--grid key=v1,v2,...`` item: a dotted config key and its values."""

    key: str
    values: tuple[Any, ...]

    @property
    def item(self) -> str:
        return f"{self.key}={','.join(toml_value(v) for v in self.values)}"


def toml_value(value: Any) -> str:
    """``value`` as TOML text, so that ``key=<text>`` overrides parse back to ``value``."""
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def _split_values(raw: str) -> list[str]:
    """Split on commas outside brackets, braces and quotes (``[1,2],[3]`` is two values)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(raw):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(raw[start:i])
            start = i + 1
    return [*parts, raw[start:]]


def parse_axis(text: str) -> Axis:
    """``"algorithm.lam=0.1,1,10"`` -> Axis("algorithm.lam", (0.1, 1, 10))."""
    if "=" not in text:
        raise SweepError(f"--grid {text!r}: expected section.key=value1,value2,...")
    key, raw = (part.strip() for part in text.split("=", 1))
    if not re.fullmatch(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*", key):
        raise SweepError(f"--grid {text!r}: {key!r} is not a dotted config key")
    items = [item.strip() for item in _split_values(raw)]
    if not raw or not all(items):
        raise SweepError(
            f"--grid {text!r}: empty value list"
            if not raw
            else f"--grid {text!r}: empty value between commas"
        )
    values = tuple(parse_override(f"{key}={item}")[1] for item in items)
    if len({toml_value(v) for v in values}) != len(values):
        raise SweepError(f"--grid {text!r}: a value is repeated")
    return Axis(key, values)


def parse_grid(items: Iterable[str]) -> list[Axis]:
    axes = [parse_axis(item) for item in items]
    if not axes:
        raise SweepError("--grid: give at least one key=value1,value2,... to sweep")
    keys = [a.key for a in axes]
    for a in axes:
        if keys.count(a.key) > 1:
            raise SweepError(f"--grid {a.item}: {a.key} is swept twice")
        if a.key in ("name", "output_dir"):
            raise SweepError(f"--grid {a.item}: {a.key} is set by the sweep itself")
    return axes


def expand(axes: Sequence[Axis]) -> list[dict[str, Any]]:
    """Every combination, the last axis varying fastest: ``[{key: value, ...}, ...]``."""
    return [
        dict(zip([a.key for a in axes], combo))
        for combo in itertools.product(*(a.values for a in axes))
    ]


def as_overrides(point: dict[str, Any]) -> list[str]:
    return [f"{key}={toml_value(value)}" for key, value in point.items()]


def describe(point: dict[str, Any]) -> str:
    """``"algorithm.lam=0.1, train.lr=0.001"``"""
    return ", ".join(as_overrides(point))


# --- the plan: every point validated before anything runs ---------------------------------


@dataclass(frozen=True)
class Point:
    index: int
    overrides: dict[str, Any]
    config: ExperimentConfig
    #: whose scores select this point: "personal" or "global"
    adapter: str
    #: a re-run of the selected point ``index`` at another seed, never a candidate
    replicate: bool = False

    @property
    def slug(self) -> str:
        """A directory name: index and the overrides' last key segments; a replicate's
        ``replicate-seed<k>``."""
        if self.replicate:
            return f"replicate-seed{self.config.seed}"
        text = "_".join(
            f"{key.rsplit('.', 1)[-1]}={toml_value(value)}" for key, value in self.overrides.items()
        )
        return f"{self.index:02d}-" + re.sub(r"[^A-Za-z0-9_.=+-]", "", text)[:80]

    def at_seed(self, seed: int) -> Point:
        """This point as a replicate at ``seed`` (the federation and sampling stream change)."""
        return replace(self, config=self.config.model_copy(update={"seed": seed}), replicate=True)


def replicates(point: Point, seeds: int) -> list[Point]:
    """``point`` at the seeds after its own: ``seed + 1 … seed + seeds - 1``."""
    return [point.at_seed(point.config.seed + k) for k in range(1, seeds)]


@dataclass(frozen=True)
class Plan:
    base: ExperimentConfig
    axes: tuple[Axis, ...]
    points: tuple[Point, ...]
    select: str
    metric: str
    #: runs of the selected point, its own included (``--seeds``)
    seeds: int = 1


def _load(source: Source, overrides: list[str]) -> ExperimentConfig:
    if isinstance(source, dict):
        return validate(apply_overrides(copy.deepcopy(source), overrides))
    return load_config(source, overrides)


def named_config(source: Source, overrides: list[str]) -> tuple[ExperimentConfig, None]:
    """The config, its algorithm name and hyperparameter names checked against the catalog
    (:func:`fedloom.algorithm_catalog.check`: no torch, no algorithm built)."""
    cfg = _load(source, overrides)
    algorithm_catalog.check(cfg.algorithm.name, cfg.algorithm.hyperparameters)
    return cfg, None


def checked_config(source: Source, overrides: list[str]) -> tuple[ExperimentConfig, Algorithm]:
    """The config and its algorithm, hyperparameters checked (no data, no model)."""
    from fedloom.experiment import build_algorithm

    cfg = _load(source, overrides)
    return cfg, build_algorithm(cfg)


def checked_grid(
    source: Source,
    axes: Sequence[Axis],
    overrides: list[str],
    load: Callable[[Source, list[str]], tuple[ExperimentConfig, Any]],
) -> tuple[ExperimentConfig, list[tuple[dict[str, Any], ExperimentConfig, Any]]]:
    """The base config and every point's (combo, config, what ``load`` built), each checked
    by ``load``: the base config, each --grid value alone, then every point; SweepError
    names the --grid item or point."""
    base, _ = load(source, overrides)
    for axis in axes:
        for value in axis.values:
            try:
                cfg, _ = load(source, overrides + as_overrides({axis.key: value}))
                if axis.key in _VALIDATION_KEYS:
                    needs_validation(cfg)
            except ConfigError as err:
                raise SweepError(f"--grid {axis.item}: {err}") from None
    points = []
    for combo in expand(axes):
        try:
            points.append((combo, *load(source, overrides + as_overrides(combo))))
        except ConfigError as err:
            raise SweepError(f"--grid point {describe(combo)}: {err}") from None
    return base, points


def adapter_kind(alg: Algorithm, select: str) -> str:
    """ "personal" or "global": whose val scores select a point of ``alg``'s runs."""
    if select == "auto":
        return "personal" if alg.personalized else "global"
    if select == "personal" and not alg.personalized:
        raise SweepError(f"--select personal: {alg.name} has no personal adapters")
    if select == "global" and not alg.has_global:
        raise SweepError(f"--select global: {alg.name} has no global adapter")
    return select


def task_spec(cfg: ExperimentConfig) -> TaskSpec:
    """``cfg``'s task (its metrics), without loading its data."""
    from fedloom.federation import multi_task, resolve_task

    if cfg.partition.tasks is None:
        return resolve_task(cfg.data)
    return multi_task(cfg.partition.tasks.names)


#: the keys without which there is nothing to select on
_VALIDATION_KEYS = ("partition.val_fraction", "eval.clients")

#: the top-level keys that define the clients' data, hence their validation sets
DATA_SECTIONS = ("seed", "data", "partition")


def refuse_data_axes(axes: Sequence[Axis]) -> None:
    """A key that defines the data may not take two values: the points would be scored on
    different validation sets (one value is a fixed setting, as ``--set``)."""
    for axis in axes:
        section = axis.key.split(".", 1)[0]
        if len(axis.values) < 2 or section not in DATA_SECTIONS:
            continue
        why = (
            f"--grid {axis.item}: {axis.key} defines the clients' data, so the points "
            "would be scored on different validation sets; "
        )
        if section == "seed":
            raise SweepError(why + "seeds are replicates, not candidates: use --seeds N")
        raise SweepError(why + "fix it with --set and sweep each value on its own")


def needs_validation(cfg: ExperimentConfig) -> None:
    if cfg.partition.val_fraction <= 0:
        raise SweepError(
            "partition.val_fraction: is 0, and a sweep selects on the clients' validation "
            "splits; set it (e.g. --set partition.val_fraction=0.2)"
        )
    if not cfg.eval.clients:
        raise SweepError("eval.clients: is false; a sweep scores every client's validation split")


def plan(
    source: Source,
    axes: Sequence[Axis],
    overrides: Sequence[str] = (),
    *,
    select: str = "auto",
    metric: str | None = None,
    seeds: int = 1,
) -> Plan:
    """Validate the grid's keys, the base config, each --grid value alone, every point, and
    the federation of each of the ``seeds`` seeds; raises ConfigError / SweepError (one
    line, naming the --grid item) before anything runs."""
    if select not in SELECT_MODES:
        raise SweepError(f"--select {select!r}: choose one of {', '.join(SELECT_MODES)}")
    if seeds < 1:
        raise SweepError(f"--seeds {seeds}: must be at least 1")
    refuse_data_axes(axes)
    overrides = list(overrides)
    checked_grid(source, axes, overrides, named_config)  # a misspelt name answers before torch
    base, built = checked_grid(source, axes, overrides, checked_config)
    points = []
    for index, (combo, cfg, alg) in enumerate(built):
        needs_validation(cfg)  # not swept, so the base config's
        task = task_spec(cfg)
        metric = metric or task.main_metric
        if metric not in task.metrics:
            raise SweepError(
                f"--metric {metric!r}: {task.name} is scored by {', '.join(task.metrics)}"
            )
        points.append(Point(index, combo, cfg, adapter_kind(alg, select)))
    assert metric is not None  # at least one point (an axis has at least one value)
    check_federations(points[0], seeds)
    return Plan(base, tuple(axes), tuple(points), select, metric, seeds)


def check_federations(point: Point, seeds: int) -> None:
    """Load and partition the data of ``point`` at each of the ``seeds`` seeds (no model):
    every point shares it (no key that defines the data varies), and an impossible
    partition or a missing data file stops the sweep before it runs."""
    from fedloom.federation import FederatedData

    FederatedData.build(point.config)
    for replicate in replicates(point, seeds):
        try:
            FederatedData.build(replicate.config)
        except (ConfigError, DataError) as err:
            raise SweepError(f"--seeds {seeds}: seed {replicate.config.seed}: {err}") from None


# --- scores of one run ----------------------------------------------------------------------


def point_record(
    point: Point,
    metric: str,
    run_dir: Path,
    summary: dict[str, Any] | None,
    error: str | None = None,
) -> dict[str, Any]:
    """What sweep.json keeps of a point: its val score (``score``: what selection reads),
    and its clients' test scores (``test``, as ``client_mode`` scored them; ``test_split``,
    their own test splits, beside dev-weighted scores) and global dev score (recorded,
    never selected on)."""
    record: dict[str, Any] = {
        "index": point.index,
        "overrides": point.overrides,
        "seed": point.config.seed,
        "replicate": point.replicate,
        "run_dir": str(run_dir),
        "adapter": point.adapter,
        "metric": metric,
        "val": None,
        "score": None,
        "test": None,
        "test_split": None,
        "client_mode": None,
        "global_dev": None,
        "wall_seconds": None,
    }
    if summary is None:
        return {**record, "error": error or "no summary"}
    scores = summary.get(point.adapter, {})
    val = scores.get("val", {}).get(metric)
    record.update(
        val=val,
        score=val["mean"] if val else None,
        test=scores.get("clients", {}).get(metric),
        test_split=scores.get("clients_split", {}).get(metric),
        client_mode=summary.get("client_mode"),
        global_dev=summary.get("global", {}).get("dev", {}).get(metric),
        wall_seconds=summary.get("wall_seconds"),
    )
    if record["score"] is None:
        record["error"] = f"no finite {point.adapter}/val {metric} mean in summary.json"
    return record


#: the metrics a lower value of is better (a loss, a negative log-likelihood)
LOWER_IS_BETTER = frozenset({"loss", "nll", "perplexity"})


def select(records: Sequence[dict[str, Any]]) -> int | None:
    """The index of the record with the best validation score (``record["score"]``: the
    highest, the lowest for a metric of :data:`LOWER_IS_BETTER`; the earlier one on a
    tie); None when no point has one. Test scores and replicates (``record["replicate"]``)
    play no part."""
    scored = [r for r in records if r.get("score") is not None and not r.get("replicate")]
    if not scored:
        return None
    sign = -1.0 if scored[0].get("metric") in LOWER_IS_BETTER else 1.0
    return max(scored, key=lambda r: (sign * r["score"], -r["index"]))["index"]


# --- running ---------------------------------------------------------------------------------


def run_point(cfg: ExperimentConfig, path: Path) -> dict[str, Any]:
    """One point as a normal run directory at ``path``; returns its summary. A point that
    already ran there (a resumed sweep) is not run again: a finished run's summary is read
    back, an unfinished one continues from its resumable checkpoint, one without a usable
    checkpoint starts over."""
    from fedloom.experiment import Experiment
    from fedloom.runtime.checkpoint import ResumeError
    from fedloom.runtime.rundir import RunDir, read_status
    from fedloom.server import simulate

    if path.exists():
        status = read_status(path) or {}
        if status.get("state") == "finished" and (path / "summary.json").is_file():
            return json.loads((path / "summary.json").read_text(encoding="utf-8"))
        try:
            return simulate(Experiment.build(cfg), RunDir(path), resume=True)
        except ResumeError:
            shutil.rmtree(path)
    path.mkdir(parents=True)
    return simulate(Experiment.build(cfg), RunDir(path))


def _attempt(cfg: ExperimentConfig, path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A point's summary, or the error that stopped it: a diverged run, or a setting only
    checked once training starts (ValueError, e.g. L2GD's step θ > 1 for this lr)."""
    try:
        return run_point(cfg, path), None
    except (ConfigError, DataError):
        raise  # bad input (e.g. a backbone that cannot load): the sweep stops
    except (FloatingPointError, RuntimeError, ValueError) as err:
        return None, f"{type(err).__name__}: {err}"


def _worker() -> None:
    """A point's process: single-threaded torch, the CLI's warning filter."""
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")


def execute(
    points: Sequence[Point],
    sweep_dir: Path,
    metric: str,
    *,
    jobs: int = 1,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``points`` (``jobs`` processes of single-threaded torch when > 1) into
    ``sweep_dir/<slug>/``; returns their records in point order, calling ``on_record`` as
    each finishes."""
    if jobs < 1:
        raise SweepError(f"--jobs {jobs}: must be at least 1")
    done: dict[str, dict[str, Any]] = {}

    def finish(point: Point, outcome: tuple[dict[str, Any] | None, str | None]) -> None:
        done[point.slug] = point_record(point, metric, sweep_dir / point.slug, *outcome)
        if on_record:
            on_record(done[point.slug])

    if jobs == 1:
        for p in points:
            finish(p, _attempt(p.config, sweep_dir / p.slug))
    else:
        with ProcessPoolExecutor(
            jobs, mp_context=get_context("spawn"), initializer=_worker
        ) as pool:
            futures = {pool.submit(_attempt, p.config, sweep_dir / p.slug): p for p in points}
            try:
                for future in as_completed(futures):
                    finish(futures[future], future.result())
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    return [done[p.slug] for p in points]


def mean_std(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """Mean and sample standard deviation (ddof = 1) of the values present (None is
    missing); ``n`` of them, ``std`` None under two."""
    present = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(present) if present else None,
        "std": statistics.stdev(present) if len(present) > 1 else None,
        "n": len(present),
    }


def replicates_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """sweep.json's ``"replicates"``: per seed (the selected run first) the selected
    adapter's val mean, clients' test mean and p10 and the global dev score (None where
    missing); and the mean ± std over seeds of the clients' test mean and of their p10."""
    per_seed = [
        {
            "seed": r["seed"],
            "run_dir": r["run_dir"],
            "val_mean": r["score"],
            "test_mean": stat_value(r["test"]),
            "test_p10": stat_value(r["test"], "p10"),
            "global_dev": stat_value(r["global_dev"]),
            "error": r.get("error"),
        }
        for r in runs
    ]
    return {
        "adapter": runs[0]["adapter"],
        "seeds": [r["seed"] for r in per_seed],
        "runs": per_seed,
        "test_mean": mean_std(r["test_mean"] for r in per_seed),
        "test_p10": mean_std(r["test_p10"] for r in per_seed),
    }


@dataclass
class SweepResult:
    directory: Path
    plan: Plan
    records: list[dict[str, Any]]
    selected: int | None = None
    #: the selected point's runs at the seeds after its own
    replicates: list[dict[str, Any]] = field(default_factory=list)
    #: every point and every replicate has run
    finished: bool = False

    def replicate_runs(self) -> list[dict[str, Any]]:
        """The selected point's records, its own run first; none before the selection."""
        if self.selected is None:
            return []
        return [self.records[self.selected], *self.replicates]

    def to_json(self) -> dict[str, Any]:
        runs = self.replicate_runs()
        return {
            "name": self.plan.base.name,
            "grid": {a.key: list(a.values) for a in self.plan.axes},
            "select": self.plan.select,
            "metric": self.plan.metric,
            "selected_on": "the clients' validation splits (mean over clients)",
            "finished": self.finished,
            "points": self.records,
            "selected": self.selected,
            "replicates": replicates_summary(runs) if runs else None,
        }

    def write(self) -> None:
        from fedloom.runtime.rundir import atomic_write

        text = json.dumps(self.to_json(), indent=2) + "\n"
        atomic_write(self.directory / "sweep.json", text.encode())


def run(
    the_plan: Plan,
    sweep_dir: Path,
    *,
    jobs: int = 1,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> SweepResult:
    """Run every point, select on validation, run the selected point's replicates (the
    plan's seeds), write sweep.json (also after each run, unselected until the last point,
    ``"finished": false`` until the last replicate) and sweep.md."""
    from fedloom.runtime.rundir import atomic_write

    atomic_write(sweep_dir / PLAN_FILE, tomli_w.dumps(plan_record(the_plan)).encode())
    result = SweepResult(sweep_dir, the_plan, [])

    def recorded(record: dict[str, Any]) -> None:
        (result.replicates if record["replicate"] else result.records).append(record)
        result.write()
        if on_record:
            on_record(record)

    result.records = execute(
        the_plan.points, sweep_dir, the_plan.metric, jobs=jobs, on_record=recorded
    )
    result.selected = select(result.records)
    if result.selected is not None:
        result.replicates = execute(
            replicates(the_plan.points[result.selected], the_plan.seeds),
            sweep_dir,
            the_plan.metric,
            jobs=jobs,
            on_record=recorded,
        )
    result.finished = True
    result.write()
    atomic_write(sweep_dir / "sweep.md", (markdown_table(result) + "\n").encode())
    return result


#: what a sweep directory keeps of its plan, so that ``fedloom sweep --resume`` can rebuild it
PLAN_FILE = "plan.toml"


def plan_record(the_plan: Plan) -> dict[str, Any]:
    """The plan as :data:`PLAN_FILE` holds it: the base config (after ``--set``), the grid
    items, the selection and the seeds."""
    from fedloom.config import to_toml_dict

    return {
        "grid": [a.item for a in the_plan.axes],
        "select": the_plan.select,
        "metric": the_plan.metric,
        "seeds": the_plan.seeds,
        "base": to_toml_dict(the_plan.base),
    }


def resumed_plan(sweep_dir: Path) -> Plan:
    """The plan of the sweep in ``sweep_dir``, from its :data:`PLAN_FILE`; SweepError (one
    line) when there is none."""
    path = sweep_dir / PLAN_FILE
    if not path.is_file():
        raise SweepError(
            f"--resume: {sweep_dir} is not a sweep directory that can resume (no {PLAN_FILE})"
        )
    saved = tomllib.loads(path.read_text(encoding="utf-8"))
    return plan(
        saved["base"],
        parse_grid(saved["grid"]),
        select=saved["select"],
        metric=saved["metric"],
        seeds=saved["seeds"],
    )


def create_dir(output_dir: str | Path, name: str) -> Path:
    from fedloom.runtime.rundir import RunDir

    return RunDir.create(output_dir, f"{name}-sweep").path


# --- tables ----------------------------------------------------------------------------------


def stat_value(stats: dict[str, float] | float | None, key: str = "mean") -> float | None:
    """``stats[key]`` of a client-score summary, a plain score as is; None when missing
    or non-finite (summary.json writes those as null)."""
    if stats is None:
        return None
    return stats if isinstance(stats, float | int) else stats.get(key)


def _cell(stats: dict[str, float] | float | None, key: str = "mean") -> str:
    value = stat_value(stats, key)
    return "—" if value is None else f"{value:.4f}"


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else toml_value(value)


def table_rows(result: SweepResult) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per point the grid values and val mean; the test mean / p10 / min
    and global dev only for the selected point."""
    header = [
        "",
        *(a.key for a in result.plan.axes),
        "adapter",
        "val mean",
        "test mean",
        "test p10",
        "test min",
        "global dev",
        "wall s",
    ]
    rows = []
    for r in result.records:
        chosen = r["index"] == result.selected
        shown = (
            (
                _cell(r["test"]),
                _cell(r["test"], "p10"),
                _cell(r["test"], "min"),
                _cell(r["global_dev"]),
            )
            if chosen
            else ("", "", "", "")
        )
        wall = f"{r['wall_seconds']:.0f}" if r["wall_seconds"] is not None else "—"
        rows.append(
            [
                "★" if chosen else "",
                *(_shown(r["overrides"][a.key]) for a in result.plan.axes),
                r["adapter"],
                _cell(r["val"]) if r["score"] is not None else "failed",
                *shown,
                wall,
            ]
        )
    return header, rows


def _plus_minus(stats: dict[str, Any]) -> str:
    if stats["mean"] is None:
        return "—"
    return f"{stats['mean']:.4f} ± " + ("—" if stats["std"] is None else f"{stats['std']:.4f}")


def replicates_line(result: SweepResult) -> str | None:
    """``"selected point, mean ± std over 3 seeds (0, 1, 2): ..."``; None for one seed."""
    runs = result.replicate_runs()
    if len(runs) < 2:
        return None
    summary = replicates_summary(runs)
    seeds = ", ".join(map(str, summary["seeds"]))
    unscored = len(runs) - summary["test_mean"]["n"]
    return (
        f"selected point, mean ± std over {len(runs)} seeds ({seeds}): test mean "
        f"{_plus_minus(summary['test_mean'])}, test p10 {_plus_minus(summary['test_p10'])} "
        f"(sample std{f'; {unscored} without a score' if unscored else ''})"
    )


def rich_table(result: SweepResult) -> Table:
    header, rows = table_rows(result)
    caption = "\n".join(filter(None, (replicates_line(result), str(result.directory))))
    table = Table(
        title=f"sweep {result.plan.base.name}: {result.plan.metric}, selected (★) on "
        "the clients' validation splits",
        caption=caption,
    )
    for i, column in enumerate(header):
        table.add_column(column, justify="left" if 0 < i <= len(result.plan.axes) + 1 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def markdown_table(result: SweepResult) -> str:
    header, rows = table_rows(result)
    lines = [
        (
            f"{result.plan.metric} (mean over clients), selected (★) on the clients' "
            "validation splits; test scores of the selected point only\n"
        ),
        "| " + " | ".join(header) + " |",
        "|"
        + "|".join(
            "---" if 0 < i <= len(result.plan.axes) + 1 else "---:" for i in range(len(header))
        )
        + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    line = replicates_line(result)
    lines += [f"\n{line}"] if line else []
    failed = [r for r in [*result.records, *result.replicates] if r.get("error")]
    lines += [f"\n{_name(r)} ({r['run_dir']}): {r['error']}" for r in failed]
    return "\n".join(lines)


def _name(record: dict[str, Any]) -> str:
    """``"point 3"``, or ``"replicate seed 2 of point 3"``."""
    point = f"point {record['index']}"
    return f"replicate seed {record['seed']} of {point}" if record["replicate"] else point


def progress_line(record: dict[str, Any], total: int) -> str:
    """One line per finished run: its point's overrides and validation score (or its error)."""
    head = f"point {record['index'] + 1}/{total} ({describe(record['overrides'])})"
    if record.get("replicate"):
        head = f"replicate seed {record['seed']} of {head}"
    if record["score"] is None:
        return f"{head}: failed: {record.get('error')}"
    return (
        f"{head}: {record['adapter']} val {record['metric']} {record['score']:.4f} "
        f"({record['wall_seconds']:.0f} s)"
    )

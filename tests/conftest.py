"""Shared fixtures: the real GLUE directory, a marker for the tests that read it, and a
small-config builder.

A test that reads GLUE data it cannot find is skipped, or fails where FEDLOOM_REQUIRE_DATA=1
(CI sets it: there, a missing ``../shared/data/glue`` must not pass as skipped tests).

Torch runs single-threaded in the tests (override with FEDLOOM_TEST_THREADS): the models
here are tiny, and on a busy 2-core machine two OpenMP threads fighting another process
made a tiny-bert simulation ~80x slower than one thread.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_THREADS = os.environ.get("FEDLOOM_TEST_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", _THREADS)

import torch

torch.set_num_threads(int(_THREADS))

from fedloom.config import ExperimentConfig, apply_overrides, validate

GLUE_DIR = Path(
    os.environ.get("FEDLOOM_GLUE_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "glue")
)
#: ``@needs_glue`` (MRPC) or ``@needs_glue("STS-B", ...)``: the test reads those GLUE tasks
#: and runs only where they are there (see :func:`require_glue`)
needs_glue = pytest.mark.needs_glue


def missing_glue(tasks: tuple[str, ...]) -> Path | None:
    """The training file of the first of ``tasks`` that is not in GLUE_DIR, if any."""
    paths = (GLUE_DIR / task / "train.tsv" for task in tasks)
    return next((path for path in paths if not path.is_file()), None)


def require_glue(*tasks: str) -> Path:
    """GLUE_DIR, once the GLUE ``tasks`` (MRPC if none are named) are there. Without them
    the calling test is skipped, or fails where FEDLOOM_REQUIRE_DATA=1."""
    missing = missing_glue(tasks or ("MRPC",))
    if missing is not None:
        why = f"{missing} (GLUE data) not present"
        if os.environ.get("FEDLOOM_REQUIRE_DATA") == "1":
            pytest.fail(f"{why}; FEDLOOM_REQUIRE_DATA=1 requires it", pytrace=False)
        pytest.skip(why)
    return GLUE_DIR


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_glue(*tasks): the test reads these GLUE tasks "
                            "(MRPC if none are named); see conftest.require_glue")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or fail) a ``needs_glue`` test before its fixtures read any data."""
    for mark in item.iter_markers("needs_glue"):
        require_glue(*mark.args)


#: A tiny-bert federated run on a small MRPC subset: 60 training examples over 3 clients.
TINY_RAW: dict[str, Any] = {
    "name": "tiny",
    "seed": 0,
    "data": {
        "task": "MRPC",
        "data_dir": str(GLUE_DIR),
        "max_train_examples": 60,
        "max_dev_examples": 30,
        "max_length": 64,
    },
    "partition": {"scheme": "iid", "num_clients": 3, "min_size": 5, "test_fraction": 0.2},
    # the tests check the math in float32 on every machine ("auto", the default, is bf16
    # on CPUs with native bf16); tests of the precision itself set it
    "model": {"backbone": "tiny-bert", "precision": "fp32"},
    "algorithm": {"name": "fedavg"},
    "federation": {"rounds": 2},
    "train": {"batch_size": 8, "local_steps": 2, "lr": 5e-3},
    "eval": {"every": 1, "batch_size": 32},
    # the gradient diagnostics (2 extra forward/backward batches per client and round, the
    # product's default every round) only where a test reads them: it sets every = 1
    "diagnostics": {"every": 0},
}


def tiny_raw(*overrides: str, output_dir: Path | None = None) -> dict[str, Any]:
    """The raw (unvalidated) tiny config with ``section.key=value`` overrides applied."""
    raw = copy.deepcopy(TINY_RAW)
    if output_dir is not None:
        raw["output_dir"] = str(output_dir)
    return apply_overrides(raw, list(overrides))


def identical(a: Any, b: Any) -> bool:
    """Nested dicts/lists of tensors and values, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(identical(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


def run_tiny_cli(tmp_path: Path, *overrides: str) -> Any:
    """``fedloom run`` of the tiny config (6 clients) with ``overrides``, writing under
    ``tmp_path/runs``; the CliRunner's result."""
    import tomli_w
    from typer.testing import CliRunner

    from fedloom.cli import app

    config = tmp_path / "tiny.toml"
    config.write_text(tomli_w.dumps(tiny_raw("partition.num_clients=6", *overrides)))
    return CliRunner().invoke(
        app,
        ["run", "--no-report", str(config), "--output-dir", str(tmp_path / "runs")],
        catch_exceptions=False,
    )


def tiny_config(*overrides: str, output_dir: Path | None = None) -> ExperimentConfig:
    return validate(tiny_raw(*overrides, output_dir=output_dir))


@pytest.fixture
def glue_dir() -> Path:
    return require_glue()


@pytest.fixture
def make_config(tmp_path: Path):
    """``make_config("train.lr=0.01", ...)`` -> validated tiny config writing under tmp_path."""

    def make(*overrides: str) -> ExperimentConfig:
        return tiny_config(*overrides, output_dir=tmp_path / "runs")

    return make



#: the slowest tests (minutes each, mostly waiting on Flower's and Ray's processes), by
#: file and name prefix, longest first, and the files with many tests of tens of seconds
LONGEST = (
    ("test_flower_runtime.py", "test_loopback_flower_runs"),
    ("test_flower_runtime.py", "test_loopback_secure_aggregation"),
    ("test_own_data_nodes.py", "test_serve_and_join"),
    ("test_flower_runtime.py", "test_sigterm_stops"),
)
SLOW_FILES = ("test_ray_runtime.py", "test_cli.py", "test_docs.py", "test_own_data_nodes.py")


def _rank(item: pytest.Item) -> int:
    for rank, (file, prefix) in enumerate(LONGEST):
        if item.path.name == file and item.name.startswith(prefix):
            return rank
    return len(LONGEST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests first, then the slow files' tests, then the rest, each group in
    collection order. pytest-xdist's worksteal scheduler gives each worker one contiguous
    n-th of the collection, so the first worker runs the Flower deployments one after
    another while the others run the in-process tests and then steal from the end of its
    queue. Side by side they are slower on 2 cores: dealt one to each of four workers, each
    deployment took 1.7 to 3.8 times as long and the suite 680 s against 593 s."""
    items.sort(key=lambda item: (_rank(item), item.path.name not in SLOW_FILES))

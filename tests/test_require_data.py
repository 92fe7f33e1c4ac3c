"""A test that reads GLUE data it cannot find is skipped, but fails where
FEDLOOM_REQUIRE_DATA=1 (CI's .ci/run sets it): conftest's require_glue, its ``needs_glue``
marker and its ``glue_dir`` fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
from conftest import require_glue

TESTS = Path(__file__).resolve().parent

THREE_WAYS = '''
from conftest import needs_glue


@needs_glue
def test_marked():
    pass


@needs_glue("STS-B")
def test_marked_with_a_task():
    pass


def test_fixture(glue_dir):
    pass
'''


@pytest.fixture
def glue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty GLUE directory standing in for conftest's."""
    monkeypatch.setattr(conftest, "GLUE_DIR", tmp_path)
    return tmp_path


def add_task(glue: Path, task: str) -> None:
    (glue / task).mkdir()
    (glue / task / "train.tsv").write_text("header\n")


@pytest.mark.parametrize("required", ["", "0"])
def test_missing_data_skips(glue: Path, monkeypatch: pytest.MonkeyPatch, required: str) -> None:
    monkeypatch.setenv("FEDLOOM_REQUIRE_DATA", required)
    with pytest.raises(pytest.skip.Exception, match="MRPC/train.tsv .GLUE data. not present$"):
        require_glue()


def test_missing_data_fails_where_required(glue: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDLOOM_REQUIRE_DATA", "1")
    add_task(glue, "MRPC")
    with pytest.raises(pytest.fail.Exception,
                       match="STS-B/train.tsv .GLUE data. not present; FEDLOOM_REQUIRE_DATA=1 "
                             "requires it$"):
        require_glue("MRPC", "STS-B")


def test_present_data_is_the_glue_dir(glue: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDLOOM_REQUIRE_DATA", "1")
    add_task(glue, "MRPC")
    add_task(glue, "STS-B")
    assert require_glue() == require_glue("MRPC", "STS-B") == glue


def test_the_marker_and_the_fixture_fail_where_data_is_required(tmp_path: Path) -> None:
    """A pytest of its own: conftest reads FEDLOOM_GLUE_DIR when it is imported."""
    (tmp_path / "test_three_ways.py").write_text(THREE_WAYS)
    # no tracebacks, and a short summary wide enough to hold each whole message once
    env = {**os.environ, "FEDLOOM_GLUE_DIR": str(tmp_path / "no_glue"),
           "FEDLOOM_REQUIRE_DATA": "1", "PYTHONPATH": str(TESTS), "COLUMNS": "1000"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
         "--tb=no", "-rE", "test_three_ways.py"],
        check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "3 errors" in result.stdout, result.stdout
    assert result.stdout.count("FEDLOOM_REQUIRE_DATA=1 requires it") == 3, result.stdout

"""Issue 8, part A, below the CLI: algorithm hyperparameters type-checked by their dataclass
fields, Krum/Multi-Krum against the clients sampled per round, the run status file and one
file mode for every result file."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from fedloom import algorithms
from fedloom.algorithms import AlgorithmError, register
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import description, hyperparameters
from fedloom.config import ConfigError, validate
from fedloom.experiment import build_algorithm
from fedloom.runtime.rundir import RunDir, atomic_write, read_status, unfinished_warning

# --- hyperparameters checked by type, for every algorithm --------------------------------


def a_wrong_value(hp) -> object:
    """A value of the wrong type for ``hp``: a string for numbers, a bool otherwise."""
    return True if hp.expected.startswith(("a string", "one of")) else "abc"


@pytest.mark.parametrize("name", algorithms.available())
def test_every_hyperparameter_of_every_algorithm_is_type_checked(name: str) -> None:
    for hp in hyperparameters(name):
        with pytest.raises(AlgorithmError) as info:
            algorithms.create(name, **{hp.name: a_wrong_value(hp)})
        message = str(info.value)
        assert message.startswith(f"algorithm.{hp.name}: expected "), message
        assert name in message


@pytest.mark.parametrize(
    ("name", "hp", "fragment"),
    [
        ("fedprox", {"proximal_mu": "abc"}, "algorithm.proximal_mu: expected a number for fedprox (got 'abc')"),
        ("fedprox", {"proximal_mu": True}, "algorithm.proximal_mu: expected a number"),
        ("fedavgm", {"server_momentum": [0.9]}, "algorithm.server_momentum: expected a number"),
        ("fedavg", {"weighting": 1}, "algorithm.weighting: expected one of 'examples', 'uniform', 'capped'"),
        ("scaffold", {"option": "III"}, "algorithm.option: expected one of 'auto', 'I', 'II'"),
        ("fedadam", {"eta": "1e-2"}, "algorithm.eta: expected a number"),
    ],
)
def test_a_wrong_type_names_the_key_and_the_expected_type(name: str, hp: dict, fragment: str) -> None:
    with pytest.raises(AlgorithmError, match="^" + fragment.replace("(", r"\(").replace(")", r"\)")):
        algorithms.create(name, **hp)


def test_several_bad_hyperparameters_on_one_line() -> None:
    with pytest.raises(AlgorithmError) as info:
        algorithms.create("fedprox", proximal_mu="abc", weighting=3, lr=0.1)
    parts = str(info.value).split("; ")
    assert [p.split(":")[0] for p in parts] == ["algorithm.proximal_mu", "algorithm.weighting",
                                                "algorithm.lr"]


def test_an_int_is_a_float_hyperparameter() -> None:
    alg = algorithms.create("fedprox", proximal_mu=1)
    assert alg.proximal_mu == 1.0 and isinstance(alg.proximal_mu, float)


@register("test-hardening-new")
@dataclass(frozen=True)
class NewAlgorithm(FedAvg):
    """A future algorithm: checked from its fields alone, nothing registered twice."""

    rho: float = 0.5
    steps: int = 3
    mode: Literal["a", "b"] = "a"
    names: list[str] = dataclasses.field(default_factory=list)
    patterns: tuple[str, ...] = ()


def test_a_new_algorithm_is_checked_from_its_fields() -> None:
    assert algorithms.create("test-hardening-new", rho=1, steps=2, names=["x"]).rho == 1.0
    # a TOML array fills a tuple field; its items are checked as strictly
    assert algorithms.create("test-hardening-new", patterns=["lora_A"]).patterns == ("lora_A",)
    with pytest.raises(AlgorithmError, match="algorithm.patterns: expected a list of a string"):
        algorithms.create("test-hardening-new", patterns=[True])
    for hp, fragment in [({"rho": "x"}, "algorithm.rho: expected a number"),
                         ({"steps": 2.0}, "algorithm.steps: expected an integer"),
                         ({"mode": "c"}, "algorithm.mode: expected one of 'a', 'b'"),
                         ({"names": "x"}, "algorithm.names: expected a list of a string")]:
        with pytest.raises(AlgorithmError, match=fragment):
            algorithms.create("test-hardening-new", **hp)
    assert description("test-hardening-new") == (
        "A future algorithm: checked from its fields alone, nothing registered twice.")
    listed = {h.name: h for h in hyperparameters("test-hardening-new")}
    assert listed["rho"].default == 0.5 and listed["names"].default == []


def test_descriptions_come_from_the_docstrings() -> None:
    assert description("fedavg").startswith("FedAvg (McMahan et al. 2017")
    assert "\n" not in description("qfedavg")
    assert all(description(n) for n in algorithms.available())


# --- Krum / Multi-Krum / trimmed mean against the clients sampled per round -----------------------------


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"algorithm": {"name": "krum"}, "aggregation": {"num_malicious_nodes": 1}},
         "aggregation.num_malicious_nodes"),
        ({"algorithm": {"name": "fedavg"}, "aggregation": {"rule": "krum"},
          "partition": {"num_clients": 2}}, "aggregation.num_malicious_nodes"),
        ({"algorithm": {"name": "multikrum"}, "aggregation": {"num_malicious_nodes": 2},
          "partition": {"num_clients": 10}, "federation": {"fraction": 0.5}},
         "aggregation.num_malicious_nodes"),
        ({"algorithm": {"name": "multikrum"}, "aggregation": {"num_nodes_to_select": 4}},
         "aggregation.num_nodes_to_select"),
        # 0.2 x 3 sampled clients trims floor(0.6) = 0: a silent plain mean
        ({"algorithm": {"name": "trimmed_mean"}}, "aggregation.beta"),
        ({"algorithm": {"name": "fedadam"}, "aggregation": {"rule": "trimmed_mean", "beta": 0.1},
          "partition": {"num_clients": 9}}, "aggregation.beta"),
        ({"algorithm": {"name": "krum"}, "aggregation": {"num_malicious_nodes": 1.5}},
         "aggregation.num_malicious_nodes"),
        ({"algorithm": {"name": "krum"}, "aggregation": {"num_malicious_nodes": True}},
         "aggregation.num_malicious_nodes"),
    ],
)
def test_robust_rules_the_federation_cannot_satisfy(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: "):
        build_algorithm(validate(raw))


def test_robust_rules_the_federation_satisfies() -> None:
    build_algorithm(validate({"algorithm": {"name": "krum"}}))  # 3 > 2
    build_algorithm(validate({"algorithm": {"name": "trimmed_mean"},
                              "aggregation": {"beta": 0.34}}))  # trims 1
    build_algorithm(validate({"algorithm": {"name": "trimmed_mean"},
                              "aggregation": {"beta": 0.0}}))  # asked for
    build_algorithm(validate({"algorithm": {"name": "multikrum"},
                              "aggregation": {"num_malicious_nodes": 2, "num_nodes_to_select": 3},
                              "partition": {"num_clients": 10}, "federation": {"fraction": 0.7}}))


# --- status.json ---------------------------------------------------------------------------


def test_status_through_a_finished_run(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "x")
    assert read_status(run.path) is None
    with run.tracking(rounds=3):
        assert read_status(run.path)["state"] == "running"
        run.write_status("running", round_=1)
        status = read_status(run.path)
        assert (status["state"], status["round"], status["rounds"], status["ended"]) == (
            "running", 1, 3, None)
    status = read_status(run.path)
    assert status["state"] == "finished" and status["round"] == 1 and status["error"] is None
    assert status["started"] <= status["updated"] == status["ended"]
    assert status["pid"] == os.getpid()
    assert unfinished_warning(run.path) is None


def test_status_of_a_failed_and_an_interrupted_run(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "x")
    with pytest.raises(ZeroDivisionError), run.tracking(rounds=4):
        run.write_status("running", round_=2)
        raise ZeroDivisionError("boom")
    status = read_status(run.path)
    assert (status["state"], status["round"], status["error"]) == ("failed", 2, "ZeroDivisionError: boom")
    assert "failed after round 2 of 4" in unfinished_warning(run.path)

    run = RunDir.create(tmp_path, "y")
    with pytest.raises(KeyboardInterrupt), run.tracking(rounds=4):
        raise KeyboardInterrupt
    status = read_status(run.path)
    assert (status["state"], status["round"]) == ("interrupted", 0)
    assert status["ended"] is not None


def test_a_killed_run_stays_running_and_is_named_unfinished(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "x")
    run.write_status("running", round_=3, rounds=8)  # then SIGKILL: nobody writes again
    assert read_status(run.path)["state"] == "running"
    warning = unfinished_warning(run.path)
    assert "has not finished" in warning and "after round 3 of 8" in warning
    (run.path / "status.json").write_text("{torn")
    assert read_status(run.path)["state"] == "unknown"
    with pytest.raises(ValueError, match="unknown run state"):
        run.write_status("done")


# --- one file mode for every result file ---------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_atomic_write_gives_the_mode_of_a_plain_open(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "a.json", b"{}")
        with (tmp_path / "b.jsonl").open("w") as f:
            f.write("{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == (tmp_path / "b.jsonl").stat().st_mode & 0o777


# --- the partition heatmap's title ---------------------------------------------------------


@pytest.mark.parametrize(
    ("title", "labels"),
    [
        ("concept_shift_with_a_long_name: training labels per client (round 6)", ["0", "1"]),
        ("a-very-long-experiment-name-without-any-spaces-in-it-at-all: labels", ["a"]),
        ("mrpc: training labels per client", [str(i) for i in range(12)]),
    ],
)
def test_the_heatmap_title_is_not_clipped(tmp_path: Path, monkeypatch, title: str, labels: list) -> None:
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from fedloom.data import plot_label_heatmap

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k)))
    counts = np.arange(3 * len(labels)).reshape(3, len(labels))
    plot_label_heatmap(counts, labels, tmp_path / "h.png", title=title)
    (fig,) = figures
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    box = fig.axes[0].title.get_window_extent(canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, (box, fig.bbox)
    assert "".join(fig.axes[0].get_title().split()) == "".join(title.split())


# --- the CLI: every bad input is one line and exit status 2 -------------------------------

import importlib.metadata

import tomli_w
from conftest import needs_glue, tiny_raw
from typer.testing import CliRunner

from fedloom.algorithms import ClientContext
from fedloom.cli import app

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def tiny_toml(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(tiny_raw()))
    return path


def _setup(tmp_path: Path, kind: str) -> Path:
    """Files some cases need: a directory, a Latin-1 file, a plain file."""
    if kind == "latin1":
        path = tmp_path / "latin.toml"
        path.write_bytes('name = "caf\u00e9"\n'.encode("latin-1"))
    elif kind == "dir":
        path = tmp_path / "a-directory.toml"
        path.mkdir()
    else:
        path = tmp_path / "taken"
        path.write_text("not a directory")
    return path


#: (case, command line with {config} / {runs} / {dir} / {latin1} / {file}, fragments)
BAD_INPUTS = [
    ("bool-as-int", "run {config} --set train.batch_size=true", ["train.batch_size:", "(got True)"]),
    ("bool-as-float", "run {config} --set train.head_lr=true", ["train.head_lr:", "(got True)"]),
    ("float-as-int", "run {config} --set federation.rounds=2.0", ["federation.rounds:", "(got 2.0)"]),
    ("min-clients-above-num-clients", "run {config} --set federation.min_clients=4",
     ["federation.min_clients: 4 is more than the 3 clients of partition.num_clients"]),
    ("krum-malicious-beyond-n",
     "run {config} --set algorithm.name=krum --set aggregation.num_malicious_nodes=1",
     ["aggregation.num_malicious_nodes: Krum needs more than 2f + 2 = 4 clients per round"]),
    ("krum-by-fraction", "run {config} --set algorithm.name=krum --set federation.fraction=0.5",
     ["aggregation.num_malicious_nodes:", "the federation samples 2"]),
    ("multikrum-select-beyond-n",
     "run {config} --set algorithm.name=multikrum --set aggregation.num_nodes_to_select=4",
     ["aggregation.num_nodes_to_select: 4 is more than the 3 clients sampled per round"]),
    ("rule-on-a-method-that-does-not-average",
     "run {config} --set algorithm.name=fedmosaic --set aggregation.rule=median",
     ["aggregation.rule: fedmosaic does not average"]),
    ("hyperparameter-type", "run {config} --set algorithm.name=fedprox --set algorithm.proximal_mu=abc",
     ["algorithm.proximal_mu: expected a number for fedprox (got 'abc')"]),
    ("hyperparameter-bool", "run {config} --set algorithm.name=fedavgm --set algorithm.server_momentum=true",
     ["algorithm.server_momentum: expected a number for fedavgm (got True)"]),
    ("several-keys", "run {config} --set train.lr=true --set federation.rounds=0 --set model.lora.r=x",
     ["train.lr:", "federation.rounds:", "model.lora.r:", "; "]),
    ("several-hyperparameters",
     "run {config} --set algorithm.name=fedprox --set algorithm.proximal_mu=x --set algorithm.cap=y",
     ["algorithm.proximal_mu:", "; algorithm.cap:"]),
    ("config-is-a-directory", "run {dir}", ["a-directory.toml: is a directory, not a config file"]),
    ("config-not-utf8", "run {latin1}", ["latin.toml: not a UTF-8 text file"]),
    ("output-dir-is-a-file", "run {config} --output-dir {file}", ["output_dir:", "taken is a file"]),
    ("output-dir-under-a-file", "run {config} --output-dir {file}/runs",
     ["output_dir:", "taken is a file, not a directory"]),
    ("partition-round-past-the-end", "partition {config} --round 3",
     ["--round: 3 is past the last round (federation.rounds = 2)"]),
    ("partition-bool", "partition {config} --set partition.num_clients=true", ["partition.num_clients:"]),
    ("diagnose-several-keys", "diagnose {config} --set train.lr=true --set eval.every=0",
     ["train.lr:", "eval.every:"]),
    ("algorithms-unknown", "algorithms nope", ["algorithm.name: unknown algorithm 'nope'"]),
    ("missing-argument", "run", ["Missing argument 'CONFIG'", "run --help"]),
    ("unknown-option", "run {config} --bogus", ["No such option '--bogus'"]),
    ("option-out-of-range", "partition {config} --round -1", ["Invalid value for '--round'"]),
    ("unknown-command", "runn {config}", ["No such command 'runn'"]),
]


@pytest.mark.parametrize(("case", "line", "fragments"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(case: str, line: str, fragments: list[str], tiny_toml: Path,
                                          tmp_path: Path, monkeypatch) -> None:
    from fedloom.models.fedmodel import FedModel

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(FedModel, "build", no_model)
    monkeypatch.chdir(tmp_path)  # a partition heatmap would land here
    paths = {"config": tiny_toml, "runs": tmp_path / "runs"}
    for kind in ("dir", "latin1", "file"):
        if "{" + kind + "}" in line:
            paths[kind] = _setup(tmp_path, kind)
    args = line.format(**paths).split()
    if args[0] == "run" and "--output-dir" not in args:
        args += ["--output-dir", str(tmp_path / "runs")]
    result = invoke(*args)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""
    assert not (tmp_path / "runs").exists()  # no run directory left behind
    assert not list(tmp_path.glob("*.png"))


# --- --version, algorithms, backbones ------------------------------------------------------


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"fedloom {importlib.metadata.version('fedloom')}\n"


def test_algorithms_lists_every_algorithm_with_its_hyperparameters() -> None:
    from fedloom.algorithm_catalog import load

    result = invoke("algorithms")
    assert result.exit_code == 0, result.stderr
    sections = {}
    for block in result.stdout.strip().split("\n\n"):
        head, *rows = block.splitlines()
        name, text = head.split(": ", 1)
        sections[name] = (text, [r.split() for r in rows])
    catalog = load()  # the registry's (test_the_algorithm_catalog_is_the_registry)
    assert sorted(sections) == sorted(catalog)
    for name, (text, rows) in sections.items():
        assert text == catalog[name]["description"]
        listed = {r[0]: r[1] for r in rows if r[0] != "(no"}
        assert set(listed) == {h[0] for h in catalog[name]["hyperparameters"]}, name
    assert sections["fedprox"][1][-1][:3] == ["proximal_mu", "0.0", "a"]
    assert ["weighting", '"examples"'] == sections["fedavg"][1][0][:2]
    one = invoke("algorithms", "krum")
    assert one.exit_code == 0 and one.stdout.startswith("krum: ") and "\n\n" not in one.stdout


def test_the_algorithm_catalog_is_the_registry() -> None:
    """`fedloom algorithms` reads a generated file, not the registry (torch-free, < 1 s):
    it must be the registry's, defaults and types included."""
    import subprocess
    import sys

    from fedloom.algorithm_catalog import load

    # a fresh process: tests register algorithms of their own in this one
    code = "import json; from fedloom.algorithm_catalog import generate; print(json.dumps(generate()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == load(), "stale: run python -m fedloom.algorithm_catalog"


def test_algorithms_and_backbones_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; from typer.testing import CliRunner; from fedloom.cli import app; "
            "r = CliRunner().invoke(app, ['algorithms']); r2 = CliRunner().invoke(app, "
            "['backbones']); assert r.exit_code == r2.exit_code == 0; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_backbones_lists_the_named_backbones_and_heads() -> None:
    from fedloom.models.catalog import PACKAGED

    result = invoke("backbones")
    assert result.exit_code == 0, result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("    ")]
    assert rows == [*PACKAGED, "<id", "auto", "classifier", "verbalizer"]
    assert "(encoder;" in result.stdout and "(decoder;" in result.stdout


# --- a fedloom bug: the traceback, then a line asking to report it, exit status 1 ----------


def test_a_bug_prints_the_traceback_and_asks_for_a_report(tiny_toml: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr("fedloom.cli.config_file.load_config", broken)
    for command in ("run", "partition", "diagnose"):
        result = invoke(command, tiny_toml)
        assert result.exit_code == 1, (command, result.stderr)
        assert result.stderr.startswith("Traceback (most recent call last):")
        assert "KeyError: 'a bug'" in result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: this is a fedloom bug (KeyError), please report it")


# --- fedloom run: --json, --quiet, progress lines, status.json ------------------------------


def only_run_dir(output_dir: Path) -> Path:
    (run,) = [p for p in output_dir.iterdir() if p.is_dir()]
    return run


@needs_glue
def test_run_json_prints_the_summary_alone(tiny_toml: Path, tmp_path: Path) -> None:
    result = invoke("run", "--no-report", tiny_toml, "--output-dir", tmp_path / "runs", "--json")
    assert result.exit_code == 0, result.stderr
    run = only_run_dir(tmp_path / "runs")
    assert json.loads(result.stdout) == json.loads((run / "summary.json").read_text())
    assert result.stdout == (run / "summary.json").read_text()
    # stderr is not a terminal: one plain line per round, not a bar drawn at the end
    rounds = [line for line in result.stderr.splitlines() if line.startswith("round ")]
    assert [r.split(":")[0] for r in rounds] == ["round 1/2", "round 2/2"], result.stderr
    assert all(" train_loss " in r and r.endswith(" s") for r in rounds)
    status = read_status(run)
    assert (status["state"], status["round"], status["rounds"], status["error"]) == ("finished", 2, 2, None)
    # every result file has one mode
    modes = {p.name: p.stat().st_mode & 0o777 for p in run.rglob("*") if p.is_file()}
    assert len(set(modes.values())) == 1, modes


@pytest.fixture
def restore_hf_logging():
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    yield hf_logging
    hf_logging.set_verbosity(verbosity)
    hf_logging.enable_progress_bar()


@needs_glue
def test_run_quiet_prints_no_progress(tiny_toml: Path, tmp_path: Path, restore_hf_logging) -> None:
    result = invoke("run", "--no-report", tiny_toml, "--output-dir", tmp_path / "runs", "--quiet")
    assert result.exit_code == 0, result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("round")], result.stderr
    assert "tiny: fedavg on MRPC" in result.stdout
    # model loading is quiet too: no transformers progress bars or info logging
    assert not restore_hf_logging.is_progress_bar_enabled()
    assert restore_hf_logging.get_verbosity() == restore_hf_logging.ERROR


@register("test-hardening-diverges")
@dataclass(frozen=True)
class Diverges(FedAvg):
    def local_train(self, ctx: ClientContext, payload):
        if ctx.round >= 1:
            raise FloatingPointError(f"client {ctx.client_id}: non-finite loss")
        return super().local_train(ctx, payload)


@register("test-hardening-ctrl-c")
@dataclass(frozen=True)
class CtrlC(FedAvg):
    def local_train(self, ctx: ClientContext, payload):
        if ctx.round >= 1:
            raise KeyboardInterrupt
        return super().local_train(ctx, payload)


@register("test-hardening-bug")
@dataclass(frozen=True)
class Buggy(FedAvg):
    def aggregate(self, state, results):
        raise ZeroDivisionError("a bug in aggregate")


@needs_glue
def test_a_failed_run_says_failed(tiny_toml: Path, tmp_path: Path) -> None:
    result = invoke("run", "--no-report", tiny_toml, "--output-dir", tmp_path / "runs",
                    "--set", "algorithm.name=test-hardening-diverges")
    assert result.exit_code == 1
    run = only_run_dir(tmp_path / "runs")
    status = read_status(run)
    assert (status["state"], status["round"]) == ("failed", 1)
    assert "round 2: every sampled client failed" in status["error"]
    assert status["ended"] is not None


@needs_glue
def test_ctrl_c_says_interrupted_after_the_last_round(tiny_toml: Path, tmp_path: Path) -> None:
    result = invoke("run", "--no-report", tiny_toml, "--output-dir", tmp_path / "runs",
                    "--set", "algorithm.name=test-hardening-ctrl-c")
    assert result.exit_code == 130, result.stderr
    run = only_run_dir(tmp_path / "runs")
    assert result.stderr.strip().splitlines()[-1] == (
        f"interrupted after round 1 (run directory: {run}); continue it with: "
        f"fedloom run --resume {run}")
    assert "Traceback" not in result.stderr
    status = read_status(run)
    assert (status["state"], status["round"], status["rounds"]) == ("interrupted", 1, 2)


@needs_glue
def test_a_bug_during_a_run_fails_its_status(tiny_toml: Path, tmp_path: Path) -> None:
    result = invoke("run", "--no-report", tiny_toml, "--output-dir", tmp_path / "runs",
                    "--set", "algorithm.name=test-hardening-bug")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: this is a fedloom bug (ZeroDivisionError), please report it")
    status = read_status(only_run_dir(tmp_path / "runs"))
    assert status["state"] == "failed" and status["error"] == "ZeroDivisionError: a bug in aggregate"


def test_the_catalog_refuses_as_the_registry_does() -> None:
    """`fedloom run` checks names against the catalog before importing torch: its messages
    must be the registry's, for every algorithm."""
    from fedloom.algorithm_catalog import load, refusal

    for name in load():
        with pytest.raises(AlgorithmError) as by_registry:
            algorithms.create(name, not_a_key=1)
        assert refusal(name, ["not_a_key"]) == str(by_registry.value), name
        assert refusal(name, [h[0] for h in load()[name]["hyperparameters"]]) is None
    assert refusal("fedsgdx", []).startswith("algorithm.name: unknown algorithm 'fedsgdx'")


@pytest.mark.parametrize(("command", "extra", "refusal"), [
    ("run", [], "algorithm.lamda: unknown hyperparameter for fedavg"),
    ("partition", [], "algorithm.lamda: unknown hyperparameter for fedavg"),
    ("diagnose", [], "algorithm.lamda: unknown hyperparameter for fedavg"),
    ("sweep", ["--grid", "train.lr=1e-3,2e-3"], "algorithm.lamda: unknown hyperparameter"),
    ("sweep", ["--grid", "algorithm.name=fedavg,fedavgx"],
     "--grid algorithm.name=\"fedavg\",\"fedavgx\": algorithm.name: unknown algorithm 'fedavgx'"),
])
def test_a_misspelt_algorithm_is_refused_before_torch_is_imported(
    tmp_path: Path, command: str, extra: list[str], refusal: str,
) -> None:
    import subprocess
    import sys

    config = tmp_path / "exp.toml"
    lamda = "" if "algorithm.name=fedavg,fedavgx" in extra else "lamda = 1.0\n"
    config.write_text(f'[partition]\nval_fraction = 0.2\n[algorithm]\nname = "fedavg"\n{lamda}')
    code = ("import sys; from typer.testing import CliRunner; from fedloom.cli import app; "
            f"r = CliRunner().invoke(app, [{command!r}, {str(config)!r}, *{extra!r}]); "
            "print(r.exit_code, 'torch' in sys.modules); print(r.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0] == "2 False", out.stdout
    assert refusal in " ".join(out.stdout.split()), out.stdout

"""The Flower runtime (``[runtime] name = "flower"``): a loopback deployment (a SuperLink
and one SuperNode per client, real Flower processes talking over HTTP on 127.0.0.1) writes
the metrics.jsonl and summary.json of the embedded simulator, for FedAvg and FedMosaic
across two backbones, compressed (a personalized method whose client state stays on the
nodes; a clustered one, IFCA, on the same message path in process: test_flower_personal);
a SuperNode killed mid-run leaves its client missing from the rounds after, with Flower's
reason; SIGTERM stops every Flower process; a node whose config differs from the server's
refuses the experiment; and fedloom's records travel through Flower's exactly.
(``fedloom serve`` and ``fedloom join`` with TLS and SuperNode authentication:
test_own_data_nodes.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tomli_w
import torch
from conftest import needs_glue, tiny_raw

pytest.importorskip("flwr")

from flwr.app import RecordDict

from fedloom import algorithms
from fedloom.algorithms import ClientResult
from fedloom.config import validate
from fedloom.experiment import Experiment, build_algorithm, with_model_for
from fedloom.runtime.clients import TrainReply
from fedloom.runtime.flower_deploy import (
    Federation,
    free_port,
    processes_of,
    run_config,
)
from fedloom.runtime.flower_records import (
    request,
    scores_from,
    scores_record,
    take_params,
    train_reply_from,
    train_reply_record,
)
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

CASES = {
    # with DP-FedAvg, the noise added by the clients (the same seeded shares on a node)
    "fedavg": ["algorithm.name=fedavg", "privacy.level=client", "privacy.noise=client",
               "privacy.clip_norm=0.5"],
    # two backbones, PQ-LoRA shared across them, the mosaic model chosen by the algorithm,
    # a payload of its own for each client; each client's local adapter, gates and head
    # kept in its state on its node between rounds (the other personalized methods keep
    # theirs in the same client state). Both ways compressed, as the IFCA case was (a
    # clustered method on the same message path: test_flower_personal): the downlink's
    # encodings travel in ArrayRecords and its reference is client state on the node (the
    # uplink's compresses the tensors an update shares by name with its payload: none of
    # FedMosaic's, as none of IFCA's)
    "fedmosaic": ["algorithm.name=fedmosaic",
                  'model.groups=[{clients = [1], backbone = "tiny-llama"}]',
                  ('transforms=[{name = "compress", compressor = "topk", ratio = 0.1}, '
                   '{name = "compress_down", compressor = "qsgd", levels = 8}]')],
}
#: the clients (one SuperNode each) of every case: every Flower message is a process start
#: on each node, so two clients, scored once, after the last of the two rounds (the clients'
#: state still crosses a round on its node)
CASE_CLIENTS = 2
CASE_SETTINGS = (f"partition.num_clients={CASE_CLIENTS}", "eval.every=2",
                 # off on Flower by default (a personal adapter stays on its node)
                 "eval.others='never'")


def _outputs(run: Path) -> tuple[list[dict], dict]:
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("wall_seconds")
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()], summary


def _raw(tmp_path: Path, *overrides: str) -> dict:
    return tiny_raw("partition.num_clients=3", "data.max_train_examples=60",
                    "federation.rounds=2", *overrides, output_dir=tmp_path / "flower")


def _fedloom(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedloom.cli", *args], **kwargs)


def test_records_round_trip_exactly() -> None:
    params = {"a.lora_A": torch.randn(4, 3), "b.gate": torch.randn(2, dtype=torch.bfloat16)}
    content = request({"op": "train", "round": 2}, params)
    back = take_params(content, "payload")
    assert list(back) == list(params)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in params.items())
    reply = TrainReply(3, ClientResult(3, params, 17, {"train_loss": 0.25}))
    got = train_reply_from(train_reply_record(reply))
    assert (got.client_id, got.result.num_examples, dict(got.result.metrics)) == (
        3, 17, {"train_loss": 0.25})
    assert train_reply_from(train_reply_record(TrainReply(5, None, "crashed"))) == TrainReply(
        5, None, "crashed")
    scores = {"clients": {"accuracy": 0.5, "f1": None}}
    evaluated = scores_record(scores)
    assert scores_from(evaluated) == scores and not evaluated.array_records  # scores only
    assert scores_from(scores_record(None)) is None
    assert isinstance(content, RecordDict)


def _local(raw: dict, tmp_path: Path) -> Path:
    """The run directory of ``raw`` on the local runtime, computed as each Flower client
    process computes (one torch thread: runtime.cpus_per_worker = 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = RunDir.create(tmp_path / "local", "tiny")
        simulate(Experiment.build(validate(raw)), local)
    finally:
        torch.set_num_threads(threads)
    return local.path


def _submit(federation: Federation, raw: dict,
            watch: Callable[[Path], None] | None = None) -> Path:
    """The run of ``raw`` on ``federation``, prepared as ``fedloom run`` prepares one
    (:func:`fedloom.cli.flower_run.run_on_flower`: a run directory, its config.toml naming
    every setting, status "running"); returns its run directory when the run ended."""
    cfg = validate({**raw, "runtime": {**raw.get("runtime", {}), "name": "flower"}})
    run = RunDir.create(cfg.output_dir, cfg.name)
    run.write_config(run_config(cfg))
    run.write_status("running", rounds=cfg.federation.rounds)
    federation.submit(run.path / "config.toml", run.path,
                      None if watch is None else lambda: watch(run.path))
    return run.path


def _stop(process: subprocess.Popen) -> None:
    """On a failure: ``fedloom run`` stopped as Ctrl-C stops it (its Flower processes too)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


#: the case ``fedloom run`` deploys by itself; the others share one deployment
CLI_CASE = "fedavg"


@needs_glue
@pytest.mark.slow
def test_loopback_flower_runs_equal_the_local_runtime(tmp_path: Path) -> None:
    """``fedloom run`` of :data:`CLI_CASE` deploys, runs and stops a loopback federation
    by itself. The other case of :data:`CASES` runs on a deployment started here as
    :func:`run_loopback` starts one (a SuperLink, and a SuperNode with its worker per
    client), meanwhile; each equal to the local runtime. No Flower process outlives either
    deployment."""
    raws = {name: _raw(tmp_path / name, *CASE_SETTINGS, *CASES[name]) for name in sorted(CASES)}
    config = tmp_path / "flower.toml"
    config.write_text(tomli_w.dumps({**raws[CLI_CASE], "runtime": {"name": "flower"}}))
    process = None
    home = tmp_path / "deployment"
    # the local runs, on a thread of their own while this one waits for Flower's (the only
    # torch work in this process meanwhile)
    pool = ThreadPoolExecutor(1)
    locals_ = {name: pool.submit(_local, raw, tmp_path / name) for name, raw in raws.items()}
    try:
        with (tmp_path / "out.json").open("w") as out, \
                (tmp_path / "err.txt").open("w") as err:  # not read until the end
            process = _fedloom("run", "--no-report", str(config), "--quiet", "--json", stdout=out,
                               stderr=err)
        with Federation(home) as federation:
            superlink = federation.start_superlink(free_port())
            for cid in range(CASE_CLIENTS):
                federation.start_supernode(cid, superlink)
            federation.connect(superlink)
            for name in sorted(set(CASES) - {CLI_CASE}):
                run = _submit(federation, raws[name])
                status = json.loads((run / "status.json").read_text())
                assert status["state"] == "finished", (name, status)
                assert _outputs(run)[1]["algorithm"] == name
                assert _outputs(run) == _outputs(locals_[name].result()), name
                # personalized: each client's adapter checkpointed by its node, in the
                # node's folder, not the server's
                assert not (run / "checkpoints" / "personal").exists()
                assert sorted(p.relative_to(home) for p in home.glob("nodes/*/personal/*")) == [
                    Path(f"nodes/client_{c:03d}/personal/client_{c:03d}.safetensors")
                    for c in range(CASE_CLIENTS)], name
        assert not processes_of(home)

        process.wait(timeout=600)
        assert process.returncode == 0, (tmp_path / "err.txt").read_text()
        (run,) = (tmp_path / CLI_CASE / "flower").glob("tiny-*")  # beside it: .alignment
        assert json.loads((tmp_path / "out.json").read_text())["algorithm"] == CLI_CASE
        assert _outputs(run) == _outputs(locals_[CLI_CASE].result())
        assert not processes_of(run / "flower")
    finally:
        pool.shutdown(cancel_futures=True)
        if process is not None:
            _stop(process)


@needs_glue
@pytest.mark.slow
def test_loopback_secure_aggregation_loses_a_killed_node_and_names_a_refusing_one(
        tmp_path: Path) -> None:
    """A loopback deployment of four clients under secure aggregation (SecAgg+, its stages
    as Flower message rounds). The fourth client's node joins (``fedloom join``) with a
    config file that differs from the server's: it refuses the experiment, and the server
    names the differing key as that client's reason. SuperNode 1 is killed in round 1
    between sharing its keys and sending its masked input: its masks are recovered from
    the others' shares, and the client is missing from the rounds after, with Flower's
    reason. No Flower process outlives the deployment."""
    home = tmp_path / "deployment"
    raw = _raw(tmp_path / "killed", "federation.rounds=2", "federation.min_clients=2",
               "partition.num_clients=4", "secagg.protocol=secagg+", "eval.every=2")
    # the fourth node's file differs from the server's experiment in train.local_steps
    # (issue 36)
    plain = tmp_path / "plain.toml"
    plain.write_text(tomli_w.dumps({**raw, "train": {**raw["train"], "local_steps": 1}}))
    with Federation(home) as federation:
        superlink = federation.start_superlink(free_port())
        nodes = {cid: federation.start_supernode(cid, superlink) for cid in range(3)}
        federation.connect(superlink)
        refusing = _fedloom("join", str(plain), "--superlink", superlink, "--client-id",
                            "3", stderr=subprocess.DEVNULL, start_new_session=True)
        # node 1 killed in round 1 once its reply to the "share" stage went out (its
        # 2nd train.secagg reply), before the masked input
        killer = federation.kill_after_replies(1, nodes[1], "train.secagg", 2)
        try:
            killed = _submit(federation, raw)
        finally:
            os.killpg(refusing.pid, signal.SIGKILL)
            refusing.wait()
    assert not processes_of(home)
    rows = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["scope"] == "train"]
    assert [r["clients"] for r in train] == [[0, 1, 2, 3]] * 2
    assert killer.is_set()
    assert [r["failed"] for r in train] == [[1, 3], [1, 3]]
    assert [r["secagg_dropouts"] for r in train] == [1, 0]
    assert train[0]["missing"]["1"] == (
        "dropped out of secure aggregation after sharing its keys (its masks recovered)")
    assert train[0]["secagg"]["summed"] == 2
    assert "Node Unavailable" in train[1]["missing"]["1"]
    assert all(r["missing"]["3"] == (
        "its node refused the experiment: the server's experiment differs from plain.toml: "
        "train.local_steps: the server's 2, plain.toml's 1") for r in train)
    assert sorted(train[1]["per_client"]) == ["0", "2"]
    assert json.loads((killed / "status.json").read_text())["state"] == "finished"


@needs_glue
@pytest.mark.slow
def test_sigterm_stops_every_flower_process(tmp_path: Path) -> None:
    """``fedloom run`` on Flower (one client: a SuperLink, a SuperNode and its worker, the
    ServerApp and ClientApp processes) stopped with SIGTERM once a round is done: exit
    status 143, the run interrupted, no Flower process left. SIGTERM unwinds as Ctrl-C
    (:class:`fedloom.cli.interrupts.Terminated` is a ``KeyboardInterrupt``), whose status
    130 and message test_hardening checks on the embedded simulator."""
    config = tmp_path / "flower.toml"
    config.write_text(tomli_w.dumps({
        **_raw(tmp_path, "federation.rounds=20", "partition.num_clients=1"),
        "runtime": {"name": "flower"}}))
    process = _fedloom("run", "--no-report", str(config), "--quiet", stderr=subprocess.PIPE,
                       text=True)
    try:
        deadline = time.monotonic() + 300
        status = None
        while status is None and time.monotonic() < deadline:
            runs = list((tmp_path / "flower").glob("*/status.json"))
            if runs and json.loads(runs[0].read_text() or "{}").get("round", 0) >= 1:
                status = runs[0]
            time.sleep(0.5)
        # past the deadline: stopped all the same
        status = status or next((tmp_path / "flower").glob("*/status.json"))
        process.send_signal(signal.SIGTERM)
        # stopping is bounded (SIGTERM, SIGKILL after 10 s, then the stragglers); the margin
        # is for a loaded machine
        _, err = process.communicate(timeout=240)
        assert process.returncode == 143, err
        assert json.loads(status.read_text())["state"] == "interrupted"
        assert not processes_of(status.parent / "flower")
    finally:
        if process.poll() is None:
            process.kill()


def test_without_flower_installed_the_error_names_the_extra(monkeypatch) -> None:
    import importlib.util

    from fedloom.config import ConfigError
    from fedloom.runtime.flower_deploy import require_flower

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flwr" else real(name, *a))
    with pytest.raises(ConfigError, match=r'pip install "fedloom\[flower\]"'):
        require_flower()


#: what a method needs beyond its name on the tiny federation
NEEDS = {"qfedavg": ["algorithm.client_learning_rate=0.01"],
         "trimmed_mean": ["partition.num_clients=5"]}


@pytest.mark.parametrize("name", algorithms.available())
def test_the_config_a_flower_run_sends_rebuilds_every_algorithm(name: str) -> None:
    """The ServerApp and the nodes load the run's config.toml, which names every setting:
    the adapter structure a method chose must be in it, not the default it replaced."""
    cfg = validate(tiny_raw(f"algorithm.name={name}", *NEEDS.get(name, [])))
    loaded = validate(tomllib.loads(tomli_w.dumps(run_config(cfg))))
    assert with_model_for(build_algorithm(loaded), loaded) == loaded

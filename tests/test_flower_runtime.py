"""The Flower runtime (``[runtime] name = "flower"``): a loopback deployment (a SuperLink
and one SuperNode per client, real Flower processes talking over HTTP on 127.0.0.1) writes
the metrics.jsonl and summary.json of the embedded simulator, for FedAvg and for a
personalized method whose client state stays on the nodes, a clustered method (each
client its cluster's payload) and FedMosaic across two backbones; a SuperNode killed mid-run
leaves its client missing from the rounds after, with Flower's reason; Ctrl-C or SIGTERM
stops every Flower process; a node whose config differs from the server's refuses the
experiment; and fedloom's records travel through Flower's exactly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w
import torch
from conftest import needs_glue, tiny_raw

pytest.importorskip("flwr")

from flwr.app import RecordDict  # noqa: E402

from fedloom import algorithms  # noqa: E402
from fedloom.algorithms import ClientResult  # noqa: E402
from fedloom.config import validate  # noqa: E402
from fedloom.experiment import Experiment, build_algorithm, with_model_for  # noqa: E402
from fedloom.runtime.clients import TrainReply  # noqa: E402
from fedloom.runtime.flower_credentials import write_credentials  # noqa: E402
from fedloom.runtime.flower_deploy import (  # noqa: E402
    Federation, free_port, processes_of, run_config,
)
from fedloom.runtime.flower_records import (  # noqa: E402
    request, scored_from, scored_record, take_params, train_reply_from, train_reply_record,
)
from fedloom.runtime.local import simulate  # noqa: E402
from fedloom.runtime.rundir import RunDir  # noqa: E402

CASES = {
    # with DP-FedAvg, the noise added by the clients (the same seeded shares on a node)
    "fedavg": ["algorithm.name=fedavg", "privacy.level=client", "privacy.noise=client",
               "privacy.clip_norm=0.5"],
    "ditto": ["algorithm.name=ditto", "train.optimizer_state=persist"],
    "ifca": ["algorithm.name=ifca", "algorithm.num_clusters=2"],  # a payload per cluster
    # two backbones, PQ-LoRA shared across them, the mosaic model chosen by the algorithm
    "fedmosaic": ["algorithm.name=fedmosaic",
                  'model.groups=[{clients = [2], backbone = "tiny-llama"}]'],
}


def _outputs(run: Path) -> tuple[list[dict], dict]:
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("wall_seconds")
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()], summary


def _raw(tmp_path: Path, *overrides: str) -> dict:
    return tiny_raw("partition.num_clients=3", "data.max_train_examples=60",
                    "federation.rounds=2", *overrides, output_dir=tmp_path / "flower")


def _fedloom(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedloom.cli", *args], **kwargs)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
    adapter, got_scores = scored_from(scored_record((params, scores)))
    assert got_scores == scores and torch.equal(adapter["a.lora_A"], params["a.lora_A"])
    assert scored_from(scored_record(None)) is None
    assert isinstance(content, RecordDict)


@needs_glue
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_loopback_flower_run_equals_the_local_runtime(name: str, tmp_path: Path) -> None:
    raw = _raw(tmp_path, *CASES[name])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Flower client process (runtime.cpus_per_worker = 1)
    try:
        local = RunDir.create(tmp_path / "local", "tiny")
        simulate(Experiment.build(validate(raw)), local)
    finally:
        torch.set_num_threads(threads)
    config = tmp_path / "flower.toml"
    config.write_text(tomli_w.dumps({**raw, "runtime": {"name": "flower"}}))
    process = _fedloom("run", str(config), "--quiet", "--json", stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    (run,) = (tmp_path / "flower").glob("tiny-*")  # beside it: .alignment, a cache
    assert json.loads(out)["algorithm"] == name
    assert _outputs(run) == _outputs(local.path)
    assert not processes_of(run / "flower")


@needs_glue
@pytest.mark.slow
def test_a_supernode_killed_mid_run_leaves_its_client_missing(tmp_path: Path) -> None:
    raw = _raw(tmp_path, "federation.rounds=3", "federation.min_clients=2")
    run = RunDir.create(tmp_path / "flower", "tiny")
    run.write_config(raw)
    run.write_status("running", rounds=3)
    with Federation(run.path / "flower") as federation:
        superlink = federation.start_superlink(free_port())
        nodes = {cid: federation.start_supernode(cid, superlink) for cid in range(3)}
        federation.connect(superlink)

        def kill_in_round_2() -> None:
            if json.loads((run.path / "status.json").read_text()).get("round") == 1 \
                    and nodes[1].poll() is None:
                os.killpg(nodes[1].pid, signal.SIGKILL)
                nodes[1].wait()

        federation.submit(run.path / "config.toml", run.path, kill_in_round_2)
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["scope"] == "train"]
    assert [r["clients"] for r in train] == [[0, 1, 2]] * 3
    assert [r["failed"] for r in train] == [[], [1], [1]]
    assert all("Node Unavailable" in r["missing"]["1"] for r in train[1:])
    assert sorted(train[2]["per_client"]) == ["0", "2"]
    assert json.loads((run.path / "status.json").read_text())["state"] == "finished"
    assert not processes_of(run.path / "flower")


@needs_glue
@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_every_flower_process(sig: signal.Signals, code: int,
                                                      tmp_path: Path) -> None:
    config = tmp_path / "flower.toml"
    config.write_text(tomli_w.dumps({**_raw(tmp_path, "federation.rounds=20"),
                                     "runtime": {"name": "flower"}}))
    # a terminal's Ctrl-C reaches a process whose SIGINT is not ignored; a suite started in
    # the background (`nohup ... &`, a CI runner) ignores SIGINT, and its children inherit it
    process = _fedloom("run", str(config), "--quiet", stderr=subprocess.PIPE, text=True,
                       preexec_fn=_default_sigint)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runs = list((tmp_path / "flower").glob("*/status.json"))
        if runs and json.loads(runs[0].read_text()).get("round", 0) >= 1:
            break
        time.sleep(0.5)
    process.send_signal(sig)
    # stopping is bounded (SIGTERM, SIGKILL after 10 s, then the stragglers); the margin is
    # for a loaded machine
    try:
        _, err = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == code, err
    status = json.loads(runs[0].read_text())
    assert status["state"] == "interrupted"
    assert not processes_of(runs[0].parent / "flower")


@needs_glue
@pytest.mark.slow
def test_serve_and_join_with_tls_and_supernode_authentication(tmp_path: Path) -> None:
    """Served with an override (train.local_steps = 1), the nodes that join with the same
    settings train; the node that joins with the plain file refuses the experiment, and
    the server names the differing key as its client's reason (issue 36)."""
    credentials, rogue = tmp_path / "credentials", tmp_path / "rogue"
    write_credentials(credentials, clients=3)
    write_credentials(rogue, clients=1)  # a key pair the server never registered ...
    shutil.copy(credentials / "ca.crt", rogue / "ca.crt")  # ... behind the right CA
    raw = {**_raw(tmp_path, "federation.rounds=1", "federation.min_clients=2"),
           "runtime": {"nodes_timeout": 180.0}}
    plain, agreeing = tmp_path / "plain.toml", tmp_path / "agreeing.toml"
    plain.write_text(tomli_w.dumps(raw))
    agreeing.write_text(tomli_w.dumps({**raw, "train": {**raw["train"], "local_steps": 1},
                                       "output_dir": str(tmp_path / "elsewhere")}))
    port = free_port()
    server = _fedloom("serve", str(plain), "--set", "train.local_steps=1", "--port", str(port),
                      "--host", "127.0.0.1", "--credentials", str(credentials), "--quiet",
                      "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    join = ("join", "--superlink", f"127.0.0.1:{port}", "--client-id")
    nodes = [_fedloom(*join, str(cid), str(agreeing if cid < 2 else plain), "--credentials",
                      str(credentials), stderr=subprocess.DEVNULL, start_new_session=True)
             for cid in range(3)]
    impostor = _fedloom(*join, "0", "--credentials", str(rogue), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        out, err = server.communicate(timeout=600)
    finally:
        for node in [*nodes, impostor]:
            os.killpg(node.pid, signal.SIGKILL)
    assert server.returncode == 0, err
    assert json.loads(out)["rounds"] == 1
    (run,) = (tmp_path / "flower").iterdir()
    train = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][0]
    assert (train["clients"], train["failed"]) == ([0, 1, 2], [2])
    assert train["missing"]["2"] == (
        "its node refused the experiment: the server's experiment differs from plain.toml: "
        "train.local_steps: the server's 1, plain.toml's 2")
    assert "Failed to activate SuperNode" in impostor.communicate()[0]


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

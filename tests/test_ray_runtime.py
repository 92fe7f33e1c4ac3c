"""The Ray runtime (``[runtime] name = "ray"``): clients trained on Ray actors that keep
their local state, with the metrics.jsonl and summary.json of the embedded simulator
(wall_seconds aside), for a server optimizer with persistent client optimizer state, for a
personalized method, and under secure aggregation with drop-outs and a simulated attack;
a run killed mid-round resumes on Ray; and the actors score an adapter on their clients as
this process does (the own-data server's step)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from conftest import needs_glue, tiny_raw

from fedloom.config import validate
from fedloom.experiment import Experiment
from fedloom.runtime.rundir import RunDir
from fedloom.runtime.state_file import from_bytes, to_bytes
from fedloom.server import simulate

ray = pytest.importorskip("ray")

CASES = {
    # with DP-FedAvg and adaptive clipping: a server state in the transform chain
    "fedadam": ["algorithm.name=fedadam", "algorithm.eta=0.01", "train.optimizer_state=persist",
                "privacy.level=client", "privacy.adaptive_quantile=0.5",
                "privacy.clip_norm=0.1", "privacy.noise_multiplier=0.1"],
    # both compressions: the encodings travel to the actors and back as bytes, the error-
    # feedback residuals and downlink references are actor-side client state (read back
    # in round 2: two rounds show it)
    "ditto": ["algorithm.name=ditto", "train.optimizer_state=persist", "federation.rounds=2",
              ('transforms=[{name = "compress", compressor = "topk", ratio = 0.1}, '
               '{name = "compress_down", compressor = "qsgd", levels = 8}]')],
    # secure aggregation: the protocol's stages on the actors that hold the updates, a
    # simulated drop-out's masks recovered from the other actors' shares; an ALIE attacker
    # on its actor sends (masks) the forgery the colluding attackers made of every update
    "fedprox": ["algorithm.name=fedprox", "secagg.protocol=secagg+", "partition.num_clients=6",
                "faults.dropout=0.2", "attack.name=alie", "attack.clients=[1]"],
}


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             configure_logging=False)
    yield
    ray.shutdown()


def _outputs(run: Path) -> tuple[list[dict], dict]:
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("wall_seconds")
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()], summary


@needs_glue
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(CASES) - {"fedadam"}))
def test_ray_runs_equal_the_local_runtime(name: str, tmp_path: Path, ray_session) -> None:
    """The run on the actors equals the local one; then the same actors score an adapter
    on their clients as this process does (the own-data server's step)."""
    import torch

    from fedloom.runtime.clients import ClientHost
    from fedloom.runtime.ray_clients import RayClients

    raw = tiny_raw("partition.num_clients=4", "data.max_train_examples=80",
                   "federation.rounds=3", *CASES[name], output_dir=tmp_path)
    local = RunDir.create(tmp_path / "local", "tiny")
    simulate(Experiment.build(validate(raw)), local)
    cfg = validate({**raw, "runtime": {"name": "ray", "workers": 2}})
    exp = Experiment.build(cfg)
    ids = [p.client_id for p in exp.parties()]
    on_ray = RunDir.create(tmp_path / "ray", "tiny")
    with RayClients(cfg, ids) as clients:  # as simulate's clients_for starts them
        simulate(exp, on_ray, clients=clients)
        assert _outputs(on_ray.path) == _outputs(local.path)

        params = {cid: exp.model.initial_params for cid in ids}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each actor (runtime.cpus_per_worker = 1)
        try:
            here = ClientHost(exp, ids).score_many(1, params)
        finally:
            torch.set_num_threads(threads)
        assert clients.score_many(1, params) == here
    assert set(here) == set(ids) and all(scores["clients"] for scores in here.values())


@needs_glue
@pytest.mark.slow
def test_a_ray_run_stopped_mid_round_resumes(tmp_path: Path, ray_session) -> None:
    """The fedadam case stopped in round 2 and resumed equals the local run. Its round 1
    and its step from round 2 to 3 run uninterrupted on the actors, so this is also that
    case's equality test: no uninterrupted fedadam run besides (each Ray run starts two
    actor processes, which import torch)."""
    raw = tiny_raw("partition.num_clients=4", "data.max_train_examples=80",
                   "federation.rounds=3", *CASES["fedadam"], output_dir=tmp_path)
    local = RunDir.create(tmp_path / "local", "tiny")
    simulate(Experiment.build(validate(raw)), local)
    cfg = validate({**raw, "runtime": {"name": "ray", "workers": 2}})
    broken = RunDir.create(tmp_path / "ray", "tiny")

    def stop_in_round_2(kind: str, done: int, total: int) -> None:
        if kind == "round" and done == 1:
            stop_in_round_2.armed = True
        elif kind == "client" and getattr(stop_in_round_2, "armed", False):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate(Experiment.build(cfg), broken, stop_in_round_2)
    simulate(Experiment.build(cfg), RunDir(broken.path), resume=True)
    assert _outputs(broken.path) == _outputs(local.path)


def test_without_ray_installed_the_error_names_the_extra(monkeypatch) -> None:
    import sys

    from fedloom.config import ConfigError
    from fedloom.runtime.ray_clients import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r'pip install "fedloom\[ray\]"'):
        import_ray()


@pytest.mark.parametrize("form", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_an_unreachable_address_is_refused_at_once(form: str) -> None:
    from fedloom.config import ConfigError
    from fedloom.runtime.ray_clients import check_reachable

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = form.format(port=s.getsockname()[1])
    with pytest.raises(ConfigError, match=r"runtime.address: no Ray cluster answers at"):
        check_reachable(address, timeout=2.0)
    with socket.create_server(("127.0.0.1", 0)) as server:  # something listens: left to Ray
        check_reachable(form.format(port=server.getsockname()[1]))
    check_reachable("auto")
    check_reachable(None)


def test_messages_round_trip_as_safetensors_bytes() -> None:
    import torch

    from fedloom.algorithms import ClientResult
    from fedloom.runtime.clients import TrainReply

    replies = [TrainReply(3, ClientResult(3, {"w": torch.ones(2, 2)}, 17, {"train_loss": 0.5})),
               TrainReply(5, None, "dropped out mid-round (simulated)")]
    blob = to_bytes(replies)
    assert isinstance(blob, bytes) and b"dropped out" in blob
    back = from_bytes(blob)
    assert back[1] == replies[1] and back[0].result.num_examples == 17
    assert torch.equal(back[0].result.params["w"], torch.ones(2, 2))


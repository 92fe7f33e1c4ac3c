"""train.device and the precisions: resolution, the bad inputs, the CPU run unchanged by
the device setting, and (marked ``cuda``, skipped without a GPU) the same runs on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GLUE_DIR, identical, needs_glue, tiny_config
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.config import ConfigError
from fedloom.device import DeviceError, footprint, resolve_device, to_cpu, to_device
from fedloom.experiment import Experiment
from fedloom.runtime.clients import ClientHost
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

ROOT = Path(__file__).resolve().parents[1]
has_cuda = torch.cuda.is_available()
cuda = pytest.mark.skipif(not has_cuda, reason="needs a CUDA device")


def test_auto_is_cuda_when_torch_sees_one_else_the_cpu() -> None:
    assert resolve_device("auto") == torch.device("cuda:0" if has_cuda else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(has_cuda, reason="this machine has a GPU")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_a_gpu_asked_for_without_one_names_the_key(name: str) -> None:
    with pytest.raises(DeviceError, match=rf"train.device: '{name}' asked for a GPU"):
        resolve_device(name)


@cuda
def test_a_gpu_index_beyond_the_machines_names_the_range() -> None:
    with pytest.raises(DeviceError, match="cuda:0 to cuda:"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_a_device_that_is_no_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="train.device"):
        tiny_config('train.device="gpu"')


def test_moving_keeps_the_structure_and_leaves_clocks_on_the_host() -> None:
    state = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                           "param_groups": [{"lr": 0.1}]},
             "adapter": [torch.zeros(3)], "weights": (1.0, 2.0)}
    moved = to_device(state, torch.device("cpu"))
    assert identical(moved, state) and moved["weights"] == (1.0, 2.0)
    assert moved["optimizer"]["state"][0]["exp_avg"] is state["optimizer"]["state"][0]["exp_avg"]
    assert identical(to_cpu(state), state)


def test_the_footprint_counts_the_adapter_and_adamws_two_moments() -> None:
    model = torch.nn.Linear(4, 2)
    model.weight.requires_grad_(False)
    cost = footprint(model, "adamw", 0.9)
    assert cost.backbone == 4 * 2 * 4 and cost.per_client == 2 * 4 * 3
    assert footprint(model, "sgd", 0.0).per_client == 2 * 4


@needs_glue
def test_cpu_named_and_auto_give_the_same_run_bit_for_bit(tmp_path: Path) -> None:
    """On a machine without a GPU "auto" is the CPU, and naming it changes nothing: the
    same metrics, the same checkpoints; summary.json records where it ran."""
    outputs = {}
    for device in ("cpu", "auto"):
        cfg = tiny_config('algorithm.name="ditto"', f'train.device="{device}"',
                          output_dir=tmp_path / device)
        run = RunDir.create(cfg.output_dir, cfg.name)
        summary = simulate(Experiment.build(cfg), run)
        rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
        tensors = {str(p.relative_to(run.path)): load_file(p)
                   for p in sorted(run.path.rglob("*.safetensors"))}
        outputs[device] = (summary, rows, tensors)
    if not has_cuda:
        (cpu_summary, cpu_rows, cpu_tensors), (auto_summary, auto_rows, auto_tensors) = (
            outputs["cpu"], outputs["auto"])
        assert identical(cpu_tensors, auto_tensors) and len(cpu_tensors) > 3
        strip = [{k: v for k, v in r.items() if k != "seconds"} for r in cpu_rows]
        assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in auto_rows]
        assert cpu_summary["global"] == auto_summary["global"]
    # Ditto's two trainings of train.local_steps = 2 steps: 4 passes a client and round
    assert outputs["cpu"][0]["compute"] == {"device": "cpu", "tf32": None,
                                            "precision": {"tiny-bert": "fp32"},
                                            "train_passes_per_client_round": 4.0}


@needs_glue
@pytest.mark.skipif(has_cuda, reason="this machine has a GPU")
def test_fedloom_run_on_a_gpu_without_one_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text((ROOT / "examples" / "mrpc_fedavg.toml").read_text())
    done = CliRunner().invoke(app, ["run", "--no-report", str(cfg), "--set", 'train.device="cuda"',
                                    "--output-dir", str(tmp_path)])
    assert done.exit_code == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.device: 'cuda' asked for a GPU" in lines[0]
    assert not any(tmp_path.glob("*/config.toml"))  # no run directory was started


# --- on a GPU ----------------------------------------------------------------------------

def _run(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = tiny_config(*overrides, f'name="{name}"', "train.tf32=false", "model.head_dropout=0.0",
                      output_dir=tmp_path)
    exp = Experiment.build(cfg)
    for module in exp.model.head.modules():  # the backbone's own dropout: the runs agree
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    run = RunDir.create(cfg.output_dir, cfg.name)
    summary = simulate(exp, run)
    tensors = {f"{p.relative_to(run.path)}/{k}": v for p in sorted(run.path.rglob("*.safetensors"))
               for k, v in load_file(p).items()}
    return summary, tensors


@cuda
@needs_glue
@pytest.mark.parametrize("algorithm", ["fedavg", "ditto", "scaffold"])
def test_a_gpu_run_matches_the_cpu_run_and_saves_cpu_checkpoints(
        tmp_path: Path, algorithm: str) -> None:
    """float32 without TF32 on the GPU reaches the CPU run's adapters up to reassociation;
    its checkpoints (server, personal, client states) load on a CPU-only machine."""
    runs = {d: _run(tmp_path, d, f'algorithm.name="{algorithm}"', f'train.device="{d}"')
            for d in ("cpu", "cuda")}
    (cpu_summary, cpu_tensors), (gpu_summary, gpu_tensors) = runs["cpu"], runs["cuda"]
    assert gpu_summary["compute"]["device"].startswith("cuda:0")
    assert cpu_tensors.keys() == gpu_tensors.keys()
    for name, tensor in cpu_tensors.items():
        assert gpu_tensors[name].device.type == "cpu"
        if tensor.is_floating_point():
            torch.testing.assert_close(gpu_tensors[name], tensor, atol=2e-4, rtol=1e-3,
                                       msg=name)
    assert gpu_summary["global"]["dev"]["accuracy"] == pytest.approx(
        cpu_summary["global"]["dev"]["accuracy"], abs=0.05)


@cuda
@needs_glue
def test_clients_page_their_state_to_the_host_between_rounds() -> None:
    cfg = tiny_config('algorithm.name="ditto"', 'train.device="cuda"')
    exp = Experiment.build(cfg)
    ids = [c.client_id for c in exp.clients]
    host = ClientHost(exp, ids)
    start = to_cpu(exp.model.get_params())
    before = torch.cuda.memory_allocated()
    replies = host.train_many(0, 0, {cid: start for cid in ids})
    host.commit(ids)
    torch.cuda.synchronize()
    assert all(r.result is not None for r in replies)
    for reply in replies:
        assert all(t.device.type == "cpu" for t in reply.result.params.values())
    tensors = [t for s in host.states.values() for t in _tensors(s)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert torch.cuda.memory_allocated() - before < 1 << 20  # nothing left on the card


def _tensors(tree: object) -> list[torch.Tensor]:
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


@cuda
@needs_glue
def test_fp16_trains_with_a_persisted_loss_scale(tmp_path: Path) -> None:
    cfg = tiny_config('train.device="cuda"', 'model.precision="fp16"')
    exp = Experiment.build(cfg)
    assert exp.model.precision == "fp16"
    ids = [c.client_id for c in exp.clients]
    host = ClientHost(exp, ids)
    start = to_cpu(exp.model.get_params())
    replies = host.train_many(0, 0, {cid: start for cid in ids})
    host.commit(ids)
    for reply in replies:
        assert reply.result is not None
        assert all(torch.isfinite(t).all() for t in reply.result.params.values())
        assert any(not torch.equal(reply.result.params[n], start[n]) for n in start)
    assert all("optimizer/grad_scaler" in s for s in host.states.values())


@cuda
@needs_glue
def test_clients_trained_together_on_a_gpu_equal_one_by_one(tmp_path: Path) -> None:
    one = _run(tmp_path, "one", 'train.device="cuda"')[1]
    together = _run(tmp_path, "together", 'train.device="cuda"', "train.clients_per_pass=3")[1]
    for name, tensor in one.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(together[name], tensor, atol=2e-4, rtol=1e-3, msg=name)


def _catalog() -> list[str]:
    return sorted(json.loads((ROOT / "src" / "fedloom" / "algorithm_catalog.json").read_text()))


@cuda
@needs_glue
@pytest.mark.parametrize("algorithm", _catalog())
def test_every_algorithm_runs_on_a_gpu(tmp_path: Path, algorithm: str) -> None:
    """Two rounds of every algorithm at its defaults on tiny-bert on the GPU: finite, and
    everything it saved loads on the CPU."""
    try:
        cfg = tiny_config(f'algorithm.name="{algorithm}"', 'train.device="cuda"',
                          "partition.num_clients=4", output_dir=tmp_path)
        exp = Experiment.build(cfg)
    except ConfigError as err:  # the tiny federation does not suit it (not a device matter)
        pytest.skip(str(err))
    run = RunDir.create(cfg.output_dir, cfg.name)
    summary = simulate(exp, run)
    assert summary["compute"]["device"].startswith("cuda")
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert all(r["train_loss"] is not None for r in rows if r["scope"] == "train")
    for path in run.path.rglob("*.safetensors"):
        assert all(t.device.type == "cpu" for t in load_file(path).values())


def test_a_flower_node_can_name_its_own_device() -> None:
    from fedloom.runtime.flower_deploy import supernode_command

    command = supernode_command(3, "127.0.0.1:9092", device="cuda:1")
    assert command[-1] == 'client-id=3 device="cuda:1"'
    assert "device" not in supernode_command(3, "127.0.0.1:9092")[-1]


@pytest.mark.skipif(has_cuda, reason="this machine has a GPU")
def test_a_flower_server_without_the_nodes_gpu_scores_on_its_cpu() -> None:
    from fedloom.runtime.flower_app import _on_a_device_here

    cfg = tiny_config('train.device="cuda"')
    assert _on_a_device_here(cfg).train.device == "cpu"
    assert _on_a_device_here(cfg).model == cfg.model and cfg.train.device == "cuda"
    assert _on_a_device_here(tiny_config()) == tiny_config()


def test_ray_actors_asked_to_use_a_gpu_need_a_share_of_one() -> None:
    pytest.importorskip("ray")
    from fedloom.runtime.ray_clients import RayClients

    cfg = tiny_config('runtime.name="ray"', 'train.device="cuda"')
    with pytest.raises(ConfigError, match="runtime.gpus_per_worker: train.device = 'cuda'"):
        RayClients(cfg, [0, 1, 2])


def _federation_s(tmp_path: Path, method: str, device: str):
    """Federation (s) of the personalization benchmark shrunk onto the tiny backbones
    (tiny-llama for the SmolLM2 clients, its upper block adapted over a cached frozen
    prefix, bf16 as there), one round, on ``device``."""
    import importlib.util

    from fedloom.config import validate
    from fedloom.experiment import build_algorithm, with_model_for

    path = ROOT / "benchmarks" / "personalization.py"
    spec = importlib.util.spec_from_file_location("personalization_benchmark_device", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    raw = bench.base_config("s", method, backbone="tiny-bert", max_train=360, rounds=1,
                            local_steps=6)
    raw["data"].update(data_dir=str(GLUE_DIR), max_dev_examples=40, max_length=64)
    raw["train"]["device"] = device
    raw["output_dir"] = str(tmp_path)
    group = raw["model"]["groups"][0]
    group.update(backbone="tiny-llama")
    group["lora"]["layers"] = [1]
    cfg = with_model_for(build_algorithm(validate(raw)), validate(raw))
    return simulate(Experiment.build(cfg), RunDir.create(tmp_path / "runs", cfg.name))


@cuda
@needs_glue
@pytest.mark.parametrize("method", ["fedmosaic", "fedavg_ft"])
def test_two_backbones_aligned_and_prefix_cached_run_on_a_gpu(
        tmp_path: Path, method: str) -> None:
    """FedMosaic's alignment reads both backbones on their device (its token ids were left
    on the host once), and FedAvg-FT fine-tunes the bf16, prefix-cached decoder there (the
    same runs on the CPU: tests/test_mixed_backbones.py, tests/test_federation_s.py)."""
    summary = _federation_s(tmp_path, method, "cuda")
    assert summary["compute"]["device"].startswith("cuda")
    assert summary["personal"]["clients"]["accuracy"]["n"] == 12

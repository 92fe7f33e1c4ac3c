"""fedloom on one GPU: the numbers of the accelerators issue, in one command.

    python -m benchmarks.gpu [--out DIR] [--data-dir GLUE_DIR] [--smollm2 PATH]
                             [--only anchor,agreement,clients,memory,smollm2,flower]

Each section adds its results to ``DIR/gpu.json`` and ``DIR/gpu.md`` as soon as it ends,
so a run stopped early keeps what it measured. Times are wall-clock seconds after
``torch.cuda.synchronize()``; the card, torch's version and the CPU threads are recorded.

* **anchor**: the anchor workload (``benchmarks/anchor.toml``: MiniLM + LoRA r = 8 on MRPC,
  8 clients of 32 rows, 3 rounds of one local epoch) end to end as ``fedloom run`` processes
  on the GPU and on the CPU, and its rounds in process (``simulate``: the first run in the
  process, which pays CUDA's start, and a second, warm one).
* **agreement**: a short SST-2 FedAvg run that learns (4 clients of 200 rows, 3 rounds of
  13 steps, dev set scored) on the CPU in fp32 and on the GPU in fp32 (TF32 off, twice),
  bf16 and fp16: the dev accuracy and F1 each reaches, and how far the final global
  adapters lie from the GPU fp32 run's. The GPU fp32 run's directory is packed
  (``gpu_run.tar.gz``) so that a CPU-only machine can evaluate its checkpoints.
* **clients**: clients per second of local training (one round, 2 steps of 16 SST-2
  examples each, after a warm-up round) for 8 / 64 / 256 clients, one by one and all in
  one pass (``train.clients_per_pass``), fp32 and bf16.
* **memory**: peak device memory while 100 clients train one round (one by one and in
  passes of 25; AdamW moments persisted), against the backbone plus 100 × (adapter +
  moments), what the 100 clients would hold if each kept its own state on the card.
* **smollm2**: SmolLM2-135M (Llama, 30 layers) + LoRA train steps per second on SST-2,
  batches of 16 and 64, fp32 (TF32) and bf16. ``--smollm2 PATH`` names a Hugging Face directory; without the
  packaged GGUF a randomly initialised model of the same configuration (``--smollm2
  random:CONFIG_DIR``) gives the same arithmetic, so the same speed.
* **aggregation**: the server's weighted mean of 8 and 100 updates of the anchor's adapter
  on the CPU (where fedloom computes it) against the GPU with the copies to and from it.
* **flower**: the anchor workload under Flower's simulation (Ray backend) with the actors
  on the GPU (``client_resources``: 1 CPU and 1/8 GPU each), the peer a user would pick;
  recorded as not run when flwr or ray cannot be imported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedloom.config import load_config
from fedloom.device import DeviceError, describe, footprint, resolve_device
from fedloom.device import memory as device_memory
from fedloom.experiment import Experiment
from fedloom.params import weighted_average
from fedloom.runtime.clients import ClientHost
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

ROOT = Path(__file__).resolve().parent.parent
ANCHOR = ROOT / "benchmarks" / "anchor.toml"
SECTIONS = ("anchor", "agreement", "clients", "memory", "smollm2", "aggregation", "flower")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _config(data_dir: str, overrides: list[str]) -> Any:
    return load_config(ANCHOR, [f"data.data_dir={json.dumps(data_dir)}", *overrides])


# --- sections ----------------------------------------------------------------------------

def anchor(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for device in (args.device, "cpu"):
        cmd = [sys.executable, "-c", "from fedloom.cli import app; app()", "run", str(ANCHOR),
               "--data-dir", args.data_dir, "--output-dir", str(args.work / "e2e"),
               "--set", f'train.device="{device}"', "--quiet"]
        began = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
        out[f"e2e_{device}_s"] = round(time.perf_counter() - began, 2)
        cfg = _config(args.data_dir, [f'train.device="{device}"',
                                      f'output_dir="{args.work / "rounds"}"'])
        began = time.perf_counter()
        exp = Experiment.build(cfg)
        out[f"build_{device}_s"] = round(time.perf_counter() - began, 2)
        for label in ("first", "warm"):
            summary = simulate(exp, RunDir.create(cfg.output_dir, cfg.name))
            out[f"rounds_{device}_{label}_s"] = summary["wall_seconds"]
    out["cpu_threads"] = torch.get_num_threads()
    gpu = args.device
    out["speedup_e2e"] = round(out["e2e_cpu_s"] / out[f"e2e_{gpu}_s"], 2)
    out["speedup_rounds_warm"] = round(out["rounds_cpu_warm_s"] / out[f"rounds_{gpu}_warm_s"], 2)
    return out


#: the anchor's settings on SST-2 (which MiniLM learns in a few steps, so that a wrong
#: computation shows in the score) with the dev set scored: 13 steps of 16 (one epoch of
#: 200 rows) per client and round
AGREEMENT = ['data.task="SST-2"', "partition.num_clients=4", "partition.client_size=200",
             "federation.rounds=3", "eval.dev=true"]


def agreement(args: argparse.Namespace) -> dict[str, Any]:
    gpu = f'train.device="{args.device}"'
    variants = {"cpu_fp32": ['train.device="cpu"', 'model.precision="fp32"'],
                "gpu_fp32": [gpu, 'model.precision="fp32"', "train.tf32=false"],
                "gpu_bf16": [gpu, 'model.precision="bf16"']}
    variants["gpu_fp32_again"] = variants["gpu_fp32"]  # seeded: does the GPU repeat itself?
    if args.device.startswith("cuda"):
        variants["gpu_fp16"] = [gpu, 'model.precision="fp16"']
    out: dict[str, Any] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for name, overrides in variants.items():
        cfg = _config(args.data_dir, [*AGREEMENT, *overrides, f'name="{name}"',
                                      f'output_dir="{args.work / "agreement"}"'])
        run = RunDir.create(cfg.output_dir, cfg.name)
        began = time.perf_counter()
        summary = simulate(Experiment.build(cfg), run)
        dev = summary["global"]["dev"]
        out[name] = {**{m: round(dev[m], 4) for m in ("accuracy", "f1") if m in dev},
                     "seconds": round(time.perf_counter() - began, 2)}
        adapters[name] = _global_adapter(run.path)
        if name == "gpu_fp32":
            with tarfile.open(args.out / "gpu_run.tar.gz", "w:gz") as tar:
                tar.add(run.path, arcname="gpu_run")
    for other in ("gpu_fp32_again", "gpu_bf16", "cpu_fp32"):
        out[f"max_abs_diff_gpu_fp32_vs_{other}"] = max(
            float((adapters["gpu_fp32"][n] - t).abs().max()) for n, t in adapters[other].items())
    return out


def _global_adapter(run_path: Path) -> dict[str, torch.Tensor]:
    """A finished run's global adapter (its last checkpoint)."""
    from safetensors.torch import load_file

    return load_file(run_path / "checkpoints" / "global.safetensors")


def _host_rounds(cfg: Any, clients: int) -> tuple[Experiment, ClientHost, dict[int, Any]]:
    exp = Experiment.build(cfg)
    ids = list(range(clients))
    start = exp.model.get_params()
    return exp, ClientHost(exp, ids), {cid: start for cid in ids}


def clients(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for precision in ("fp32", "bf16"):
        for k in args.sizes:
            row: dict[str, Any] = {}
            for per_pass in (1, k):
                cfg = _config(args.data_dir, [  # 2 steps of 16 per client (one epoch)
                    'data.task="SST-2"', f"partition.num_clients={k}",
                    "partition.client_size=32", f"train.clients_per_pass={per_pass}",
                    f'model.precision="{precision}"', f'train.device="{args.device}"'])
                _, host, payloads = _host_rounds(cfg, k)
                host.train_many(0, 0, dict(list(payloads.items())[:min(k, 8)]))  # warm-up
                _sync()
                began = time.perf_counter()
                host.train_many(1, 0, payloads)
                _sync()
                seconds = time.perf_counter() - began
                row["together" if per_pass > 1 else "one_by_one"] = round(k / seconds, 1)
            row["speedup"] = round(row["together"] / row["one_by_one"], 2)
            out[f"{precision}_{k}"] = row
    return out


def memory(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    k = 100
    cuda = args.device.startswith("cuda")
    for per_pass in (1, 25):
        cfg = _config(args.data_dir, [
            'data.task="SST-2"', f"partition.num_clients={k}", "partition.client_size=32",
            f"train.clients_per_pass={per_pass}", 'train.optimizer_state="persist"',
            f'train.device="{args.device}"', 'model.precision="bf16"'])
        gc.collect()  # earlier sections' models (PEFT's modules hold reference cycles)
        if cuda:
            torch.cuda.empty_cache()
        exp, host, payloads = _host_rounds(cfg, k)
        cost = footprint(exp.model.head, cfg.train.optimizer, cfg.train.momentum)
        _sync()
        before = device_memory(exp.device) or {"allocated": 0}
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        host.train_many(0, 0, payloads)
        host.commit(list(payloads))
        _sync()
        used = device_memory(exp.device) or {"peak": 0, "allocated": 0}
        out[f"per_pass_{per_pass}"] = {"before_round_mib": round(before["allocated"] / 2**20, 1),
                                       "peak_mib": round(used["peak"] / 2**20, 1),
                                       "after_round_mib": round(used["allocated"] / 2**20, 1)}
        out["backbone_mib"] = round(cost.backbone / 2**20, 1)
        out["per_client_mib"] = round(cost.per_client / 2**20, 3)
        out["backbone_plus_100_clients_mib"] = round((cost.backbone + k * cost.per_client)
                                                     / 2**20, 1)
        del exp, host
        if cuda:
            torch.cuda.empty_cache()
    return out


def _smollm2_dir(spec: str, work: Path) -> tuple[str, str]:
    """(a backbone fedloom can load, what its weights are)."""
    if not spec.startswith("random:"):
        return spec, "pretrained"
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = spec.removeprefix("random:")
    target = work / "smollm2-random"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return str(target), "random init, SmolLM2-135M's configuration"


def smollm2(args: argparse.Namespace) -> dict[str, Any]:
    backbone, weights = _smollm2_dir(args.smollm2, args.work)
    out: dict[str, Any] = {"weights": weights}
    steps = 10  # one epoch of 10 batches
    for batch in (16, 64):
        for precision in ("fp32", "bf16"):
            cfg = _config(args.data_dir, [
                'data.task="SST-2"', f"model.backbone={json.dumps(backbone)}",
                'model.lora.target_modules=["q_proj", "v_proj"]', "partition.num_clients=1",
                f"partition.client_size={batch * steps}", f"train.batch_size={batch}",
                f'model.precision="{precision}"', f'train.device="{args.device}"'])
            exp, host, payloads = _host_rounds(cfg, 1)
            host.train_many(0, 0, payloads)  # warm-up
            _sync()
            began = time.perf_counter()
            host.train_many(1, 0, payloads)
            _sync()
            out[f"batch{batch}_{precision}_steps_per_s"] = round(
                steps / (time.perf_counter() - began), 2)
            del exp, host
        out[f"batch{batch}_speedup_bf16"] = round(out[f"batch{batch}_bf16_steps_per_s"]
                                                  / out[f"batch{batch}_fp32_steps_per_s"], 2)
    return out


def aggregation(args: argparse.Namespace) -> dict[str, Any]:
    """The server's weighted mean of K updates of the anchor's adapter where fedloom
    computes it, on the CPU (``weighted_average``), against the same mean on the GPU
    counting the updates' copies to the card and the mean's copy back."""
    generator = torch.Generator().manual_seed(0)
    adapter = Experiment.build(_config(args.data_dir, ['train.device="cpu"'])).model.get_params()
    out: dict[str, Any] = {"values": sum(t.numel() for t in adapter.values())}
    for k in (8, 100):
        updates = [{n: torch.randn(t.shape, generator=generator) for n, t in adapter.items()}
                   for _ in range(k)]
        weights = [float(i + 1) for i in range(k)]
        cpu = _best_of(3, lambda u=updates, w=weights: weighted_average(u, w))

        def on_gpu(updates: list[dict[str, torch.Tensor]] = updates,
                   weights: list[float] = weights) -> None:
            w = torch.tensor(weights, device=args.device) / sum(weights)
            mean = {n: sum(w[j] * u[n].to(args.device, non_blocking=True)
                           for j, u in enumerate(updates)) for n in updates[0]}
            {n: t.cpu() for n, t in mean.items()}
        gpu = _best_of(3, on_gpu)
        out[f"k{k}"] = {"cpu_ms": round(cpu * 1e3, 2), "gpu_with_copies_ms": round(gpu * 1e3, 2)}
    return out


def _best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        began = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - began)
    return min(times)


def flower(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import flwr  # noqa: F401
        import ray  # noqa: F401
    except ImportError as err:
        return {"not_run": f"{err.name} cannot be imported on this machine"}
    from benchmarks import anchor_flower

    cfg = _config(args.data_dir, [f'train.device="{args.device}"',
                                  f'output_dir="{args.work / "fl"}"'])
    exp = Experiment.build(cfg)
    simulate(exp, RunDir.create(cfg.output_dir, cfg.name))  # warm
    fedloom_s = simulate(exp, RunDir.create(cfg.output_dir, cfg.name))["wall_seconds"]
    flower_s = anchor_flower.simulate(args.data_dir, args.device,
                                      1 / 8 if args.device.startswith("cuda") else 0.0)["seconds"]
    return {"fedloom_rounds_s": fedloom_s, "flower_rounds_s": round(flower_s, 2),
            "ratio_fedloom_vs_flower": round(fedloom_s / flower_s, 2)}


RUNNERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "anchor": anchor, "agreement": agreement, "clients": clients, "memory": memory,
    "smollm2": smollm2, "aggregation": aggregation, "flower": flower}


# --- report ------------------------------------------------------------------------------

def _table(results: dict[str, Any]) -> str:
    lines = [f"# fedloom on {results['machine']['device']}", "",
             "| section | measurement | value |", "| --- | --- | --- |"]
    for section in SECTIONS:
        for key, value in _flat(results.get(section, {})):
            lines.append(f"| {section} | {key} | {value} |")
    return "\n".join(lines) + "\n"


def _flat(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows = []
    for key, value in tree.items():
        if isinstance(value, dict):
            rows += _flat(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu"))
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "glue"))
    parser.add_argument("--smollm2", default="smollm2-135m")
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--device", default="cuda",
                        help="the accelerator (a dry run of the script: cpu)")
    parser.add_argument("--sizes", default="8,64,256", help="client counts of 'clients'")
    parser.add_argument("--work", type=Path, help="where the runs go (default: OUT/work)")
    args = parser.parse_args()
    args.sizes = [int(k) for k in args.sizes.split(",")]
    try:
        device = resolve_device(args.device)
    except DeviceError as err:
        sys.exit(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or args.out / "work"
    results: dict[str, Any] = {"machine": {
        "device": describe(device), "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(), "cpus": os.cpu_count()}}
    for section in args.only.split(","):
        began = time.perf_counter()
        try:
            results[section] = RUNNERS[section](args)
        except Exception as err:  # noqa: BLE001 - a failed section is recorded; the others run
            results[section] = {"failed": f"{type(err).__name__}: {err}"[:400]}
        results[section]["section_s"] = round(time.perf_counter() - began, 1)
        (args.out / "gpu.json").write_text(json.dumps(results, indent=2))
        (args.out / "gpu.md").write_text(_table(results))
        print(section, json.dumps(results[section]), flush=True)


if __name__ == "__main__":
    main()

"""The golden runs (issue 67, "What must not change"): a fixed set of tiny configs on the
local runtime, how each is run, and what of its run directory is recorded.

Used by both ``tests/golden/record.py`` (which writes ``tests/golden/results.json``) and
``tests/test_golden_results.py`` (which runs every config again and compares), so that
the two cannot drift apart. A config is ``TINY_RAW`` of ``tests/conftest.py`` (tiny-bert,
MRPC, fp32) made smaller still by :data:`TINY`, plus its own overrides, ``[[transforms]]``
and ``[faults]``.

What is recorded of a run (:func:`record`):

- every row of ``metrics.jsonl``, whole (no field of a row varied between two runs of the
  same config when this was written, but CKKS's byte counts: :attr:`Golden.loose`;
  :data:`VOLATILE` names the keys to drop should a row ever hold wall-clock time);
- every safetensors file under ``checkpoints/``: the sha256 of its tensors (name, dtype,
  shape and bytes, in name order; not of the file, whose metadata's order varies) and, per
  tensor, its sum and L2 norm in float64. In the table (:func:`pack`), the tensors' names,
  dtypes and shapes are kept once per distinct list, in ``layouts``, and a file whose
  summaries equal an earlier file's of the same run points to it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from conftest import tiny_raw
from safetensors.torch import load_file

#: every golden run: ``TINY_RAW`` made smaller (40 MRPC examples, 3 clients, 2 rounds of 2
#: local steps of 4 examples, rank-2 LoRA on the attention's query only), scored after the
#: last round only and keeping only the last resumable checkpoint: the test stays fast and
#: the table small (the first round's aggregate is in ``global.prev`` and the like)
TINY = (
    "data.max_train_examples=40",
    "data.max_dev_examples=16",
    "data.max_length=32",
    "partition.num_clients=3",
    "federation.rounds=2",
    "train.batch_size=4",
    "train.local_steps=2",
    "model.lora.r=2",
    'model.lora.target_modules=["query"]',
    "checkpoint.keep=1",
    "eval.every=2",
)


@dataclass(frozen=True)
class Golden:
    """One golden config: ``section.key=value`` overrides of :data:`TINY`, its
    ``[[transforms]]`` and ``[faults]``; ``expected_change`` says why the refactor of
    issue 67 is expected to change its results (None: it must not); ``loose``: keys of its
    metrics rows (at any depth) that vary from run to run, each with the relative
    tolerance it is compared at."""

    overrides: tuple[str, ...] = ()
    transforms: tuple[dict[str, Any], ...] = ()
    faults: dict[str, Any] = field(default_factory=dict)
    expected_change: str | None = None
    loose: dict[str, float] = field(default_factory=dict)


#: the robust aggregation rules (``RuleName`` but "mean"), each with 5 clients of which one
#: attacks; f = 1 for Krum and Multi-Krum; Bulyan's f = 1 would need 4f + 3 = 7 clients
ROBUST_RULES: dict[str, tuple[str, ...]] = {
    "median": (),
    "trimmed_mean": ("aggregation.beta=0.2",),
    "krum": ("aggregation.num_malicious_nodes=1",),
    "multikrum": ("aggregation.num_malicious_nodes=1", "aggregation.num_nodes_to_select=2"),
    "bulyan": ("aggregation.num_malicious_nodes=0",),
    "norm_bounding": ("aggregation.max_norm=0.05",),
    "centered_clipping": ("aggregation.clip_iterations=2",),
    "fltrust": ("aggregation.root_examples=8",),
}
#: two model-poisoning attacks; 0.2 of 5 clients: one attacker
ATTACKS: dict[str, tuple[str, ...]] = {
    "sign_flip": ("attack.name=sign_flip", "attack.fraction=0.2", "attack.scale=4.0"),
    "alie": ("attack.name=alie", "attack.fraction=0.2"),
}

CONFIGS: dict[str, Golden] = {
    "fedavg": Golden(),
    "ditto": Golden(("algorithm.name=ditto",)),
    # DP-FedAdam with adaptive clipping (Andrew et al.): z = 0.5 needs count noise > z / 2
    "fedadam_adaptive_client_dp": Golden(
        (
            "algorithm.name=fedadam",
            "algorithm.eta=0.01",
            "privacy.level=client",
            "privacy.noise_multiplier=0.5",
            "privacy.clip_norm=0.1",
            "privacy.adaptive_quantile=0.5",
            "privacy.count_noise=0.5",
        )
    ),
    "dp_sgd": Golden(
        ("privacy.level=sample", "privacy.noise_multiplier=1.0", "privacy.clip_norm=1.0")
    ),
    "compress_up_down_error_feedback": Golden(
        transforms=(
            {"name": "compress", "compressor": "topk", "ratio": 0.05, "error_feedback": True},
            {"name": "compress_down", "compressor": "qsgd", "levels": 8},
        )
    ),
    # the seed drops client 3 in round 1, after it shared its keys: its masks are recovered
    "secagg_plus_dropout": Golden(
        ("secagg.protocol=secagg+", "partition.num_clients=5"), faults={"dropout": 0.3}
    ),
    # TenSEAL's serialized ciphertexts vary in length (by < 0.1 % between two runs); the
    # sum they decrypt to, and so every other number, does not
    "ckks": Golden(("secagg.protocol=ckks",), loose={"bytes_up": 0.01, "bytes_down": 0.01}),
    **{
        f"{rule}+{attack}": Golden(
            (f"aggregation.rule={rule}", "partition.num_clients=5", *settings, *attacker)
        )
        for rule, settings in ROBUST_RULES.items()
        for attack, attacker in ATTACKS.items()
    },
    # client-level DP with client-side noise under an attack: since issue 67's last step
    # the attacker's client sends its forgery through the chain's client half, which clips
    # and noises it as it does every update (before, it arrived unclipped)
    "client_dp_client_noise+sign_flip": Golden(
        (
            "privacy.level=client",
            "privacy.noise=client",
            "privacy.noise_multiplier=0.5",
            "privacy.clip_norm=0.1",
            "attack.name=sign_flip",
            "attack.fraction=0.34",
            "attack.scale=4.0",
        ),
    ),
    # server-side noise under an attack that forges updates: refused before issue 67 (the
    # forgery skipped the server's clipping), recorded since; the clients clip their
    # updates too (fixed clipping), so since the attacker's client sends its forgery only
    # its drift row changed (it is the update as trained, before the client's clipping)
    "client_dp_server_noise+boosted": Golden(
        (
            "privacy.level=client",
            "privacy.noise=server",
            "privacy.noise_multiplier=0.5",
            "privacy.clip_norm=0.1",
            "attack.name=boosted",
            "attack.fraction=0.34",
        ),
    ),
    # what the attackers' clients sending their forgeries made possible (issue 67): a
    # forging attack under secure aggregation, and a compressed forgery
    "secagg_plus+alie": Golden(
        ("secagg.protocol=secagg+", "partition.num_clients=5", *ATTACKS["alie"])
    ),
    "topk_error_feedback+boosted": Golden(
        ("attack.name=boosted", "attack.fraction=0.34"),
        transforms=({"name": "compress", "compressor": "topk", "error_feedback": True},),
    ),
    "ifca": Golden(
        (
            "algorithm.name=ifca",
            "partition.num_clients=4",
            "partition.concept.fraction=0.5",
            'partition.concept.kind="swap"',
        )
    ),
    "fedmosaic": Golden(("algorithm.name=fedmosaic", "model.lora.pq_blocks=1")),
}

#: keys of a metrics row (at any depth) that hold wall-clock measurements, dropped before
#: recording and comparing. No row holds one when this was written (two runs of each config
#: wrote the same rows, but for CKKS's byte counts, see ``loose``); fedloom's one wall-clock
#: number, ``wall_seconds``, is in summary.json, which is not recorded
VOLATILE = frozenset({"wall_seconds"})


def raw(name: str, output_dir: Path) -> dict[str, Any]:
    """The raw (unvalidated) config of the golden run ``name``, writing under ``output_dir``."""
    golden = CONFIGS[name]
    out = tiny_raw(*TINY, *golden.overrides, output_dir=output_dir)
    if golden.transforms:
        out["transforms"] = [dict(t) for t in golden.transforms]
    if golden.faults:
        out["faults"] = dict(golden.faults)
    return out


def run(name: str, tmp: Path) -> Path:
    """Run the golden config ``name`` on the local runtime under ``tmp``; its run directory."""
    from fedloom.config import validate
    from fedloom.experiment import Experiment
    from fedloom.runtime.rundir import RunDir
    from fedloom.server import simulate

    cfg = validate(raw(name, tmp))
    rundir = RunDir.create(tmp / "runs", "golden")
    simulate(Experiment.build(cfg), rundir)
    return rundir.path


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir``'s metrics.jsonl less their :data:`VOLATILE` keys."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [_stable(json.loads(line)) for line in lines if line.strip()]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(tensor_bytes(t))
    return digest.hexdigest()


def summary(tensor: torch.Tensor) -> list[float]:
    """[sum, L2 norm] of ``tensor`` in float64."""
    t = tensor.detach().cpu().to(torch.float64)
    return [float(t.sum()), float(t.norm())]


def checkpoints(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Every safetensors file under ``run_dir/checkpoints`` by its path there: its
    ``sha256`` (:func:`tensors_sha256`) and ``tensors``, name -> (dtype, shape, [sum, L2])."""
    root = run_dir / "checkpoints"
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(root.rglob("*.safetensors")):
        tensors = load_file(str(path))
        out[path.relative_to(root).as_posix()] = {
            "sha256": tensors_sha256(tensors),
            "tensors": {
                name: (str(t.dtype).removeprefix("torch."), list(t.shape), summary(t))
                for name, t in sorted(tensors.items())
            },
        }
    return out


def record(run_dir: Path) -> dict[str, Any]:
    """What the table keeps of a golden run: its metrics rows and checkpoints."""
    return {"metrics": metrics_rows(run_dir), "checkpoints": checkpoints(run_dir)}


def machine() -> dict[str, Any]:
    """What decides whether two machines' float results can be equal bit for bit."""
    import platform

    return {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


# --- the table's layout: tensor names, dtypes and shapes once per distinct list -----------


def pack(recorded: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table of the configs' :func:`record` s (``{"configs": ..., "layouts": ...}``):
    each file's ``tensors`` as a ``layout``, an index into ``layouts`` (lists of [name,
    dtype, shape]), and its ``summaries`` in the layout's order, or ``summaries_as``: the
    earlier file of the same config with the same dtypes, shapes and summaries (its
    tensors under other names, or the same file kept twice, as ``resume/`` keeps the last
    round's)."""
    layouts: list[list[Any]] = []
    configs: dict[str, Any] = {}
    for name, entry in recorded.items():
        files: dict[str, Any] = {}
        seen: dict[str, str] = {}  # the files' (dtypes, shapes, summaries) -> the first
        for rel, item in entry["checkpoints"].items():
            layout = [[n, dtype, list(shape)] for n, (dtype, shape, _) in item["tensors"].items()]
            if layout not in layouts:
                layouts.append(layout)
            summaries = [list(s) for _, _, s in item["tensors"].values()]
            values = json.dumps([[d, shape, s] for (_, d, shape), s in zip(layout, summaries)])
            files[rel] = {"sha256": item["sha256"], "layout": layouts.index(layout)}
            if values in seen:
                files[rel]["summaries_as"] = seen[values]
            else:
                seen[values] = rel
                files[rel]["summaries"] = summaries
        configs[name] = {**entry, "checkpoints": files}
    return {"configs": configs, "layouts": layouts}


def unpack_checkpoints(table: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """The config ``name``'s checkpoints in :func:`checkpoints`' form, from the table."""
    files = table["configs"][name]["checkpoints"]
    out: dict[str, dict[str, Any]] = {}
    for rel, item in files.items():
        summaries = files[item.get("summaries_as", rel)]["summaries"]
        layout = table["layouts"][item["layout"]]
        out[rel] = {
            "sha256": item["sha256"],
            "tensors": {n: (d, shape, s) for (n, d, shape), s in zip(layout, summaries)},
        }
    return out


def sum_tolerance(shape: list[int], l2: float, rel: float) -> float:
    """How far a tensor's sum may move when each of its n values moves by ``rel`` of
    itself: rel · ‖x‖₁ ≤ rel · √n · ‖x‖₂ (a sum near 0 of large values is not compared at
    ``rel`` of itself)."""
    return rel * math.sqrt(math.prod(shape)) * l2


# --- comparing -------------------------------------------------------------------------------

#: metrics: floats equal to these (math.isclose), across machines whose SIMD differs
METRICS_REL, METRICS_ABS = 1e-6, 1e-9
#: checkpoints on another machine: each tensor's L2 norm and sum to this, relative
TENSORS_REL = 1e-5


def _value_differences(
    want: Any, got: Any, where: str, loose: dict[str, float], tolerance: float | None
) -> list[str]:
    numbers = (int, float)
    if isinstance(want, numbers) and isinstance(got, numbers):
        if isinstance(want, bool) or isinstance(got, bool):
            return [] if want is got else [f"{where}: {got!r}, recorded {want!r}"]
        if tolerance is not None:
            close = math.isclose(got, want, rel_tol=tolerance, abs_tol=METRICS_ABS)
        elif isinstance(want, int) and isinstance(got, int):
            close = want == got
        else:
            close = math.isclose(got, want, rel_tol=METRICS_REL, abs_tol=METRICS_ABS)
        return [] if close else [f"{where}: {got!r}, recorded {want!r}"]
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in [*want, *(k for k in got if k not in want)]:
            if key not in got or key not in want:
                which = "missing" if key not in got else "not recorded"
                out.append(f"{where}.{key}: {which}")
                continue
            tol = loose.get(key, tolerance)
            out += _value_differences(want[key], got[key], f"{where}.{key}", loose, tol)
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(got)} items, recorded {len(want)}"]
        out = []
        for i, (w, g) in enumerate(zip(want, got)):
            out += _value_differences(w, g, f"{where}[{i}]", loose, tolerance)
        return out
    return [] if want == got else [f"{where}: {got!r}, recorded {want!r}"]


def metrics_differences(
    want: list[dict[str, Any]], got: list[dict[str, Any]], loose: dict[str, float]
) -> list[str]:
    """How the rows ``got`` differ from the recorded ``want``: row by row, each number
    within :data:`METRICS_REL` / :data:`METRICS_ABS` (an int recorded as an int exactly,
    a key of ``loose`` within its tolerance), everything else equal."""
    if len(want) != len(got):
        return [f"metrics.jsonl: {len(got)} rows, recorded {len(want)}"]
    out = []
    for i, (w, g) in enumerate(zip(want, got)):
        where = f"metrics row {i} (round {w.get('round')}, {w.get('scope')})"
        out += _value_differences(w, g, where, loose, None)
    return out


def checkpoint_differences(
    want: dict[str, dict[str, Any]], got: dict[str, dict[str, Any]], exact: bool
) -> list[str]:
    """How the checkpoints ``got`` (:func:`checkpoints`) differ from the recorded ``want``:
    the same files, each with the same tensors (names, dtypes, shapes); with ``exact``, the
    same sha256 of every file; else every tensor's L2 norm within :data:`TENSORS_REL` of
    the recorded one, and its sum within :func:`sum_tolerance`."""
    out = [f"checkpoints/{rel}: missing" for rel in want if rel not in got]
    out += [f"checkpoints/{rel}: not recorded" for rel in got if rel not in want]
    for rel in (r for r in want if r in got):
        where = f"checkpoints/{rel}"
        w, g = want[rel]["tensors"], got[rel]["tensors"]
        layout = {n: (d, list(s)) for n, (d, s, _) in w.items()}
        if layout != {n: (d, list(s)) for n, (d, s, _) in g.items()}:
            names = sorted(set(w) ^ set(g)) or sorted(
                n for n in w if layout[n] != (g[n][0], list(g[n][1]))
            )
            out.append(
                f"{where}: other tensors than recorded (names, dtypes or shapes): {names[:5]}"
            )
            continue
        changed = []
        for name, (_, shape, (want_sum, want_l2)) in w.items():
            got_sum, got_l2 = g[name][2]
            if not (
                math.isclose(got_l2, want_l2, rel_tol=TENSORS_REL, abs_tol=1e-12)
                and abs(got_sum - want_sum) <= sum_tolerance(shape, want_l2, TENSORS_REL)
            ):
                changed.append(
                    f"{where}: {name}: sum {got_sum!r}, L2 {got_l2!r}, recorded "
                    f"sum {want_sum!r}, L2 {want_l2!r}"
                )
        if exact and want[rel]["sha256"] != got[rel]["sha256"]:
            # the same machine: bit for bit; the summaries say which tensors moved
            out.append(f"{where}: sha256 {got[rel]['sha256']}, recorded {want[rel]['sha256']}")
            out += changed[:5] or [f"{where}: every tensor's sum and L2 within tolerance"]
        elif not exact:
            out += changed
    return out

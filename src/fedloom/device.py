"""Where a run computes (``train.device``) and in what precision (``model.precision``).

One rule, as in the shared design: the *client boundary is where the device changes*.
What travels (``Params``), the server's state, its aggregation and every checkpoint live
on the CPU; a client's payload and local state go to the device when it starts a round
(:func:`to_device`) and come back when it ends (:func:`to_cpu`), so that many clients
share one device while only the ones training hold device memory (their adapters and
optimizer moments are paged to host memory between rounds). A run made on a GPU
therefore resumes and evaluates on a machine without one.

The precision a device computes in, for ``model.precision = "auto"``: float32 on CUDA, its
matmuls on TF32 tensor cores (``train.tf32``), which on an H200 trained MiniLM clients 1.1
to 2.3 times and SmolLM2-135M 1.3 times faster than bfloat16 autocast at fedloom's batch
sizes (batches of 16 leave the card waiting on kernel launches, and autocast adds a cast
per weight and activation; BENCHMARKS.md); bfloat16 (``"bf16"``) and float16 with a loss
scale (``"fp16"``, for cards without bfloat16) are there to choose. On a CPU, bfloat16
where it computes it natively (avx512_bf16 or AMX, where it was measured faster) and
float32 elsewhere; float32 on Apple's MPS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
CPU = torch.device("cpu")


class DeviceError(ValueError):
    """``train.device`` names a device this machine does not have."""


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a torch device: ``"auto"`` is the first CUDA device when torch
    sees one, else the CPU. A device this machine lacks is a :class:`DeviceError`
    naming the key."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(
            f"train.device: {name!r} is not a device (one of {', '.join(DEVICE_CHOICES)})"
        ) from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = (
                "this torch has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA device is visible"
            )
            raise DeviceError(
                f'train.device: {name!r} asked for a GPU, but {built}; use "cpu" or "auto"'
            )
        index = 0 if device.index is None else device.index
        count = torch.cuda.device_count()
        if index >= count:
            raise DeviceError(
                f"train.device: {name!r}: this machine has {count} CUDA "
                f"device(s), cuda:0 to cuda:{count - 1}"
            )
        return torch.device("cuda", index)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"train.device: {name!r}: Apple's MPS is not available here")
        return device
    raise DeviceError(
        f"train.device: {name!r} is not supported (one of {', '.join(DEVICE_CHOICES)})"
    )


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (avx512_bf16 or AMX tiles)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def resolve_precision(precision: str, device: torch.device | None = None) -> str:
    """``model.precision`` as it runs on ``device`` (default: the CPU): ``"auto"`` becomes
    "bf16" or "fp32" (module docstring); a precision the device cannot run is a ValueError
    naming the key."""
    device = device or torch.device("cpu")
    if precision not in ("fp32", "bf16", "fp16", "auto"):
        raise ValueError(f"model.precision: {precision!r} is not 'fp32', 'bf16', 'fp16' or 'auto'")
    cuda = device.type == "cuda"
    if precision == "auto":
        return "bf16" if device.type == "cpu" and native_cpu_bf16() else "fp32"
    if precision == "fp16" and not cuda:
        raise ValueError(
            f"model.precision: 'fp16' (with a gradient scaler) needs a CUDA device, "
            f"not {device.type}; use 'bf16' or 'fp32'"
        )
    if precision == "bf16" and cuda and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(
            f"model.precision: {torch.cuda.get_device_name(device)} has no "
            f"bfloat16; use 'fp16' or 'auto'"
        )
    return precision


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision; None for float32 (no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def set_tf32(device: torch.device, enabled: bool) -> None:
    """TF32 tensor-core matmuls and convolutions on CUDA (``train.tf32``); nothing elsewhere."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def describe(device: torch.device) -> str:
    """The device as a person reads it: ``cuda:0 (NVIDIA H200)`` or ``cpu``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` (nested dicts, lists, tuples and dataclasses) with ``fn`` applied to every
    tensor; other values as they are."""
    if torch.is_tensor(tree):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((k, _map_tensors(v, fn)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(
            tree,
            **{
                f.name: _map_tensors(getattr(tree, f.name), fn)
                for f in dataclasses.fields(tree)
                if f.init
            },
        )
    return tree


def to_device(tree: T, device: torch.device) -> T:
    """``tree`` (nested dicts, lists, tuples and dataclasses of tensors and plain values)
    with every tensor on ``device``; tensors already there are kept, not copied. A 0-dim
    tensor (an optimizer's step clock, a counter) stays where it is: torch combines it
    with tensors on any device, and an optimizer reads its clock on the host."""
    return _map_tensors(tree, lambda t: t if t.dim() == 0 else t.to(device))


def to_cpu(tree: T) -> T:
    """``tree`` with every tensor on the CPU, 0-dim ones too: what is saved or sent."""
    return _map_tensors(tree, lambda t: t.cpu())


def memory(device: torch.device) -> dict[str, int] | None:
    """Bytes of device memory allocated now and at the peak so far (CUDA); None elsewhere."""
    if device.type != "cuda":
        return None
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "peak": torch.cuda.max_memory_allocated(device),
    }


@dataclass(frozen=True)
class Footprint:
    """Bytes a model holds once (``backbone``: frozen weights and buffers) and per client
    (``per_client``: its adapter and optimizer moments, what a client's state pages in)."""

    backbone: int
    per_client: int


def footprint(module: nn.Module, optimizer: str, momentum: float) -> Footprint:
    """``module``'s :class:`Footprint` under ``train.optimizer`` (AdamW keeps two moments
    per trainable value, SGD one with momentum, none without)."""
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
    frozen += sum(b.numel() * b.element_size() for b in module.buffers())
    moments = 2 if optimizer == "adamw" else int(momentum > 0)
    return Footprint(frozen, trainable * (1 + moments))

"""Nested state as safetensors: a client's ``ctx.state``, a server's state, a message.

State is a nested structure of dicts, lists, tuples, numbers, strings, tensors, numpy
arrays and fedloom's own dataclasses (``ServerState``, CFL's ``Split``): AdamW's
``state_dict()``, a personal adapter, a mixing weight, a cluster tree. safetensors stores
flat named tensors and string metadata only, so the tensors are stored under their path in
the structure (``personal/encoder...lora_B.weight``, ``optimizer/state/0/exp_avg``) and the
rest of the structure as JSON in the metadata, with each tensor replaced by a reference.
Restoring gives back the same types (int dict keys stay ints, tuples stay tuples) and the
same bits. A tensor reached twice is stored once and restored as one tensor.

(Written here because torch.save would need pickle, which loading must not trust: a
dataclass is rebuilt only when its class lives in the ``fedloom`` package.)
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load, save

from fedloom.runtime.rundir import load_checkpoint, save_params

_TENSOR, _ARRAY = "__tensor__", "__ndarray__"
#: the metadata key of the structure (the other metadata keys are the caller's)
STRUCTURE_KEY = "structure"


class _Flattener:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.seen: dict[int, str] = {}

    def tensor(self, value: torch.Tensor, path: str) -> str:
        if id(value) not in self.seen:
            self.seen[id(value)] = path
            # a copy: views and tensors sharing storage cannot be saved as they are
            self.tensors[path] = value.detach().clone()
        return self.seen[id(value)]

    def node(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return {_TENSOR: self.tensor(value, path)}
        if isinstance(value, np.ndarray):
            return {_ARRAY: self.tensor(torch.from_numpy(np.ascontiguousarray(value)), path)}
        if isinstance(value, np.generic):
            return {"numpy": [value.dtype.str, value.item()]}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            cls = type(value)
            return {
                "dataclass": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {
                    f.name: self.node(getattr(value, f.name), f"{path}/{f.name}")
                    for f in dataclasses.fields(value)
                    if f.init
                },
            }
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"state key {key!r} at {path or '/'} is not a str or int")
            return {"dict": [[k, self.node(v, f"{path}/{k}")] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            kind = "tuple" if isinstance(value, tuple) else "list"
            return {kind: [self.node(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        raise TypeError(f"state at {path or '/'}: cannot store a {type(value).__name__}")


def _dataclass(name: str) -> type:
    module, _, qualname = name.partition(":")
    if module != "fedloom" and not module.startswith("fedloom."):
        raise ValueError(f"state names the class {name}, which is not fedloom's")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"state names {name}, which is not a dataclass")
    return cls


def _restore(node: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    if _TENSOR in node:
        return tensors[node[_TENSOR]]
    if _ARRAY in node:
        return tensors[node[_ARRAY]].numpy()
    if "numpy" in node:
        dtype, value = node["numpy"]
        return np.dtype(dtype).type(value)
    if "dataclass" in node:
        return _dataclass(node["dataclass"])(
            **{k: _restore(v, tensors) for k, v in node["fields"].items()}
        )
    if "dict" in node:
        return {k: _restore(v, tensors) for k, v in node["dict"]}
    if "list" in node:
        return [_restore(v, tensors) for v in node["list"]]
    if "tuple" in node:
        return tuple(_restore(v, tensors) for v in node["tuple"])
    return node["value"]


def to_bytes(state: Any) -> bytes:
    """``state`` as safetensors bytes (what travels between processes: never pickle)."""
    flat = _Flattener()
    skeleton = flat.node(state, "")
    return save(flat.tensors, metadata={STRUCTURE_KEY: json.dumps(skeleton)})


def from_bytes(blob: bytes) -> Any:
    """The state :func:`to_bytes` encoded."""
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    return _restore(json.loads(header["__metadata__"][STRUCTURE_KEY]), load(blob))


def save_state(path: Path, state: Any, metadata: dict[str, str] | None = None) -> None:
    """Atomically write ``state`` with a checksum (:func:`~fedloom.runtime.rundir.save_params`)."""
    flat = _Flattener()
    skeleton = flat.node(state, "")
    save_params(path, flat.tensors, {**(metadata or {}), STRUCTURE_KEY: json.dumps(skeleton)})


def load_state(path: Path) -> tuple[Any, dict[str, str]]:
    """(the state, the other metadata) :func:`save_state` wrote; the checksum is verified
    first (:class:`~fedloom.runtime.rundir.CheckpointError` names a damaged file)."""
    tensors, meta = load_checkpoint(path)
    skeleton = json.loads(meta.pop(STRUCTURE_KEY))
    return _restore(skeleton, tensors), meta

"""A client's persistent local state on disk: ``ctx.state`` as one safetensors file.

Local state is a nested structure of dicts, lists, numbers, strings and tensors (AdamW's
``state_dict()``, a personal adapter, a mixing weight). safetensors stores flat named
tensors and string metadata only, so the tensors are stored under their path in the
structure (``personal/encoder...lora_B.weight``, ``optimizer/state/0/exp_avg``) and the
rest of the structure as JSON in the metadata, with each tensor replaced by a reference.
(Written here because torch.save would need pickle, which loading must not trust.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fedloom.runtime.rundir import load_params, save_params

_TENSOR = "__tensor__"


def _flatten(node: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        tensors[path] = node
        return {_TENSOR: path}
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, (str, int)):
                raise TypeError(f"client state key {key!r} at {path or '/'} is not a str or int")
        # JSON object keys are strings: int keys (optimizer state ids) keep their type
        return {"dict": [[k, _flatten(v, f"{path}/{k}", tensors)] for k, v in node.items()]}
    if isinstance(node, (list, tuple)):
        return {"list": [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(node)]}
    if node is None or isinstance(node, (bool, int, float, str)):
        return {"value": node}
    raise TypeError(f"client state at {path or '/'}: cannot store a {type(node).__name__}")


def _restore(node: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    if _TENSOR in node:
        return tensors[node[_TENSOR]]
    if "dict" in node:
        return {k: _restore(v, tensors) for k, v in node["dict"]}
    if "list" in node:
        return [_restore(v, tensors) for v in node["list"]]
    return node["value"]


def save_client_state(path: Path, state: dict[str, Any], round_: int, client_id: int) -> None:
    """Atomically write ``state`` (see the module docstring for the layout)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "", tensors)
    save_params(path, tensors, {"round": str(round_), "client_id": str(client_id),
                                "structure": json.dumps(skeleton)})


def load_client_state(path: Path) -> dict[str, Any]:
    """The state :func:`save_client_state` wrote."""
    from safetensors import safe_open

    tensors = load_params(path)
    with safe_open(str(path), framework="pt") as f:
        skeleton = json.loads(f.metadata()["structure"])
    return _restore(skeleton, tensors)

"""Half-precision upload: the client sends its floating-point tensors as float16 (half the
bytes of float32), the server casts them back to the dtype it sent.

The simplest lossy codec: each value keeps a relative error of at most 2⁻¹¹ (float16's
unit roundoff) within float16's range (|x| < 65504; larger values overflow to ±inf, which
the server's update check then rejects). Adapters and their updates are far inside that
range. fedloom casts the whole update, not the delta, so a tensor the payload lacks comes
back as float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedloom.params import Params
from fedloom.transforms.base import Served, Stage, Transform


@dataclass(frozen=True)
class HalfPrecision(Transform):
    name: ClassVar[str] = "half_precision"
    stage: ClassVar[Stage] = "compress"

    @property
    def needs_each_update(self) -> bool:
        """The server casts each client's update back to the dtype it sent it."""
        return True

    def up(
        self,
        update: Params,
        payload: Params,
        client_id: int,
        round_: int,
        state: dict[str, Any],
    ) -> Params:
        return {n: t.half() if t.is_floating_point() else t for n, t in update.items()}

    def server(
        self,
        updates: dict[int, Params],
        payloads: dict[int, Params],
        round_: int,
        state: Mapping[str, Any],
    ) -> Served:
        def restore(update: Params, payload: Params) -> Params:
            return {
                n: t.to(payload[n].dtype if n in payload else torch.float32)
                if t.dtype == torch.float16
                else t
                for n, t in update.items()
            }

        return Served({cid: restore(update, payloads[cid]) for cid, update in updates.items()})

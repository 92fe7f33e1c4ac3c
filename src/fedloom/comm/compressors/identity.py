"""The identity and the floating-point casts: the uncompressed reference, half precision
(float16: a relative error of at most 2⁻¹¹ within |x| < 65504) and bfloat16 (float32's
range, a relative error of at most 2⁻⁸), each through the same header as every operator so
that bytes compare fairly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.comm.compressors.base import Compressor, pack_header, unpack_header


@dataclass(frozen=True)
class Cast(Compressor):
    """x sent as ``wire`` dtype values, restored to its own dtype."""

    name: ClassVar[str] = "identity"
    wire: ClassVar[torch.dtype] = torch.float32

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        values = x.detach().to("cpu", self.wire).contiguous().view(torch.uint8)
        return pack_header(x.shape, x.dtype) + values.numpy().tobytes()

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, body = unpack_header(data)
        raw = torch.from_numpy(np.frombuffer(body, dtype=np.uint8).copy())
        return raw.view(self.wire).to(dtype).reshape(shape)

    def omega(self, x: torch.Tensor) -> float | None:
        return 0.0 if self.wire == torch.float32 else None


@dataclass(frozen=True)
class Identity(Cast):
    name: ClassVar[str] = "identity"
    wire: ClassVar[torch.dtype] = torch.float32


@dataclass(frozen=True)
class Float16(Cast):
    name: ClassVar[str] = "fp16"
    unbiased: ClassVar[bool] = False
    wire: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True)
class BFloat16(Cast):
    name: ClassVar[str] = "bf16"
    unbiased: ClassVar[bool] = False
    wire: ClassVar[torch.dtype] = torch.bfloat16

"""The compressor protocol: a tensor encoded to the ``bytes`` that travel, decoded back.

Every operator encodes one tensor to a self-describing byte string (a small header with
the dtype and shape, then the operator's body) and decodes it back to a tensor of that
dtype and shape. Those bytes are what every runtime carries (as a ``uint8`` tensor,
:func:`as_tensor`) and what ``bytes_up`` / ``bytes_down`` count, so operators compare by
the bytes they really cost, header included.

A compressor is a frozen dataclass whose fields are its hyperparameters; a mistake is a
``ValueError`` whose message starts with the key (``k: ...``), which the caller prefixes
with its section (``transforms[0].k``, ``algorithm.k``). :meth:`Compressor.check` refuses
what a vector of d values cannot satisfy (k > d), once d is known.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

#: the dtypes an encoding can restore, by their one-byte code in the header
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
)


def pack_header(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> bytes:
    """dtype code (1 byte), number of dimensions (1 byte), each dimension (uint32, LE)."""
    if dtype not in DTYPES:
        raise ValueError(f"cannot encode a {dtype} tensor (floating point only)")
    dims = tuple(int(s) for s in shape)
    return struct.pack(f"<BB{len(dims)}I", DTYPES.index(dtype), len(dims), *dims)


def unpack_header(data: bytes) -> tuple[tuple[int, ...], torch.dtype, memoryview]:
    """(shape, dtype, the body after the header) of an encoding; a ``ValueError`` when
    ``data`` is not one."""
    view = memoryview(data)
    if len(view) < 2:
        raise ValueError("not an encoded tensor: shorter than its header")
    code, ndim = view[0], view[1]
    if code >= len(DTYPES) or len(view) < 2 + 4 * ndim:
        raise ValueError("not an encoded tensor: bad header")
    shape = struct.unpack_from(f"<{ndim}I", view, 2)
    return tuple(shape), DTYPES[code], view[2 + 4 * ndim :]


def as_tensor(data: bytes) -> torch.Tensor:
    """The bytes as the ``uint8`` tensor that travels in a ``Params``."""
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def as_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes a ``uint8`` tensor carries (the inverse of :func:`as_tensor`)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError(f"not an encoding: a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
    return tensor.cpu().numpy().tobytes()


@dataclass(frozen=True)
class Compressor:
    """A compression operator C; subclasses set the class attributes and override
    :meth:`encode` and :meth:`decode` (and :meth:`check`, :meth:`omega` where they apply)."""

    name: ClassVar[str] = "base"
    #: E[C(x)] = x (unbiased), else a biased operator that needs error feedback to converge
    unbiased: ClassVar[bool] = True
    #: draws random numbers (its encode uses the generator)
    random: ClassVar[bool] = False
    #: acts on each matrix (PowerSGD) rather than on one flat vector; a caller passes 2-D
    #: tensors to it and sends other tensors uncompressed
    matrix: ClassVar[bool] = False

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        """The bytes of C(x); ``generator`` draws its randomness (None: torch's default),
        ``state`` is the encoder's own state across calls (PowerSGD's warm start), kept by
        the caller; None for a stateless call."""
        raise NotImplementedError

    def decode(self, data: bytes) -> torch.Tensor:
        """C(x) from its bytes, with x's shape and dtype."""
        raise NotImplementedError

    def check(self, numel: int) -> None:
        """Refuse hyperparameters a tensor of ``numel`` values cannot satisfy (k > d)."""

    def check_matrices(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Refuse hyperparameters that compress none of the matrices of ``shapes`` (a
        matrix operator's; the shapes of the 2-D tensors it is given)."""

    def omega(self, x: torch.Tensor) -> float | None:
        """The published variance bound ω of an unbiased operator at ``x``:
        E‖C(x) − x‖² ≤ ω‖x‖²; None for a biased operator."""
        return None

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """C(x): encoded and decoded (what the receiver reconstructs)."""
        return self.decode(self.encode(x, generator)).to(x.device)

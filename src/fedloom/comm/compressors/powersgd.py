"""PowerSGD: a rank-r approximation by one step of subspace (power) iteration with a warm
start (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization", NeurIPS 2019).

Rule, for a matrix M (n × m) and r = ``rank``::

    Q ← the previous call's Q (state["q"]) if its shape is m × r, else a Gaussian m × r
    P ← M Q;   P ← orthonormalize(P)   (reduced QR)
    Q ← Mᵀ P;  state["q"] ← Q
    C(M) = P Qᵀ = P Pᵀ M

C(M) is the projection of M onto span(P), so ‖C(M) − M‖ ≤ ‖M‖ and, when r ≥ rank(M), a
Gaussian start spans M's column space with probability 1 and C(M) = M at once. Repeated
calls on the same (or a slowly changing) M are power iterations: the error falls towards
that of the best rank-r approximation. Biased (use it with error feedback); ω is None.

Encoding: the header, a flag byte, then for a 2-D tensor (flag 1) P (n × r) and Q (m × r)
as float32: 2 + 8 + 1 + 4r(n + m) bytes (r read back from the length). Any other tensor
(1-D biases, scalars, 3-D) travels uncompressed (flag 0): its values as float32,
2 + 4·ndim + 1 + 4d bytes, like ``identity``.

How fedloom differs: r is capped at min(n, m) (a rank-min(n, m) P already reconstructs M
exactly; the cap is applied in :meth:`PowerSGD.encode`, where the shape is known, since
:meth:`~fedloom.comm.compressors.base.Compressor.check` sees only the number of values).
A matrix at r ≥ min(n, m) travels exact, as factors no smaller than itself: a rank that
leaves every matrix so is refused (:meth:`PowerSGD.check_matrices`).
The error feedback and the all-reduce of P and Q across workers that the paper's
algorithm performs are the caller's (an algorithm or transform), not the operator's: each
encode is one worker's compression of one matrix, and ``state`` is that worker's warm
start for that matrix. The first Q is drawn from the generator passed (the paper seeds it
identically on every worker so that P and Q can be averaged; pass the same generator
state to get that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.comm.compressors.base import Compressor, pack_header, unpack_header
from fedloom.comm.compressors.coding import at_least_one, expect_length, flat32, numel, restore

RAW, LOW_RANK = 0, 1


@dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-``rank`` approximation P Qᵀ of each matrix, one warm-started power step."""

    name: ClassVar[str] = "powersgd"
    unbiased: ClassVar[bool] = False
    random: ClassVar[bool] = True
    matrix: ClassVar[bool] = True
    #: r, the rank of the approximation (capped at min(n, m))
    rank: int = 1

    def __post_init__(self) -> None:
        at_least_one("rank", self.rank)

    def check_matrices(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """r below the smaller side of at least one matrix: at r ≥ min(n, m) the factors
        hold 4r(n + m) ≥ 4nm bytes, and the matrix travels exact, not compressed."""
        if not shapes:
            raise ValueError(
                "compressor: powersgd compresses matrices, and none of the tensors sent is one"
            )
        if any(self.rank < min(shape) for shape in shapes):
            return
        n, m = max(shapes, key=min)
        raise ValueError(
            f"rank: {self.rank} is not below the smaller side of any matrix sent (the widest "
            f"is {n} x {m}), so powersgd would send each one whole, as factors no smaller "
            f"than the matrix; use a rank below {min(n, m)}"
        )

    def encode(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        state: dict[str, Any] | None = None,
    ) -> bytes:
        flat = flat32(x)
        head = pack_header(x.shape, x.dtype)
        if x.dim() != 2 or flat.size == 0:
            return head + bytes([RAW]) + flat.tobytes()
        n, m = x.shape
        r = min(self.rank, n, m)
        matrix = torch.from_numpy(flat).reshape(n, m)
        previous = None if state is None else state.get("q")
        if isinstance(previous, torch.Tensor) and previous.shape == (m, r):
            q = previous.to("cpu", torch.float32)
        else:
            q = torch.randn(m, r, generator=generator)
        p = torch.linalg.qr(matrix @ q).Q
        q = matrix.T @ p
        if state is not None:
            state["q"] = q.clone()
        return head + bytes([LOW_RANK]) + p.numpy().tobytes() + q.numpy().tobytes()

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, body = unpack_header(data)
        if len(body) < 1:
            raise ValueError("not a powersgd encoding: no flag byte")
        flag, rest = body[0], body[1:]
        d = numel(shape)
        if flag == RAW:
            expect_length(rest, 4 * d, "powersgd")
            return restore(np.frombuffer(rest, dtype="<f4"), shape, dtype)
        if flag != LOW_RANK or len(shape) != 2:
            raise ValueError(f"not a powersgd encoding: flag {flag} for shape {shape}")
        n, m = shape
        r, remainder = divmod(len(rest), 4 * (n + m)) if n + m else (0, 1)
        if remainder or not 1 <= r <= min(n, m):
            raise ValueError(
                f"not a powersgd encoding: {len(rest)} bytes for factors of a {n} x {m} "
                "matrix (truncated or corrupted)"
            )
        values = torch.from_numpy(np.frombuffer(rest, dtype="<f4").copy())
        p = values[: n * r].reshape(n, r)
        q = values[n * r :].reshape(m, r)
        return restore((p @ q.T).numpy(), shape, dtype)

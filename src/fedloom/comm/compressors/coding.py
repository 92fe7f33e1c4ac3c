"""Bit-level coding shared by the operators: fixed-width fields, Elias-γ codes, the
flattening of the input and the checks of an encoding's length, all vectorized with numpy
(no Python loop over coordinates or codes).

Bits are written most significant first (``np.packbits``' order) and the last byte is
padded with zero bits.

Elias-γ (Elias 1975) writes a positive integer k with b = bit_length(k) bits as b − 1
zeros followed by the b binary digits of k: 2b − 1 bits, i.e. k itself written in 2b − 1
bits. :func:`gamma_encode` lays out a sequence of such codes as two blocks: first the
unary parts (b − 1 zeros and the leading 1 of every code), then the b − 1 remaining bits
of every code. That is the concatenated codes' bits in another order (so exactly their
length), and it decodes without a sequential scan: the positions of the 1 bits in the
first block give every code's length.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def flat32(x: torch.Tensor) -> np.ndarray:
    """x as a flat float32 numpy array (a CPU copy where x lives elsewhere); a
    ``ValueError`` for a non-float tensor or non-finite values. The operators work in numpy:
    element-wise torch kernels on a few hundred thousand values pay a thread-pool hand-off
    that numpy does not."""
    if not torch.is_floating_point(x):
        raise ValueError(f"cannot encode a {x.dtype} tensor (floating point only)")
    flat = x.detach().to("cpu", torch.float32).reshape(-1).numpy()
    if flat.size and not np.isfinite(flat).all():
        raise ValueError("cannot encode non-finite values (inf or nan)")
    return flat


def restore(values: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The decoded float32 values with the encoded tensor's shape and dtype."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if not values.flags.writeable:
        values = values.copy()
    return torch.from_numpy(values).to(dtype).reshape(shape)


def uniform(d: int, generator: torch.Generator | None) -> np.ndarray:
    """d uniform draws in [0, 1) (float64) from ``generator`` (None: torch's default)."""
    return torch.rand(d, dtype=torch.float64, generator=generator).numpy()


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def expect_length(body: memoryview | bytes, size: int, what: str) -> None:
    """A ``ValueError`` unless the body has exactly ``size`` bytes."""
    if len(body) != size:
        raise ValueError(
            f"not a {what} encoding: {len(body)} bytes of body where {size} are expected "
            "(truncated or corrupted)"
        )


def bit_length(values: np.ndarray) -> np.ndarray:
    """The number of binary digits of each non-negative integer (0 for 0), exact below
    2⁵³ (frexp's exponent)."""
    return np.frexp(values.astype(np.float64))[1].astype(np.int64)


def fixed_width(levels: int) -> int:
    """⌈log2(levels + 1)⌉: the bits of a level in [0, levels]."""
    return int(levels).bit_length()


def pack_fixed(values: np.ndarray, width: int) -> bytes:
    """Each value (an unsigned integer below 2**width, 1 ≤ width ≤ 32) in ``width`` bits."""
    if width < 1 or width > 32:
        raise ValueError(f"width: {width} not in [1, 32]")
    values = values.astype(np.uint32)
    bits = np.empty((values.size, width), dtype=np.uint8)
    for j in range(width):  # a loop over the bit positions, vectorized over the values
        bits[:, j] = (values >> np.uint32(width - 1 - j)) & np.uint32(1)
    return np.packbits(bits.reshape(-1)).tobytes()


def unpack_fixed(data: memoryview | bytes, count: int, width: int) -> np.ndarray:
    """The ``count`` values of ``width`` bits that :func:`pack_fixed` wrote (int64)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    bits = np.unpackbits(raw, count=count * width).reshape(count, width)
    values = np.zeros(count, dtype=np.int64)
    for j in range(width):
        values <<= 1
        values |= bits[:, j]
    return values


def fixed_bytes(count: int, width: int) -> int:
    """The bytes of :func:`pack_fixed`: ⌈count · width / 8⌉."""
    return -(-count * width // 8)


def write_fields(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The bits (uint8 0/1) of each value written in its own width (0 allowed), MSB first."""
    widths = widths.astype(np.int64)
    total = int(widths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.uint8)
    owner = np.repeat(np.arange(len(widths)), widths)
    ends = np.cumsum(widths)
    shift = (ends[owner] - 1 - np.arange(total)).astype(np.uint64)
    return ((values.astype(np.uint64)[owner] >> shift) & np.uint64(1)).astype(np.uint8)


def read_fields(bits: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The values :func:`write_fields` wrote in ``bits`` with these widths (int64)."""
    widths = widths.astype(np.int64)
    total = int(widths.sum())
    if total == 0:
        return np.zeros(len(widths), dtype=np.int64)
    owner = np.repeat(np.arange(len(widths)), widths)
    ends = np.cumsum(widths)
    shift = ends[owner] - 1 - np.arange(total)
    weights = bits[:total].astype(np.float64) * np.exp2(shift)
    # exact: the values are integers below 2^53
    return np.bincount(owner, weights=weights, minlength=len(widths)).astype(np.int64)


def gamma_lengths(values: np.ndarray) -> np.ndarray:
    """|γ(k)| = 2·bit_length(k) − 1 for positive integers k."""
    return 2 * bit_length(values) - 1


def gamma_encode(values: np.ndarray) -> np.ndarray:
    """The Elias-γ codes of positive integers as bits: the unary block (bit_length − 1
    zeros and a 1 per code), then the remainders (the bit_length − 1 low bits per code)."""
    values = values.astype(np.int64)
    if len(values) and int(values.min()) < 1:
        raise ValueError("Elias-γ codes positive integers only")
    rest = bit_length(values) - 1
    unary = np.zeros(int(rest.sum()) + len(values), dtype=np.uint8)
    unary[np.cumsum(rest + 1) - 1] = 1
    remainder = write_fields(values & ((np.int64(1) << rest) - 1), rest)
    return np.concatenate([unary, remainder])


def gamma_decode(
    bits: np.ndarray, ones: np.ndarray, offset: int, count: int
) -> tuple[np.ndarray, int]:
    """``count`` Elias-γ codes laid out by :func:`gamma_encode` from ``bits[offset:]``
    (``ones``: the sorted positions of the 1 bits of ``bits``); (the values, the offset
    after them). A ``ValueError`` where the bits run out."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), offset
    first = int(np.searchsorted(ones, offset))
    if first + count > len(ones):
        raise ValueError("Elias-γ block truncated: fewer codes than announced")
    ends = ones[first : first + count]
    rest = np.diff(ends, prepend=offset - 1) - 1
    if int(rest.max()) > 52:
        raise ValueError("Elias-γ code too long (corrupted)")
    start = int(ends[-1]) + 1
    total = int(rest.sum())
    if start + total > len(bits):
        raise ValueError("Elias-γ block truncated: remainders missing")
    low = read_fields(bits[start : start + total], rest)
    return (np.int64(1) << rest) | low, start + total


def stochastic_round(a: np.ndarray, generator: torch.Generator | None) -> np.ndarray:
    """ξ_i: ⌊a_i⌋ + 1 with probability a_i − ⌊a_i⌋, else ⌊a_i⌋ (E ξ = a), for a ≥ 0
    (float64, one uniform draw per coordinate from ``generator``); int64."""
    low = np.floor(a)
    return low.astype(np.int64) + (uniform(a.size, generator) < a - low)


def at_least_one(key: str, value: int) -> None:
    """A ``ValueError`` starting with ``key`` unless ``value`` is an integer ≥ 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: must be an integer (got {value!r})")  # noqa: TRY004 - ValueError by key
    if value < 1:
        raise ValueError(f"{key}: must be >= 1 (got {value})")


def check_k_ratio(k: int | None, ratio: float | None) -> None:
    """The settings of a k-coordinate sparsifier: k ≥ 1 or ratio in (0, 1], not both."""
    if k is not None and ratio is not None:
        raise ValueError(f"k: give k or ratio, not both (got k={k}, ratio={ratio})")
    if k is not None:
        at_least_one("k", k)
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise ValueError(f"ratio: must be a number in (0, 1] (got {ratio!r})")
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio: must be in (0, 1] (got {ratio})")


def kept(k: int | None, ratio: float | None, d: int) -> int:
    """The number of coordinates kept of d: k, or ⌈ratio · d⌉ (at least 1); a
    ``ValueError`` when k > d."""
    if k is None:
        assert ratio is not None
        count = max(1, math.ceil(round(ratio * d, 9)))
    else:
        count = k
    if count > d:
        raise ValueError(f"k: {count} > d = {d}, the number of values compressed")
    return count


def index_dtype(d: int) -> np.dtype:
    """The smallest unsigned little-endian integer that holds the indices 0 … d − 1."""
    if d <= 1 << 8:
        return np.dtype(np.uint8)
    if d <= 1 << 16:
        return np.dtype("<u2")
    if d <= 1 << 32:
        return np.dtype("<u4")
    return np.dtype("<u8")

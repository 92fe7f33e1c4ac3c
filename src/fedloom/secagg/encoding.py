"""The byte layout of the protocol's messages: fixed-width big-endian integers, byte
strings with their length, and vectors of b-bit integers packed tightly.

A message's ``to_bytes`` writes its fields in order with a :class:`Writer`; its
``from_bytes`` reads them back with a :class:`Reader`, which refuses a truncated or
over-long message (:class:`WireError`). ``nbytes()`` of every message is the length of
what ``to_bytes`` writes, so the byte counts the runtimes report are those of the wire.

Written by hand because the layout is the protocol's own (a masked vector of d b-bit
integers is d·b bits, which no general serializer packs) and it is a few lines of
``struct`` and numpy.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from fedloom.secagg.masks import UInts

_FORMATS = {1: ">B", 2: ">H", 4: ">I", 8: ">Q"}


class WireError(ValueError):
    """A message's bytes are malformed: truncated, over-long or out of range."""


def pack_bits(values: UInts, bits: int) -> bytes:
    """``values`` (unsigned, each below 2^bits) as ⌈len·bits/8⌉ bytes, least significant
    bit first."""
    values = np.ascontiguousarray(values, dtype="<u8")
    if bits in (8, 16, 32, 64):
        return values.astype(f"<u{bits // 8}").tobytes()
    as_bits = np.unpackbits(values.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    return np.packbits(as_bits[:, :bits].reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: bytes, count: int, bits: int) -> UInts:
    """The ``count`` values of ``bits`` bits each that :func:`pack_bits` wrote."""
    if len(data) != math.ceil(count * bits / 8):
        raise WireError(f"secagg: {len(data)} bytes do not hold {count} values of {bits} bits")
    if bits in (8, 16, 32, 64):
        return np.frombuffer(data, dtype=f"<u{bits // 8}").astype(np.uint64)
    as_bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")[: count * bits]
    wide = np.zeros((count, 64), dtype=np.uint8)
    wide[:, :bits] = as_bits.reshape(count, bits)
    return np.packbits(wide, axis=1, bitorder="little").view("<u8").reshape(-1).astype(np.uint64)


class Writer:
    """Fields appended in order; :meth:`getvalue` is the message."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def uint(self, value: int, size: int) -> Writer:
        try:
            self._parts.append(struct.pack(_FORMATS[size], value))
        except struct.error as err:
            raise WireError(f"secagg: {value} does not fit in {size} bytes") from err
        return self

    def float64(self, value: float) -> Writer:
        self._parts.append(struct.pack(">d", value))
        return self

    def raw(self, data: bytes) -> Writer:
        self._parts.append(bytes(data))
        return self

    def vector(self, values: UInts, bits: int) -> Writer:
        """A vector of ``bits``-bit integers, after its length (4 bytes) and ``bits`` (1):
        ⌈len·bits/8⌉ bytes for the values (:func:`pack_bits`)."""
        return self.uint(values.shape[0], 4).uint(bits, 1).raw(pack_bits(values, bits))

    def blob(self, data: bytes, size: int = 4) -> Writer:
        """``data`` after its length (``size`` bytes)."""
        return self.uint(len(data), size).raw(data)

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class Reader:
    """The fields of ``data`` read in order; :meth:`end` checks that nothing is left."""

    def __init__(self, data: bytes, what: str) -> None:
        self._data, self._at, self.what = memoryview(data), 0, what

    def raw(self, size: int) -> bytes:
        if size < 0 or self._at + size > len(self._data):
            raise WireError(f"secagg: a {self.what} message is truncated")
        out = bytes(self._data[self._at : self._at + size])
        self._at += size
        return out

    def uint(self, size: int) -> int:
        value: int = struct.unpack(_FORMATS[size], self.raw(size))[0]
        return value

    def float64(self) -> float:
        value: float = struct.unpack(">d", self.raw(8))[0]
        return value

    def blob(self, size: int = 4) -> bytes:
        return self.raw(self.uint(size))

    def vector(self) -> tuple[UInts, int]:
        """The rest of the message as :meth:`Writer.vector` wrote it: (values, bits)."""
        count, bits = self.uint(4), self.uint(1)
        if not 1 <= bits <= 64:
            raise WireError(f"secagg: a {self.what} message of {bits}-bit values")
        return unpack_bits(self.rest(), count, bits), bits

    def rest(self) -> bytes:
        return self.raw(len(self._data) - self._at)

    def end(self) -> None:
        if self._at != len(self._data):
            raise WireError(
                f"secagg: a {self.what} message has {len(self._data) - self._at} bytes too many"
            )

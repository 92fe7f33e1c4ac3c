"""The interface both schemes implement: the vectors they sum, the key holder's side and
everyone else's.

The rule: n clients each hold a vector x_k of ``dim`` integers below 2^b. The key holder
generates a key pair and hands out the public key (:class:`SecretKey`, ``public``); each
client encrypts its x_k under it (:meth:`PublicKey.encrypt`); the server combines the
clients' ciphertexts block by block (:meth:`PublicKey.sum`: Paillier multiplies them
modulo n², CKKS adds them), which adds the plaintexts; the key holder decrypts the sum (:meth:`SecretKey.decrypt`) to Σ_k x_k,
exactly. Each coordinate of the sum is below n·2^b ≤ 2^w with w = b + ⌈log2 n⌉
(:attr:`Layout.sum_bits`): the room a scheme must leave for it, checked when the scheme
is built (a ``ValueError`` naming the ``secagg`` key that breaks it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedloom.secagg.masks import UInts

#: the sum travels and is decoded as int64 (:class:`fedloom.secagg.SecAggResult`)
MAX_SUM_BITS = 63
#: Paillier's key sizes allowed (``secagg.key_bits``); here, not in the Paillier module, so
#: that reading a configuration does not import phe
KEY_BITS = (2048, 3072, 4096)
DEFAULT_KEY_BITS = 3072


@dataclass(frozen=True)
class Layout:
    """What a round sums: ``clients`` vectors of ``dim`` integers below 2^``bits``."""

    dim: int
    bits: int
    clients: int

    @property
    def sum_bits(self) -> int:
        """w = b + ⌈log2 n⌉: every coordinate of the sum is below n·2^b ≤ 2^w."""
        return self.bits + (self.clients - 1).bit_length()

    def check(self, max_sum_bits: int, scheme: str) -> None:
        """A ``ValueError`` naming ``secagg.bits`` when the sum needs more than
        ``max_sum_bits`` bits, the most ``scheme`` decrypts exactly."""
        if self.dim < 1 or self.clients < 1:
            raise ValueError(f"homomorphic: {self.clients} vectors of {self.dim} coordinates")
        if self.sum_bits > max_sum_bits:
            raise ValueError(
                f"secagg.bits: {self.clients} inputs of b = {self.bits} bits sum to "
                f"b + ⌈log2 n⌉ = {self.sum_bits} bits, more than the {max_sum_bits} that "
                f"{scheme} decrypts exactly; lower secagg.bits"
            )

    def check_input(self, x: UInts) -> None:
        """A ``ValueError`` unless ``x`` is ``dim`` unsigned integers below 2^b."""
        if x.dtype != np.uint64 or x.shape != (self.dim,):
            raise ValueError(
                f"homomorphic: an input must be {self.dim} uint64 values, not {x.shape} {x.dtype}"
            )
        if x.size and int(x.max()) >> self.bits:
            raise ValueError(
                f"homomorphic: an input coordinate is {int(x.max())}, not below 2^{self.bits}: "
                f"the sum could wrap"
            )


class SecretKey(ABC):
    """The key holder's side of one round: the public key it hands out, and decryption."""

    @property
    @abstractmethod
    def public(self) -> bytes:
        """The public key (or public context), serialized."""

    @abstractmethod
    def decrypt(self, ciphertexts: Sequence[bytes]) -> UInts:
        """The exact integer sum (``dim`` uint64 values below 2^w) that ``ciphertexts``
        encrypt; a ``ValueError`` when they do not decrypt to one."""


class PublicKey(ABC):
    """What a client and the server hold: encryption and ciphertext addition."""

    @abstractmethod
    def encrypt(self, x: UInts) -> tuple[bytes, ...]:
        """``x`` (``dim`` integers below 2^b) as :meth:`Scheme.ciphertexts` ciphertexts,
        freshly randomized."""

    @abstractmethod
    def sum(self, inputs: Iterable[Sequence[bytes]]) -> tuple[bytes, ...]:
        """The ciphertexts of the sum of the vectors ``inputs`` encrypt; a ``ValueError``
        for a ciphertext that is not one of this key's."""


class Scheme(ABC):
    """One additively homomorphic scheme for a round's :class:`Layout`."""

    name: ClassVar[str]
    #: the largest w = b + ⌈log2 n⌉ the scheme decrypts exactly
    max_sum_bits: ClassVar[int]

    def __init__(self, layout: Layout) -> None:
        layout.check(min(self.max_sum_bits, MAX_SUM_BITS), self.name)
        self.layout = layout

    @abstractmethod
    def ciphertexts(self) -> int:
        """How many ciphertexts one input takes."""

    @abstractmethod
    def keygen(self) -> SecretKey:
        """A fresh key pair (the key holder's)."""

    @abstractmethod
    def public_key(self, data: bytes) -> PublicKey:
        """The public key that :attr:`SecretKey.public` serialized; a ``ValueError`` for
        bytes that are not one of this scheme's for this layout."""


def scheme_for(protocol: str, layout: Layout, key_bits: int) -> Scheme:
    """The scheme of ``protocol`` ("ckks" or "paillier", with a modulus of ``key_bits``
    bits) for ``layout`` (imported here: the scheme modules import this one)."""
    if protocol == "ckks":
        from fedloom.homomorphic.ckks import CkksScheme

        return CkksScheme(layout)
    if protocol == "paillier":
        from fedloom.homomorphic.paillier import PaillierScheme

        return PaillierScheme(layout, key_bits)
    raise ValueError(f"secagg.protocol: {protocol!r} is not a homomorphic scheme")

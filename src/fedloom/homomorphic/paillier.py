"""Paillier encryption of packed inputs, with phe (python-paillier) and gmpy2.

The scheme (Paillier 1999, "Public-Key Cryptosystems Based on Composite Degree
Residuosity Classes"): the public key is N = p·q, E(m) = (1 + N)^m · r^N mod N² with r
random below N, and E(a)·E(b) mod N² = E(a + b mod N). phe provides the key generation,
``raw_encrypt`` (fresh r from the system's CSPRNG), ``raw_decrypt`` (with the CRT) and the
ciphertext addition of ``EncryptedNumber``; gmpy2 its big-integer arithmetic.

Packing (:mod:`fedloom.homomorphic.packing`): an input's values go s = ⌊(|N| − 1) / w⌋ to
a plaintext, w = b + ⌈log2 n⌉ bits a slot, so that n clients' sum of each slot fits it.
A packed plaintext is below 2^{s·w} ≤ 2^{|N|−1} < N, and so is the sum of n of them (no
slot carries), so the sum never wraps modulo N: the key holder's decryption is the exact
sum, slot by slot.

The key: |N| = 3072 bits by default, 128-bit security (NIST SP 800-57 Part 1 puts a
3072-bit factoring modulus at 128 bits, which is also phe's default), as CKKS's
parameters; 2048 bits (112-bit security) is faster to encrypt and decrypt, with about as
many bytes per value; 4096. A ciphertext is 2·|N|/8 bytes, big-endian.

How fedloom differs: phe encodes one signed or float number per ciphertext (below N/3);
here unsigned integers are packed by hand into ``raw_encrypt``'s plaintexts, and every
ciphertext the server adds is checked to lie in [1, N²).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import phe

from fedloom.homomorphic import packing
from fedloom.homomorphic.scheme import (
    DEFAULT_KEY_BITS,
    KEY_BITS,
    MAX_SUM_BITS,
    Layout,
    PublicKey,
    Scheme,
    SecretKey,
)
from fedloom.secagg.masks import UInts


class PaillierScheme(Scheme):
    name = "Paillier"
    max_sum_bits = MAX_SUM_BITS

    def __init__(self, layout: Layout, key_bits: int = DEFAULT_KEY_BITS) -> None:
        if key_bits not in KEY_BITS:
            raise ValueError(f"secagg.key_bits: {key_bits} (one of {list(KEY_BITS)})")
        super().__init__(layout)
        self.key_bits = key_bits
        #: s: the slots of w = b + ⌈log2 n⌉ bits a plaintext below 2^{|N|−1} holds
        self.per_plaintext = packing.slots(key_bits - 1, layout.sum_bits)
        #: bytes of a ciphertext, an integer below N²
        self.width = 2 * key_bits // 8

    def ciphertexts(self) -> int:
        return -(-self.layout.dim // self.per_plaintext)

    def keygen(self) -> PaillierSecret:
        public, private = phe.generate_paillier_keypair(n_length=self.key_bits)
        return PaillierSecret(PaillierPublic(self, public), private)

    def public_key(self, data: bytes) -> PaillierPublic:
        n = int.from_bytes(data, "big")
        if len(data) != self.key_bits // 8 or n.bit_length() != self.key_bits or n % 2 == 0:
            raise ValueError(f"homomorphic: not a Paillier public key of {self.key_bits} bits")
        return PaillierPublic(self, phe.PaillierPublicKey(n))


class PaillierPublic(PublicKey):
    def __init__(self, scheme: PaillierScheme, key: phe.PaillierPublicKey) -> None:
        self.scheme, self.key = scheme, key

    def encrypt(self, x: UInts) -> tuple[bytes, ...]:
        s = self.scheme
        s.layout.check_input(x)
        plaintexts = packing.pack(x, s.layout.sum_bits, s.per_plaintext)
        return tuple(self.key.raw_encrypt(p).to_bytes(s.width, "big") for p in plaintexts)

    def number(self, data: bytes) -> phe.EncryptedNumber:
        c = int.from_bytes(data, "big")
        if len(data) != self.scheme.width or not 0 < c < self.key.nsquare:
            raise ValueError("homomorphic: not a Paillier ciphertext under this key")
        return phe.EncryptedNumber(self.key, c)

    def sum(self, inputs: Iterable[Sequence[bytes]]) -> tuple[bytes, ...]:
        count = self.scheme.ciphertexts()
        total: list[phe.EncryptedNumber] = []
        for blobs in inputs:
            if len(blobs) != count:
                raise ValueError(f"homomorphic: {len(blobs)} ciphertexts, not {count}")
            numbers = [self.number(b) for b in blobs]
            total = [a + b for a, b in zip(total, numbers)] if total else numbers
        if not total:
            raise ValueError("homomorphic: no ciphertexts to add")
        # the sum of fresh encryptions is as random as they are: no re-randomization
        width = self.scheme.width
        return tuple(t.ciphertext(be_secure=False).to_bytes(width, "big") for t in total)


class PaillierSecret(SecretKey):
    def __init__(self, public: PaillierPublic, private: phe.PaillierPrivateKey) -> None:
        self.scheme, self._public, self._private = public.scheme, public, private

    @property
    def public(self) -> bytes:
        n: int = self._public.key.n
        return n.to_bytes(self.scheme.key_bits // 8, "big")

    def decrypt(self, ciphertexts: Sequence[bytes]) -> UInts:
        s = self.scheme
        if len(ciphertexts) != s.ciphertexts():
            raise ValueError(f"homomorphic: {len(ciphertexts)} ciphertexts, not {s.ciphertexts()}")
        numbers = [self._public.number(c) for c in ciphertexts]
        plaintexts = [self._private.raw_decrypt(e.ciphertext(be_secure=False)) for e in numbers]
        return packing.unpack(plaintexts, s.layout.sum_bits, s.per_plaintext, s.layout.dim)

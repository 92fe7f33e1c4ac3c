"""CKKS encryption of integer inputs, with TenSEAL (Microsoft SEAL underneath).

The scheme (Cheon, Kim, Kim and Song 2017, "Homomorphic Encryption for Arithmetic of
Approximate Numbers"): a vector of N/2 reals is encoded as a polynomial scaled by Δ and
encrypted under RLWE; adding ciphertexts adds the vectors, approximately. TenSEAL's
``ckks_vector`` batches N/2 = 2048 values a ciphertext; an input takes ⌈dim / 2048⌉.

The parameters, fixed: N = 4096, a coefficient modulus of 40 + 40 + 29 = 109 bits (two
40-bit primes hold the data, the last is SEAL's special prime), Δ = 2^30. 109 bits is the
most the HomomorphicEncryption.org standard allows at N = 4096 for 128-bit security
(ternary secret, σ = 3.2); SEAL refuses parameters beyond its table.

Why the sum decrypts to the exact integers: the inputs are integers, and the sum of n of
them is below 2^w, w = b + ⌈log2 n⌉ (:class:`Layout`). A decrypted coordinate is the sum
plus an error from
  (1) the encryption noise: each ciphertext's decodes below 2^−17 at Δ = 2^30, and n
      ciphertexts add at most n of them, below 2^−5 for n ≤ 2^12 (:data:`MAX_CLIENTS`);
  (2) the encoder's and decoder's double precision: a relative 2^−52 of the largest value,
      times a small factor of the FFT, below 2^−6 for w ≤ 44 (:data:`MAX_SUM_BITS`);
and the scaled sum, below Δ·2^w ≤ 2^74, stays clear of the data modulus (2^80). So the
error is below 1/4 and rounding gives the exact sum. The key holder checks that every
decrypted coordinate lies within 1/4 of an integer in [0, 2^w) and refuses the sum
otherwise: a broken bound is an error, never a wrong sum. It returns the rounded integers
only, never CKKS's approximate decryption, whose noise leaks the secret key to whoever
collects enough of it (Li and Micciancio 2021, "On the Security of Homomorphic Encryption
on Approximate Numbers").

How fedloom differs: TenSEAL's examples encrypt reals and keep the approximation; here
the values are integers and the parameters are chosen so that no approximation is left.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import tenseal as ts

from fedloom.homomorphic.scheme import Layout, PublicKey, Scheme, SecretKey
from fedloom.secagg.masks import UInts

POLY_MODULUS_DEGREE = 4096
COEFF_MOD_BIT_SIZES = (40, 40, 29)
SCALE_BITS = 30
#: values a ciphertext holds
SLOTS = POLY_MODULUS_DEGREE // 2
#: the largest w = b + ⌈log2 n⌉ whose sums decrypt exactly
MAX_SUM_BITS = 44
#: the most clients whose encryption noise adds up below 2^−5
MAX_CLIENTS = 1 << 12
#: how far from an integer a decrypted coordinate may be
TOLERANCE = 0.25


class CkksScheme(Scheme):
    name = "CKKS"
    max_sum_bits = MAX_SUM_BITS

    def __init__(self, layout: Layout) -> None:
        if layout.clients > MAX_CLIENTS:
            raise ValueError(
                f"secagg.protocol: CKKS sums at most {MAX_CLIENTS} clients exactly, not "
                f"{layout.clients}"
            )
        super().__init__(layout)

    def ciphertexts(self) -> int:
        return -(-self.layout.dim // SLOTS)

    def keygen(self) -> CkksSecret:
        context = ts.context(
            ts.SCHEME_TYPE.CKKS,
            poly_modulus_degree=POLY_MODULUS_DEGREE,
            coeff_mod_bit_sizes=list(COEFF_MOD_BIT_SIZES),
            n_threads=1,
        )
        context.global_scale = 2.0**SCALE_BITS
        return CkksSecret(self, context)

    def public_key(self, data: bytes) -> CkksPublic:
        try:
            context = ts.context_from(data, n_threads=1)
        except Exception as err:  # TenSEAL raises its own types for malformed bytes
            raise ValueError(f"homomorphic: not a CKKS public context ({err})") from err
        if not context.is_public() or not context.has_public_key():
            raise ValueError("homomorphic: a CKKS context to encrypt with must be public")
        return CkksPublic(self, context)


def _blocks(dim: int) -> list[tuple[int, int]]:
    return [(start, min(start + SLOTS, dim)) for start in range(0, dim, SLOTS)]


class CkksPublic(PublicKey):
    def __init__(self, scheme: CkksScheme, context: ts.Context) -> None:
        self.scheme, self.context = scheme, context

    def encrypt(self, x: UInts) -> tuple[bytes, ...]:
        self.scheme.layout.check_input(x)
        values = x.astype(np.float64)
        return tuple(
            ts.ckks_vector(self.context, values[a:b].tolist()).serialize()
            for a, b in _blocks(self.scheme.layout.dim)
        )

    def vector(self, data: bytes, size: int) -> ts.CKKSVector:
        """The ciphertext ``data`` of ``size`` values, linked to this context."""
        try:
            vector = ts.ckks_vector_from(self.context, data)
        except Exception as err:  # TenSEAL raises its own types for malformed bytes
            raise ValueError(f"homomorphic: not a CKKS ciphertext ({err})") from err
        if vector.size() != size:
            raise ValueError(
                f"homomorphic: a CKKS ciphertext of {vector.size()} values, not {size}"
            )
        return vector

    def sum(self, inputs: Iterable[Sequence[bytes]]) -> tuple[bytes, ...]:
        blocks = _blocks(self.scheme.layout.dim)
        total: list[ts.CKKSVector] = []
        for blobs in inputs:
            if len(blobs) != len(blocks):
                raise ValueError(f"homomorphic: {len(blobs)} ciphertexts, not {len(blocks)}")
            vectors = [self.vector(c, b - a) for c, (a, b) in zip(blobs, blocks)]
            if total:
                for t, v in zip(total, vectors):
                    t.add_(v)
            else:
                total = vectors
        if not total:
            raise ValueError("homomorphic: no ciphertexts to add")
        return tuple(t.serialize() for t in total)


class CkksSecret(SecretKey):
    def __init__(self, scheme: CkksScheme, context: ts.Context) -> None:
        self.scheme, self._context = scheme, context

    @property
    def public(self) -> bytes:
        data: bytes = self._context.serialize(
            save_public_key=True,
            save_secret_key=False,
            save_galois_keys=False,
            save_relin_keys=False,
        )
        return data

    def decrypt(self, ciphertexts: Sequence[bytes]) -> UInts:
        layout = self.scheme.layout
        blocks = _blocks(layout.dim)
        if len(ciphertexts) != len(blocks):
            raise ValueError(f"homomorphic: {len(ciphertexts)} ciphertexts, not {len(blocks)}")
        own = CkksPublic(self.scheme, self._context)
        values = np.concatenate(
            [
                np.asarray(own.vector(c, b - a).decrypt(), dtype=np.float64)
                for c, (a, b) in zip(ciphertexts, blocks)
            ]
        )
        rounded = np.rint(values)
        if np.any(np.abs(values - rounded) >= TOLERANCE) or np.any(rounded < 0):
            raise ValueError(
                "homomorphic: the CKKS sum does not decrypt to integers (a ciphertext "
                "outside the parameters' bound)"
            )
        if np.any(rounded >= 2.0**layout.sum_bits):
            raise ValueError(f"homomorphic: the CKKS sum exceeds 2^{layout.sum_bits}")
        return rounded.astype(np.uint64)

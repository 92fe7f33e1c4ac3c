"""Key agreement, key derivation and authenticated encryption between two clients.

The rule (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving
Machine Learning"; Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead"): each client holds two Diffie–Hellman key pairs per round,
(c^PK, c^SK) to encrypt what it sends another client through the server, and
(s^PK, s^SK) to agree a pairwise mask seed with each neighbour. Two clients i and j
compute the same X25519 shared secret from their own private key and the other's public
key; a KDF turns it into a uniform 32-byte key for one purpose:

* ``pair_seed``: s_ij = HKDF-SHA256(X25519(s_i^SK, s_j^PK), info="fedloom secagg pair
  mask"), the seed of the pairwise mask (:mod:`fedloom.secagg.masks`);
* ``encryption_key``: HKDF-SHA256(X25519(c_i^SK, c_j^PK), info="fedloom secagg share
  encryption"), the ChaCha20-Poly1305 key for the share bundles from i to j and back.

A share bundle is encrypted with ChaCha20-Poly1305 under a fresh random 96-bit nonce,
with the associated data (protocol tag, round, sender, receiver): the server relays the
ciphertext but cannot read it, alter it, redirect it to another client, or replay it in
another round; any of these fails authentication (:class:`ShareAuthenticationError`).

How fedloom differs: Bonawitz et al. put the sender and receiver ids inside the plaintext
and check them after decryption; fedloom binds them (and the round) as associated data,
which the AEAD checks for it. Keys are fresh every round, as in the paper; there are no
signatures (the paper's malicious-server variant with a PKI is out of scope: the server is
honest-but-curious). Primitives are the ``cryptography`` package's.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

#: bytes of an X25519 public or private key, of a derived seed or key
KEY_BYTES = 32
#: bytes of an AEAD nonce and tag: a ciphertext is NONCE + len(plaintext) + TAG bytes
NONCE_BYTES = 12
TAG_BYTES = 16
_PAIR_MASK = b"fedloom secagg pair mask"
_SHARE_KEY = b"fedloom secagg share encryption"
_AD = struct.Struct(">8sQQQ")  # tag, round, sender, receiver
_AD_TAG = b"fl-sagg1"


class ShareAuthenticationError(ValueError):
    """A ciphertext that does not authenticate: tampered with, or under the wrong key,
    round, sender or receiver."""


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair: the private key and the 32 raw bytes of its public key."""

    private: X25519PrivateKey
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        private = X25519PrivateKey.generate()
        return cls(private, private.public_key().public_bytes_raw())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> KeyPair:
        """The key pair of a 32-byte raw private key (one rebuilt from shares)."""
        private = X25519PrivateKey.from_private_bytes(raw)
        return cls(private, private.public_key().public_bytes_raw())

    def private_bytes(self) -> bytes:
        """The 32 raw bytes of the private key: what is secret-shared."""
        return self.private.private_bytes_raw()


def _derive(private: X25519PrivateKey, peer_public: bytes, purpose: bytes) -> bytes:
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=purpose).derive(shared)


def pair_seed(private: X25519PrivateKey, peer_public: bytes) -> bytes:
    """s_ij: the 32-byte seed of i's and j's pairwise mask, the same from either side."""
    return _derive(private, peer_public, _PAIR_MASK)


def encryption_key(private: X25519PrivateKey, peer_public: bytes) -> bytes:
    """The 32-byte ChaCha20-Poly1305 key between two clients, the same from either side."""
    return _derive(private, peer_public, _SHARE_KEY)


def associated_data(round_: int, sender: int, receiver: int) -> bytes:
    """What a ciphertext is bound to: the protocol, the round, the sender, the receiver."""
    return _AD.pack(_AD_TAG, round_, sender, receiver)


def encrypt(key: bytes, plaintext: bytes, *, round_: int, sender: int, receiver: int) -> bytes:
    """nonce ‖ ChaCha20-Poly1305(plaintext), bound to (round, sender, receiver)."""
    nonce = os.urandom(NONCE_BYTES)
    sealed = ChaCha20Poly1305(key).encrypt(
        nonce, plaintext, associated_data(round_, sender, receiver)
    )
    return nonce + sealed


def decrypt(key: bytes, ciphertext: bytes, *, round_: int, sender: int, receiver: int) -> bytes:
    """The plaintext of :func:`encrypt`'s output; :class:`ShareAuthenticationError` when
    it does not authenticate for this key, round, sender and receiver."""
    nonce, sealed = ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:]
    try:
        return ChaCha20Poly1305(key).decrypt(
            nonce, sealed, associated_data(round_, sender, receiver)
        )
    except (InvalidTag, ValueError) as err:
        raise ShareAuthenticationError(
            f"secagg: the share bundle from client {sender} to client {receiver} in round "
            f"{round_} failed authentication (tampered with, or meant for another round, "
            f"sender or receiver)"
        ) from err

"""Homomorphic aggregation: the server adds encrypted updates and never holds a key that
decrypts one.

The second protocol of ``[secagg]`` (``protocol = "ckks"`` or ``"paillier"``; SecAgg's is
:mod:`fedloom.secagg`). Each client encrypts its quantized, weighted update x_k (the mask
stage's input, :meth:`fedloom.transforms.secure_sum.SecureSum.encode`) under a public key
of the round; the server adds the ciphertexts; the key holder decrypts the sum, exactly,
and the mask stage decodes it as it decodes SecAgg's, so the two protocols give the same
sum bit for bit. One module per job:

* :mod:`~fedloom.homomorphic.scheme`: the interface, and the bound b + ⌈log2 n⌉ on the sum;
* :mod:`~fedloom.homomorphic.packing`: several b-bit slots in one big integer;
* :mod:`~fedloom.homomorphic.paillier`: Paillier with phe, packed plaintexts;
* :mod:`~fedloom.homomorphic.ckks`: CKKS with TenSEAL, parameters that decrypt exactly;
* :mod:`~fedloom.homomorphic.messages`: the three stages' messages and their bytes;
* :mod:`~fedloom.homomorphic.protocol`: the setup, the key holder, a client, the server.

Trust model. The key holder is one client of the round, chosen by the server (the round
number modulo n, among the sorted client ids); it draws a fresh key pair for the round
and keeps the secret key. The server sees the public key, every client's ciphertexts
(IND-CPA: under the decisional composite residuosity assumption for Paillier, under RLWE
for CKKS) and the decrypted sum; it learns the sum, as under SecAgg, and nothing more as
long as it follows the protocol and does not collude with the key holder. The key holder
sees only the ciphertext of the sum and the sum. What this does not protect against:

* a server colluding with the key holder reads every client's update (it holds their
  ciphertexts, the key holder the key); SecAgg needs t colluding clients for that;
* a server that deviates can send the key holder one client's ciphertexts as "the sum"
  and learn that update from the answer; the key holder refuses a sum of fewer than two
  clients, but cannot tell what the ciphertexts add;
* the key holder can return a wrong sum, undetected (no proof of decryption).

Threshold decryption, which would remove the single key holder, is out of scope: neither
phe (its ``PaillierPrivateKeyring`` is a key store) nor TenSEAL (SEAL has no multiparty
keys) offers it.

Drop-outs need no recovery: a client that sends no ciphertexts is simply not in the sum.
A key holder that drops ends the round's secure sum, and every client of the round is
left out with the reason.

How fedloom differs: NVFlare's homomorphic aggregation (TenSEAL's CKKS too) encrypts
the float weights and decrypts an approximate sum; here both schemes carry the mask
stage's integers and the sum is exact, the quantization the only difference from the
plain mean.
"""

from fedloom.homomorphic.messages import (
    PROTOCOLS,
    STAGES,
    Ciphertexts,
    DecryptRequest,
    EncryptRequest,
    HomomorphicName,
    HomomorphicSetup,
    PlainSum,
    PublicContext,
)
from fedloom.homomorphic.protocol import (
    HomomorphicConfig,
    HomomorphicServer,
    KeyHolder,
    encrypt_input,
    setup_round,
)
from fedloom.homomorphic.scheme import Layout, scheme_for

__all__ = [
    "PROTOCOLS",
    "STAGES",
    "Ciphertexts",
    "DecryptRequest",
    "EncryptRequest",
    "HomomorphicConfig",
    "HomomorphicName",
    "HomomorphicServer",
    "HomomorphicSetup",
    "KeyHolder",
    "Layout",
    "PlainSum",
    "PublicContext",
    "encrypt_input",
    "scheme_for",
    "setup_round",
]

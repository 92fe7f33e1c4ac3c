"""Homomorphic aggregation's parties: the round's setup, the key holder, a client's
encryption and the server's sum.

The rule: the server announces the round (:func:`setup_round`) and asks its key holder,
one of the round's clients, for a fresh public key ("keys": :class:`KeyHolder`); every
client encrypts its input x_k under it ("encrypt": :func:`encrypt_input`); the server adds
the ciphertexts of the clients that answered and sends the sum to the key holder, which
decrypts it ("decrypt") and returns the plaintext sum (:meth:`HomomorphicServer.finish`).

Drop-outs: a client that sends no ciphertexts is not in the sum, and nothing needs
recovering (no client's input depends on another's); the key holder's silence at "keys"
or "decrypt" ends the round's secure sum (:class:`ProtocolError` naming it), as does a
sum of fewer than two clients, which would be one client's input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fedloom.homomorphic.messages import (
    PROTOCOLS,
    Ciphertexts,
    DecryptRequest,
    EncryptRequest,
    HomomorphicName,
    HomomorphicSetup,
    PlainSum,
    PublicContext,
)
from fedloom.homomorphic.scheme import DEFAULT_KEY_BITS, PublicKey, Scheme
from fedloom.secagg.masks import UInts, check_bits
from fedloom.secagg.messages import ClientRefusal, ProtocolError
from fedloom.secagg.quantize import Quantizer, check_overflow, quant_bits_for
from fedloom.secagg.server import SecAggResult

#: the fewest inputs a sum may add: one input's sum is that input
MIN_SUMMED = 2


@dataclass(frozen=True)
class HomomorphicConfig:
    """The ``[secagg]`` settings of homomorphic aggregation: None means the default."""

    protocol: HomomorphicName = "ckks"
    #: b: every input coordinate is below 2^b, and so is the round's sum
    bits: int = 32
    #: c: inputs are clipped to [−c, c] before quantization
    clip_range: float = 1.0
    #: b_q: default the largest with n·(2^{b_q} − 1) ≤ 2^b − 1
    quant_bits: int | None = None
    #: Paillier's modulus bits: default 3072
    key_bits: int | None = None


def setup_round(
    config: HomomorphicConfig, clients: Sequence[int], round_: int, dim: int
) -> HomomorphicSetup:
    """The round's :class:`HomomorphicSetup` (its key holder the client at ``round_``
    modulo n among the sorted ``clients``), or a ``ValueError`` naming the ``secagg`` key
    a setting breaks."""
    n = len(clients)
    if len(set(clients)) != n or any(not 0 <= c < 1 << 32 for c in clients):
        raise ValueError(f"secagg: client ids must be distinct and in [0, 2^32 − 1]: {clients}")
    if n < MIN_SUMMED:
        raise ValueError(f"secagg: a round of {n} client cannot hide an input in a sum")
    if config.protocol not in PROTOCOLS:
        raise ValueError(f"secagg.protocol: {config.protocol!r} (one of {list(PROTOCOLS)})")
    if config.protocol == "ckks" and config.key_bits is not None:
        raise ValueError("secagg.key_bits: Paillier's modulus; CKKS's parameters are fixed")
    check_bits(config.bits)
    Quantizer(config.clip_range, 1)  # checks the clipping range
    if config.quant_bits is None:
        quant_bits = quant_bits_for(n, config.bits)
    else:
        quant_bits = config.quant_bits
        check_overflow(n, config.bits, quant_bits)
    ordered = tuple(sorted(clients))
    setup = HomomorphicSetup(
        round_,
        ordered,
        dim,
        config.protocol,
        config.bits,
        quant_bits,
        float(config.clip_range),
        ordered[round_ % n],
        0 if config.protocol == "ckks" else config.key_bits or DEFAULT_KEY_BITS,
    )
    setup.scheme()  # checks the sum's bound for the scheme
    return setup


def _scheme(setup: HomomorphicSetup) -> Scheme:
    try:
        return setup.scheme()
    except ValueError as err:
        raise ProtocolError(str(err)) from err


class KeyHolder:
    """The key holder's side of one round: its key pair is fresh for the round, and its
    secret key never leaves it."""

    def __init__(self, client_id: int, setup: HomomorphicSetup) -> None:
        if client_id != setup.key_holder:
            raise ProtocolError(
                f"homomorphic: client {client_id} is asked for keys, but round "
                f"{setup.round}'s key holder is client {setup.key_holder}"
            )
        self.id, self.setup = client_id, setup
        self._secret = _scheme(setup).keygen()

    def public_context(self) -> PublicContext:
        """Stage "keys": the public key."""
        return PublicContext(self.id, self.setup.round, self._secret.public)

    def decrypt(self, request: DecryptRequest) -> PlainSum:
        """Stage "decrypt": the plaintext sum; refused for another round, or for a sum of
        fewer than :data:`MIN_SUMMED` of the round's clients."""
        setup = self.setup
        if request.round != setup.round:
            raise ProtocolError(f"homomorphic: a decryption for round {request.round}")
        summed = set(request.summed)
        if len(summed) != len(request.summed) or not summed <= set(setup.clients):
            raise ClientRefusal(f"homomorphic: a sum of {list(request.summed)}, not of the round")
        if len(summed) < MIN_SUMMED:
            raise ClientRefusal(
                f"homomorphic: key holder {self.id} refuses to decrypt a sum of "
                f"{len(summed)} client: it would be that client's input"
            )
        try:
            total = self._secret.decrypt(request.blobs)
        except ValueError as err:
            raise ProtocolError(str(err)) from err
        return PlainSum(self.id, setup.round, total, setup.layout.sum_bits)


def encrypt_input(client_id: int, request: EncryptRequest, x: UInts) -> Ciphertexts:
    """Stage "encrypt": client ``client_id``'s input ``x`` under the round's public key."""
    setup = request.setup
    if client_id not in setup.clients:
        raise ProtocolError(f"homomorphic: client {client_id} is not in round {setup.round}")
    try:
        blobs = _scheme(setup).public_key(request.key).encrypt(x)
    except ValueError as err:
        raise ProtocolError(str(err)) from err
    return Ciphertexts(client_id, setup.round, blobs)


class HomomorphicServer:
    """The server's side of one round. It only ever holds the public key, the clients'
    ciphertexts and their sum, and the plaintext sum the key holder returns."""

    def __init__(self, setup: HomomorphicSetup) -> None:
        self.setup = setup
        self._public: PublicKey | None = None
        self._summed: tuple[int, ...] = ()

    def _missing_holder(self, stage: str) -> ProtocolError:
        return ProtocolError(
            f"homomorphic: the key holder, client {self.setup.key_holder}, did not answer "
            f'at "{stage}": the round cannot be aggregated'
        )

    def announce(self, replies: Mapping[int, PublicContext]) -> dict[int, EncryptRequest]:
        """Stage "keys": the public key to every client of the round."""
        setup = self.setup
        reply = replies.get(setup.key_holder)
        if reply is None:
            raise self._missing_holder("keys")
        if reply.round != setup.round or reply.client != setup.key_holder:
            raise ProtocolError(f"homomorphic: a public key for round {reply.round}")
        try:
            self._public = _scheme(setup).public_key(reply.key)
        except ProtocolError as err:
            raise ProtocolError(f"homomorphic: the key holder's public key: {err}") from err
        return {c: EncryptRequest(setup, reply.key) for c in setup.clients}

    def add(self, inputs: Sequence[Ciphertexts]) -> dict[int, DecryptRequest]:
        """Stage "encrypt": the sum of the inputs that arrived, to the key holder."""
        if self._public is None:
            raise ProtocolError("homomorphic: the server has no public key to add under")
        setup, seen = self.setup, set()
        for m in inputs:
            if m.round != setup.round or m.client not in setup.clients or m.client in seen:
                raise ProtocolError(
                    f"homomorphic: ciphertexts from client {m.client} for round {m.round}, "
                    f"not expected"
                )
            seen.add(m.client)
        if len(seen) < MIN_SUMMED:
            raise ProtocolError(
                f"homomorphic: {len(seen)} client sent ciphertexts; a sum of fewer than "
                f"{MIN_SUMMED} would be one client's input"
            )
        try:
            total = self._public.sum([m.blobs for m in sorted(inputs, key=lambda m: m.client)])
        except ValueError as err:
            raise ProtocolError(str(err)) from err
        self._summed = tuple(sorted(seen))
        return {setup.key_holder: DecryptRequest(setup.round, self._summed, total)}

    def finish(self, replies: Mapping[int, PlainSum]) -> SecAggResult:
        """Stage "decrypt": the exact sum of the summed clients' inputs."""
        setup = self.setup
        reply = replies.get(setup.key_holder)
        if reply is None:
            raise self._missing_holder("decrypt")
        if (
            reply.round != setup.round
            or reply.total.shape != (setup.dim,)
            or reply.bits != setup.layout.sum_bits
        ):
            raise ProtocolError(
                f"homomorphic: the key holder's sum is not {setup.dim} values of "
                f"{setup.layout.sum_bits} bits for round {setup.round}"
            )
        if not self._summed:
            raise ProtocolError("homomorphic: the server sent no sum to decrypt")
        exact = reply.total.astype("int64")
        quantizer = setup.quantizer
        return SecAggResult(
            total=exact,
            sum=quantizer.dequantize_sum(exact, len(self._summed)),
            survivors=self._summed,
            dropouts=tuple(c for c in setup.clients if c not in self._summed),
            left_out=(),
            silent=(),
            error_bound=quantizer.error_bound(len(self._summed)),
        )

"""The protocol's messages as tagged bytes, for a transport that carries bytes (the
Flower runtime's message rounds, :meth:`fedloom.runtime.flower_app.FlowerClients.secagg`).

:func:`pack` writes a message's type name and its ``to_bytes``; :func:`unpack` reads it
back as the type :data:`MESSAGES` registers under that name (any other is refused: the
bytes come from the network).
"""

from __future__ import annotations

from typing import Any

from fedloom.homomorphic.messages import (
    Ciphertexts,
    DecryptRequest,
    EncryptRequest,
    HomomorphicSetup,
    PlainSum,
    PublicContext,
)
from fedloom.secagg.encoding import Reader, WireError, Writer
from fedloom.secagg.messages import (
    EncryptedShares,
    Forwarded,
    KeyAdvert,
    MaskedInput,
    PeerKeys,
    RoundSetup,
    UnmaskRequest,
    UnmaskResponse,
)

#: the message types a transport may carry, by name
MESSAGES: dict[str, Any] = {
    cls.__name__: cls
    for cls in (
        RoundSetup,
        KeyAdvert,
        PeerKeys,
        EncryptedShares,
        Forwarded,
        MaskedInput,
        UnmaskRequest,
        UnmaskResponse,
        HomomorphicSetup,
        PublicContext,
        EncryptRequest,
        Ciphertexts,
        DecryptRequest,
        PlainSum,
    )
}


def pack(message: Any) -> bytes:
    """``message``'s type name (a length byte and ASCII) and its wire bytes."""
    name = type(message).__name__
    if MESSAGES.get(name) is not type(message):
        raise TypeError(f"secagg: {name} is not a protocol message")
    return Writer().blob(name.encode("ascii"), 1).raw(message.to_bytes()).getvalue()


def unpack(data: bytes) -> Any:
    """The message :func:`pack` wrote; a :class:`WireError` for anything else."""
    r = Reader(data, "tagged")
    name = r.blob(1).decode("ascii", errors="replace")
    if name not in MESSAGES:
        raise WireError(f"secagg: {name!r} is not a protocol message")
    return MESSAGES[name].from_bytes(r.rest())

"""Secure aggregation: the server learns the sum of the clients' updates, not one of them.

SecAgg (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving
Machine Learning") and SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead"): each client quantizes its update to integers modulo 2^b and
adds a self-mask and pairwise masks that cancel in the sum; Shamir shares of the mask
secrets let the server remove the masks of clients that drop out. One module per job:

* :mod:`~fedloom.secagg.shamir`: secret sharing over GF(2^127 − 1);
* :mod:`~fedloom.secagg.keys`: X25519 key agreement, HKDF, ChaCha20-Poly1305;
* :mod:`~fedloom.secagg.masks`: ChaCha20 keystreams into masks modulo 2^b;
* :mod:`~fedloom.secagg.quantize`: stochastic rounding and the overflow bound;
* :mod:`~fedloom.secagg.graph`: SecAgg+'s Harary neighbour graph, SecAgg's complete one;
* :mod:`~fedloom.secagg.protocol`: the protocol, and :func:`run_round` in process; its
  setup and messages (:mod:`~fedloom.secagg.messages`) between :class:`SecAggClient`
  (:mod:`~fedloom.secagg.client`) and :class:`SecAggServer` (:mod:`~fedloom.secagg.server`);
* :mod:`~fedloom.secagg.encoding`, :mod:`~fedloom.secagg.wire`: the messages as bytes.

A run uses it as the transform chain's mask stage (:mod:`fedloom.transforms.secure_sum`,
``[secagg]``: :mod:`~fedloom.secagg.settings`), its stages driven by
:mod:`fedloom.runtime.secure_round` in every runtime (docs/privacy.md).
"""

from fedloom.secagg.client import SecAggClient
from fedloom.secagg.graph import complete_graph, default_neighbours, neighbour_graph
from fedloom.secagg.keys import ShareAuthenticationError
from fedloom.secagg.messages import (
    ClientRefusal,
    ProtocolError,
    RoundSetup,
    SecAggConfig,
    setup_round,
)
from fedloom.secagg.protocol import RoundOutcome, run_round
from fedloom.secagg.quantize import Quantizer, check_overflow, max_clients, quant_bits_for
from fedloom.secagg.server import SecAggResult, SecAggServer

__all__ = [
    "ClientRefusal",
    "ProtocolError",
    "Quantizer",
    "RoundOutcome",
    "RoundSetup",
    "SecAggClient",
    "SecAggConfig",
    "SecAggResult",
    "SecAggServer",
    "ShareAuthenticationError",
    "check_overflow",
    "complete_graph",
    "default_neighbours",
    "max_clients",
    "neighbour_graph",
    "quant_bits_for",
    "run_round",
    "setup_round",
]

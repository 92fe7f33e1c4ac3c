"""The SecAgg / SecAgg+ protocol: four stages of explicit messages, run in process.

The rule (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving
Machine Learning"; Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead"). The server announces the round (:class:`RoundSetup`: the
clients, the graph seed, t, b, the quantization); N(i) is client i's neighbours in the
graph (:mod:`fedloom.secagg.graph`: every other client for SecAgg, a Harary graph of
degree k for SecAgg+) and G(i) = N(i) ∪ {i} the holders of its shares.

0. Advertise keys. Each client draws two X25519 key pairs, (c_i^PK, c_i^SK) to encrypt
   shares and (s_i^PK, s_i^SK) for its pairwise masks, and a 32-byte self-mask seed b_i;
   it sends the two public keys. The server sends each client the keys of its neighbours
   that advertised (the set U1).
1. Share keys. Client i splits b_i and s_i^SK with Shamir at threshold t among G(i) ∩ U1,
   keeps its own shares, and encrypts each neighbour's pair of shares with
   ChaCha20-Poly1305 under the key agreed from c_i^SK and c_j^PK (associated data: round,
   sender, receiver). The server, which cannot read them, forwards to each client j of U2
   (the clients that sent shares) the ciphertexts addressed to it by U2.
2. Masked input. Client i decrypts its shares (a forged or replayed one fails
   authentication and the client stops), derives s_ij from s_i^SK and s_j^PK for every j
   that sent it shares, and sends y_i = q(x_i) + PRG(b_i) + Σ_j ±PRG(s_ij) mod 2^b
   (:mod:`fedloom.secagg.masks`, :mod:`fedloom.secagg.quantize`). U3: the clients whose y
   arrived.
3. Unmasking. The server tells each survivor u ∈ U3 which of its neighbours survived
   (U3: it needs their b-shares, to remove their self-masks) and which dropped after
   sharing (U2 \\ U3: it needs their key shares, to rebuild their pairwise masks with the
   survivors). The client answers with those shares only, and refuses a request that
   does not fit what it saw (below). From t shares of each, the server rebuilds the b_u
   and the dropped s_v^SK (checked against the advertised s_v^PK), removes the masks and
   obtains Σ_{u ∈ U3} q(x_u) exactly, which it dequantizes.

Drop-outs: a client that stops before stage 2 is left out cleanly (a client absent from U1
is nobody's neighbour; one in U1 \\ U2 masks with nobody, and nobody with it); one that
stops after sharing (U2 \\ U3) has its pairwise masks removed through its key shares; one
that sent y but stops before stage 3 (U3 \\ U4) is still summed, its b rebuilt from the
others' shares. The server refuses (:class:`ProtocolError`) when any of U1, U2, U3, U4 is
smaller than t, or when a secret it needs has fewer than t shares among the responders.

Security model, as in the papers' semi-honest setting: an honest-but-curious server and
fewer than t colluding clients in any G(i) learn nothing of an input beyond the sum. The
threshold must be a majority of G(i): each holder reveals one kind of share per peer, so a
server that tells some holders that j survived and others that j dropped still cannot
gather t shares of both kinds from fewer than 2t holders. Colluding holders reveal both
kinds, so against such a lying server c colluders among G(j) are safe only while
c < 2t − |G(j)| (Bonawitz et al.'s consistency round, not built, closes this).

What a client checks, rather than trust the server (Bonawitz et al. 2017, Fig. 4, where t
is a parameter of the protocol and a client aborts a round that does not fit what it
saw). A refusal is a :class:`ClientRefusal`, raised before the client sends anything of
that stage; :meth:`fedloom.runtime.secure_round.SecureClient.answer` then treats the client as
one that stopped there (it answers no later stage), and :func:`run_round` ends the round:

* the announced round, when it opens its side: it refuses a threshold that is not a
  strict majority of the holders of its shares (t ≤ |G(i)|/2) or exceeds them
  (t > |G(i)|), fewer neighbours than min(2, n − 1), and repeated client ids, as
  :func:`setup_round` does on the server (a server announcing t = 1 could otherwise ask
  one holder for a client's self-mask share and another for its key share);
* the unmasking request: it answers only if it sent its masked input and is named a
  survivor; every peer named sent it shares (U3 ⊆ U2 ⊆ U1 as it knows them); at least t
  of its share holders survived (|U3 ∩ G(i)| ≥ t); and no peer is asked for both its
  self-mask share and its key share, in one request or across requests (with b_j and
  s_j^SK the server could unmask y_j).

How fedloom differs: no signatures and no consistency check round (Bonawitz et al.'s
actively secure variant, with a PKI, is out of scope); the graph is derived by every
client from the announced seed rather than sent as a list; shares are held by G(i) (the
client itself included, as Flower's SecAgg+ does) so that SecAgg's complete graph gives
n shares and t ranges over ⌊n/2⌋ + 1..n; masks come from ChaCha20 over the full seed
(Flower's come from a Mersenne Twister seeded with a 32-bit fold); the exact overflow
condition for n clients is checked; the messages are objects with an explicit wire
encoding (each one's ``to_bytes``, :mod:`fedloom.secagg.encoding`), passed in process by
the local and Ray runtimes and sent as these bytes in the Flower runtime's message rounds
(:meth:`fedloom.runtime.flower_app.FlowerClients.secagg`).

The protocol's parts, one module each: the round's setup and the stages' messages
(:mod:`fedloom.secagg.messages`), the client's side (:mod:`fedloom.secagg.client`), the
server's side (:mod:`fedloom.secagg.server`); this module runs a round in process
(:func:`run_round`, for tests and benchmarks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from fedloom.secagg.client import SecAggClient
from fedloom.secagg.messages import STAGES, SecAggConfig, setup_round
from fedloom.secagg.server import SecAggResult, SecAggServer

#: stage name → client → bytes sent up (client → server) and down (server → client)
Traffic = dict[str, dict[int, dict[str, int]]]


@dataclass
class RoundOutcome:
    """A round run in process: the server's result, the bytes each client sent and
    received at each stage, and the parties (for inspection)."""

    result: SecAggResult
    traffic: Traffic
    server: SecAggServer
    clients: dict[int, SecAggClient] = field(default_factory=dict)

    def mean_bytes(self, stage: str) -> tuple[float, float]:
        """Mean (up, down) bytes per client that took part in ``stage``."""
        rows = list(self.traffic[stage].values())
        if not rows:
            return 0.0, 0.0
        return (
            float(np.mean([r["up"] for r in rows])),
            float(np.mean([r["down"] for r in rows])),
        )


def run_round(
    inputs: Mapping[int, ArrayLike],
    config: SecAggConfig,
    round_: int = 0,
    dropouts: Mapping[int, int] | None = None,
    rng: np.random.Generator | None = None,
    graph_seed: bytes | None = None,
    transport: Callable[[Any], Any] | None = None,
) -> RoundOutcome:
    """Run one round among the clients of ``inputs`` (client id → float vector), every
    message passing through the server. ``dropouts`` maps a client to the stage (0 to 3,
    :data:`STAGES`) from which it sends nothing more: 0 never advertises keys, 1 does not
    share them, 2 sends no masked input, 3 does not answer the unmasking. A refusal, by
    the server or by a client (a neighbourhood with fewer than t holders), ends the round
    with its :class:`ProtocolError`; a deployment would count such a client as dropped.
    ``transport`` carries every message (e.g. to its bytes and back,
    :func:`fedloom.secagg.wire.pack` and ``unpack``); by default, the object itself."""
    send: Callable[[Any], Any] = transport or (lambda message: message)
    dropouts = dict(dropouts or {})
    if bad := {c: s for c, s in dropouts.items() if c not in inputs or not 0 <= s <= 3}:
        raise ValueError(f"secagg: drop-outs {bad} (clients of the round, at stages 0 to 3)")
    vectors = {c: np.asarray(x, dtype=np.float64).reshape(-1) for c, x in inputs.items()}
    dims = {v.shape[0] for v in vectors.values()}
    if len(dims) != 1:
        raise ValueError(f"secagg: inputs of different lengths {sorted(dims)}")
    setup = setup_round(config, sorted(vectors), round_, dims.pop(), graph_seed)
    parent = np.random.default_rng() if rng is None else rng
    streams = parent.spawn(len(setup.clients))
    server = SecAggServer(setup)
    traffic: Traffic = {name: {} for name in STAGES}

    def alive(stage: int) -> list[int]:
        return [c for c in setup.clients if dropouts.get(c, 4) > stage]

    def count(stage: int, client: int, up: int = 0, down: int = 0) -> None:
        row = traffic[STAGES[stage]].setdefault(client, {"up": 0, "down": 0})
        row["up"] += up
        row["down"] += down

    for c in setup.clients:
        count(0, c, down=setup.nbytes())
    setup_sent = send(setup)
    clients = {c: SecAggClient(c, setup_sent, g) for c, g in zip(setup.clients, streams)}
    adverts = [send(clients[c].advertise()) for c in alive(0)]
    for a in adverts:
        count(0, a.client, up=a.nbytes())
    peer_keys = server.collect_keys(adverts)
    for c, keys in peer_keys.items():
        count(0, c, down=keys.nbytes())
    shared = [send(clients[c].share_keys(send(peer_keys[c]))) for c in alive(1) if c in peer_keys]
    for m in shared:
        count(1, m.client, up=m.nbytes())
    forwarded = server.route_shares(shared)
    for c, relayed in forwarded.items():
        count(1, c, down=relayed.nbytes())
    masked = [
        send(clients[c].masked_input(send(forwarded[c]), vectors[c]))
        for c in alive(2)
        if c in forwarded
    ]
    for y in masked:
        count(2, y.client, up=y.nbytes())
    requests = server.collect_masked(masked)
    for c, request in requests.items():
        count(3, c, down=request.nbytes())
    responses = [send(clients[c].unmask(send(requests[c]))) for c in alive(3) if c in requests]
    for r in responses:
        count(3, r.client, up=r.nbytes())
    return RoundOutcome(server.finish(responses), traffic, server, clients)

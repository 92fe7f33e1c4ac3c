"""The server's side of a round under secure aggregation: the four stages of SecAgg /
SecAgg+ (:mod:`fedloom.secagg.protocol`) as message rounds with the clients' hosts.

After local training each client holds its update on its host (:class:`ClientHost`
keeps it; only the number of examples and the training metrics came back). The server
announces the round (:meth:`SecureSum.setup`), then every stage is one call of the hosts'
``secagg`` (in process, or on each Ray actor for the clients it owns): the keys
advertised, the encrypted shares routed, the masked inputs summed, the shares needed to
unmask collected. What the server holds at the end is the sum (:class:`SecAggResult`);
the byte counts are those of the protocol's wire encoding, per client and direction.

A client that stops answering at a stage is a drop-out of the protocol: before sharing
its keys it is left out cleanly; after, its pairwise masks are rebuilt from its
neighbours' shares (``dropouts``). The simulated faults' mid-round drop-outs
(``faults.dropout``) stop after sharing keys, the case the recovery exists for. Too few
survivors for the threshold end the round's secure sum with the protocol's error, which
leaves every client of the round out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedloom.secagg import ProtocolError, RoundSetup, SecAggResult, SecAggServer
from fedloom.secagg.protocol import STAGES

if TYPE_CHECKING:
    from fedloom.runtime.clients import Clients
    from fedloom.transforms.secure_sum import SecureSum


@dataclass
class SecureRound:
    """One round's secure sum: the result (None when the protocol failed), the setup, the
    clients missing from the sum and why, and the protocol's bytes per client."""

    setup: RoundSetup
    result: SecAggResult | None
    missing: dict[int, str] = field(default_factory=dict)
    bytes_up: dict[int, int] = field(default_factory=dict)
    bytes_down: dict[int, int] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The train row's entries: ``secagg_dropouts`` (the clients whose masks were
        recovered) and the protocol's counts."""
        r = self.result
        return {
            "secagg_dropouts": len(r.dropouts) if r else 0,
            "secagg": {
                "protocol": self.setup.protocol,
                "clients": len(self.setup.clients),
                "summed": len(r.survivors) if r else 0,
                "dropouts": list(r.dropouts) if r else [],
                "left_out": list(r.left_out) if r else [],
                "neighbours": self.setup.neighbours,
                "threshold": self.setup.threshold,
                "quant_bits": self.setup.quant_bits,
                "bytes_up": sum(self.bytes_up.values()),
                "bytes_down": sum(self.bytes_down.values()),
            },
        }


def run(
    host: Clients, secure: SecureSum, weights: Mapping[int, int], round_: int, dim: int
) -> SecureRound:
    """The protocol among the clients of ``weights`` (client → w_k), each holding its
    update on ``host``."""
    setup = secure.setup(weights, round_, dim)
    out = SecureRound(setup, None)
    server = SecAggServer(setup)

    def count(messages: Mapping[int, Any], into: dict[int, int]) -> None:
        for cid, message in messages.items():
            into[cid] = into.get(cid, 0) + message.nbytes()

    for cid in setup.clients:
        out.bytes_down[cid] = setup.nbytes()
    try:
        adverts = host.secagg(round_, STAGES[0], {c: setup for c in setup.clients})
        count(adverts, out.bytes_up)
        peer_keys = server.collect_keys(list(adverts.values()))
        count(peer_keys, out.bytes_down)
        shared = host.secagg(round_, STAGES[1], peer_keys)
        count(shared, out.bytes_up)
        forwarded = server.route_shares(list(shared.values()))
        count(forwarded, out.bytes_down)
        masked = host.secagg(round_, STAGES[2], forwarded)
        count(masked, out.bytes_up)
        requests = server.collect_masked(list(masked.values()))
        count(requests, out.bytes_down)
        responses = host.secagg(round_, STAGES[3], requests)
        count(responses, out.bytes_up)
        out.result = server.finish(list(responses.values()))
    except ProtocolError as err:
        out.missing = {cid: f"secure aggregation failed: {err}" for cid in setup.clients}
        return out
    result = out.result
    for cid in result.left_out:
        out.missing[cid] = "left out of secure aggregation (stopped before sharing its keys)"
    for cid in result.dropouts:
        out.missing[cid] = (
            "dropped out of secure aggregation after sharing its keys (its masks recovered)"
        )
    return out

"""SecAgg against a malicious server (issue 66, item 3): the clients check the threshold
and every unmasking request themselves (Bonawitz et al. 2017, "Practical Secure
Aggregation for Privacy-Preserving Machine Learning", Fig. 4), so a server that lies
gets nothing it could unmask one client's input with, and an honest round still sums
exactly."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pytest

from fedloom.secagg import (
    ClientRefusal,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    run_round,
    setup_round,
    shamir,
)
from fedloom.secagg.keys import KeyPair, pair_seed
from fedloom.secagg.masks import (
    PAIR_MASK,
    SELF_MASK,
    UInts,
    add_signed,
    expand,
    modulus_mask,
    pair_sign,
)
from fedloom.secagg.messages import MaskedInput, UnmaskRequest, UnmaskResponse
from fedloom.secagg.shamir import Share

D = 20
GRAPH_SEED = bytes(32)
#: SecAgg among 6 (|G| = 6, the least legal t = 4) and SecAgg+ among 10 with k = 4
#: (|G| = 5, the least legal t = 3): the thresholds most favourable to the server
LEAST_MAJORITY = {
    "secagg": SecAggConfig(protocol="secagg", threshold=4),
    "secagg+": SecAggConfig(protocol="secagg+", neighbours=4, threshold=3),
}
ROUND_SIZE = {"secagg": 6, "secagg+": 10}

Script = Callable[[int, UnmaskRequest], UnmaskRequest]


def _inputs(n: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    return {c: rng.uniform(-0.9, 0.9, D) for c in range(n)}


def _setup(protocol: str) -> RoundSetup:
    clients = list(range(ROUND_SIZE[protocol]))
    return setup_round(LEAST_MAJORITY[protocol], clients, 7, D, graph_seed=GRAPH_SEED)


class ScriptedServer(SecAggServer):
    """The protocol's own server, honest but for its unmasking requests, which ``script``
    rewrites (client → the request it gets)."""

    def __init__(self, setup: RoundSetup, script: Script) -> None:
        super().__init__(setup)
        self.script = script

    def collect_masked(self, inputs: Sequence[MaskedInput]) -> dict[int, UnmaskRequest]:
        return {c: self.script(c, r) for c, r in super().collect_masked(inputs).items()}


@dataclass
class Unmasking:
    """A round carried to the unmasking: the clients, the mask keys they advertised (by
    client), and the server's requests."""

    clients: dict[int, SecAggClient]
    mask_keys: dict[int, bytes]
    requests: dict[int, UnmaskRequest]


def _to_unmasking(server: SecAggServer, silent_at_share: Sequence[int] = ()) -> Unmasking:
    """Stages 0 to 2 with honest clients (those of ``silent_at_share`` send no shares)."""
    setup = server.setup
    inputs = _inputs(len(setup.clients))
    clients = {c: SecAggClient(c, setup, np.random.default_rng(c)) for c in setup.clients}
    adverts = [client.advertise() for client in clients.values()]
    peer_keys = server.collect_keys(adverts)
    shared = [clients[c].share_keys(peer_keys[c]) for c in clients if c not in silent_at_share]
    forwarded = server.route_shares(shared)
    masked = [clients[c].masked_input(forwarded[c], inputs[c]) for c in forwarded]
    requests = server.collect_masked(masked)
    return Unmasking(clients, {a.client: a.mask_key for a in adverts}, requests)


def _answers(
    clients: dict[int, SecAggClient], requests: dict[int, UnmaskRequest]
) -> dict[int, UnmaskResponse]:
    """What the server collects: each client's answer; one that refuses answers nothing
    (the runtimes count it as a client that stopped)."""
    out = {}
    for c, request in requests.items():
        try:
            out[c] = clients[c].unmask(request)
        except ClientRefusal:
            continue
    return out


def _claim_dropped(target: int) -> Callable[[UnmaskRequest], UnmaskRequest]:
    """The lie that ``target`` dropped after sharing: its key share asked for instead."""

    def lie(r: UnmaskRequest) -> UnmaskRequest:
        survivors = tuple(c for c in r.survivors if c != target)
        return UnmaskRequest(r.round, survivors, tuple(sorted({*r.dropped, target})))

    return lie


def _claim_survived(target: int) -> Callable[[UnmaskRequest], UnmaskRequest]:
    """The lie that ``target`` survived: its self-mask share asked for instead."""

    def lie(r: UnmaskRequest) -> UnmaskRequest:
        dropped = tuple(c for c in r.dropped if c != target)
        return UnmaskRequest(r.round, tuple(sorted({*r.survivors, target})), dropped)

    return lie


# --- (a) the threshold ----------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["secagg", "secagg+"])
def test_every_client_refuses_a_threshold_that_is_not_a_majority(protocol):
    """t ≤ |G|/2 (t = 1 is the issue's server) or t > |G|: every client refuses when it
    opens its side of the round, before it advertises a key or deals a share."""
    honest = _setup(protocol)
    holders = len(honest.group(0))
    assert all(len(honest.group(c)) == holders for c in honest.clients)
    for t in range(holders // 2 + 1):
        forged = replace(honest, threshold=t)
        for c in forged.clients:
            with pytest.raises(ClientRefusal, match=f"t = {t} is not a majority of the {holders}"):
                SecAggClient(c, forged)
    too_high = replace(honest, threshold=holders + 1)
    with pytest.raises(ClientRefusal, match=f"exceeds the {holders} holders of its shares"):
        SecAggClient(0, too_high)
    # the least majority is accepted
    SecAggClient(0, replace(honest, threshold=holders // 2 + 1))


def test_clients_refuse_a_neighbourhood_that_cannot_hide_them():
    honest = _setup("secagg+")
    # no neighbours and t = 1 of 1: the input would hide behind its self-mask alone
    isolated = replace(honest, neighbours=0, threshold=1)
    for c in isolated.clients:
        with pytest.raises(ClientRefusal, match="0 neighbours, fewer than the protocol's 2"):
            SecAggClient(c, isolated)
    repeated = replace(honest, clients=(0, 0, *honest.clients[1:]))
    with pytest.raises(ClientRefusal, match="repeated client ids"):
        SecAggClient(0, repeated)


def test_the_issues_server_gets_no_key_advertised():
    """t = 1: no client opens its side, so the server has nothing to route or unmask."""
    forged = replace(_setup("secagg"), threshold=1)
    opened = []
    for c in forged.clients:
        try:
            opened.append(SecAggClient(c, forged))
        except ClientRefusal:
            continue
    assert opened == []


# --- (b) the unmasking requests -------------------------------------------------------

A, C = 0, 2  # the client asked, and the peer asked about


def _for_a(change: Callable[[UnmaskRequest], UnmaskRequest]) -> Script:
    return lambda c, r: change(r) if c == A else r


@pytest.mark.parametrize(
    "script,match",
    [
        (  # C's key share while C is listed as a survivor: both kinds at once
            _for_a(lambda r: UnmaskRequest(r.round, r.survivors, (C,))),
            f"both the self-mask share and the key share of client {C}",
        ),
        (  # client 5 sent no shares: U3 is not a subset of U2
            _for_a(lambda r: UnmaskRequest(r.round, (*r.survivors, 5), r.dropped)),
            r"names \[5\] among the survivors or the dropped, but they sent it no shares",
        ),
        (  # a key share of client 5, who dropped before sharing
            _for_a(lambda r: UnmaskRequest(r.round, r.survivors, (5,))),
            r"names \[5\] among the survivors or the dropped",
        ),
        (  # A itself counted as dropped
            _for_a(_claim_dropped(A)),
            "counts it as dropped, but it sent its masked input",
        ),
        (  # fewer survivors than t
            _for_a(lambda r: UnmaskRequest(r.round, r.survivors[:3], r.dropped)),
            "3 survivors among its neighbours and itself, fewer than t = 4",
        ),
    ],
    ids=["both-kinds", "survivor-not-in-U2", "key-of-left-out", "self-dropped", "below-t"],
)
def test_client_refuses_an_inconsistent_request_and_reveals_nothing(script, match):
    setup = _setup("secagg")
    server = ScriptedServer(setup, script)
    round_ = _to_unmasking(server, silent_at_share=[5])
    with pytest.raises(ClientRefusal, match=match):
        round_.clients[A].unmask(round_.requests[A])
    answers = _answers(round_.clients, round_.requests)
    assert A not in answers  # nothing from the refusing client
    # the others answer honestly and the round still sums exactly without A's answer
    result = server.finish(list(answers.values()))
    assert result.silent == (A,) and result.left_out == (5,)
    expected = sum(round_.clients[c].quantized.astype(np.int64) for c in result.survivors)
    np.testing.assert_array_equal(result.total, expected)


@pytest.mark.parametrize("first", ["self-mask", "key"])
def test_a_later_request_cannot_ask_for_the_other_share_of_a_peer(first):
    """A peer named a survivor in one request and dropped in a later one (or the reverse)
    is refused: across requests too, one kind of share per peer."""
    round_ = _to_unmasking(ScriptedServer(_setup("secagg"), lambda c, r: r))
    honest = round_.requests[A]
    lying = _claim_dropped(C)(honest)
    earlier, later = (honest, lying) if first == "self-mask" else (lying, honest)
    answer = round_.clients[A].unmask(earlier)
    kinds = (C in answer.self_mask_shares, C in answer.key_shares)
    assert kinds == (first == "self-mask", first == "key")
    with pytest.raises(ClientRefusal, match=f"already revealed client {C}'s {first} share"):
        round_.clients[A].unmask(later)
    assert round_.clients[A].unmask(earlier) == answer  # a repeat reveals nothing new


# --- (c) the attack of the issue ------------------------------------------------------


def _unmask_one(
    round_: Unmasking,
    server: SecAggServer,
    target: int,
    b_shares: list[Share],
    key_shares: list[Share],
) -> UInts | None:
    """The attack: q(x_target) from its masked input, its self-mask seed b and its mask key
    s^SK rebuilt from the shares the server holds (None without shares of both kinds)."""
    if not b_shares or not key_shares:
        return None
    setup = server.setup
    y = server.received[target].copy()
    b = shamir.combine(b_shares)
    add_signed(y, expand(b, setup.round, setup.dim, setup.bits, SELF_MASK), -1)
    secret = KeyPair.from_private_bytes(shamir.combine(key_shares)).private
    for peer in sorted(setup.graph[target]):
        seed = pair_seed(secret, round_.mask_keys[peer])
        mask = expand(seed, setup.round, setup.dim, setup.bits, PAIR_MASK)
        add_signed(y, mask, -pair_sign(target, peer))
    return y & modulus_mask(setup.bits)


def _splits(holders: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way to tell some holders the target survived and the others it dropped."""
    for size in range(len(holders) + 1):
        yield from itertools.combinations(holders, size)


def _shares_of(target: int, answers: dict[int, UnmaskResponse]) -> tuple[list[Share], list[Share]]:
    """The self-mask shares and the key shares of ``target`` among ``answers``."""
    b_shares = [
        r.self_mask_shares[target] for r in answers.values() if target in r.self_mask_shares
    ]
    key_shares = [r.key_shares[target] for r in answers.values() if target in r.key_shares]
    return b_shares, key_shares


@pytest.mark.parametrize("protocol", ["secagg", "secagg+"])
def test_a_lying_server_cannot_gather_both_shares_of_a_client(protocol):
    """The server tells some of the target's share holders that it survived (their
    self-mask shares) and the others that it dropped (their key shares), then asks each
    holder for the other kind too. Each honest holder reveals one kind only, and t is a
    majority of the holders, so one kind always stays below t: the target's input stays
    hidden, for every such split."""
    setup, target = _setup(protocol), 0
    t, dropped, survived = setup.threshold, _claim_dropped(target), _claim_survived(target)
    others = sorted(setup.graph[target])
    for told_dropped in _splits(others):
        server = ScriptedServer(setup, lambda c, r, d=told_dropped: dropped(r) if c in d else r)
        round_ = _to_unmasking(server)
        first = _answers(round_.clients, round_.requests)
        # the second pass: every holder asked for the kind it did not reveal
        flipped = {
            c: (survived if c in told_dropped else dropped)(round_.requests[c]) for c in others
        }
        assert _answers(round_.clients, flipped) == {}
        b_shares, key_shares = _shares_of(target, first)
        assert len(b_shares) + len(key_shares) == len(setup.group(target)) < 2 * t
        assert min(len(b_shares), len(key_shares)) < t
        recovered = _unmask_one(round_, server, target, b_shares, key_shares)
        assert recovered is None or not np.array_equal(recovered, round_.clients[target].quantized)


@pytest.mark.parametrize("protocol", ["secagg", "secagg+"])
def test_the_attack_needs_t_shares_of_both_kinds(protocol):
    """The attack above is a real one: given t shares of each kind of the target's
    secrets (what t colluding holders hold), it recovers the target's input exactly."""
    setup, target = _setup(protocol), 0
    server = ScriptedServer(setup, lambda c, r: r)
    round_ = _to_unmasking(server)
    colluders = sorted(setup.group(target))[: setup.threshold]
    held = [round_.clients[h]._held[target] for h in colluders]
    b_shares, key_shares = [b for b, _ in held], [k for _, k in held]
    recovered = _unmask_one(round_, server, target, b_shares, key_shares)
    np.testing.assert_array_equal(recovered, round_.clients[target].quantized)


# --- an honest round ------------------------------------------------------------------


@pytest.mark.parametrize(
    "protocol,dropouts",
    [
        ("secagg", {1: 0, 3: 2}),  # t = 4 of 6: two may drop
        ("secagg", {2: 1, 4: 3}),
        ("secagg+", {0: 0, 1: 1, 2: 2, 3: 3}),  # one at every stage, t = 3 of 5 holders
    ],
)
def test_an_honest_round_with_dropouts_still_sums_exactly(protocol, dropouts):
    n = ROUND_SIZE[protocol]
    inputs = _inputs(n)
    outcome = run_round(
        inputs,
        LEAST_MAJORITY[protocol],
        round_=7,
        dropouts=dropouts,
        rng=np.random.default_rng(1),
        graph_seed=GRAPH_SEED,
    )
    result = outcome.result
    assert set(result.survivors) == {c for c in inputs if dropouts.get(c, 4) >= 3}
    expected = sum(outcome.clients[c].quantized.astype(np.int64) for c in result.survivors)
    np.testing.assert_array_equal(result.total, expected)
    error = np.abs(result.sum - sum(inputs[c] for c in result.survivors)).max()
    assert error < result.error_bound

"""SecAgg / SecAgg+ (src/fedloom/secagg): exact sums under drop-outs, what the server
sees, the attacks a client and the AEAD refuse, quantization, and the neighbour graph."""

from __future__ import annotations

import itertools
import math
import random
import secrets
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from scipy import stats

import fedloom.secagg.client as secagg_client
from fedloom.secagg import (
    ClientRefusal,
    ProtocolError,
    Quantizer,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    ShareAuthenticationError,
    check_overflow,
    complete_graph,
    default_neighbours,
    keys,
    masks,
    max_clients,
    neighbour_graph,
    quant_bits_for,
    run_round,
    setup_round,
    shamir,
    wire,
)
from fedloom.secagg.encoding import WireError, pack_bits, unpack_bits
from fedloom.secagg.graph import harary
from fedloom.secagg.messages import Forwarded, UnmaskRequest

D = 1000
#: the significance level of the uniformity tests, each run at a fixed seed: a uniform
#: sample passes with probability 1 − ALPHA, and the seeds below are ones where it does
ALPHA = 1e-3


def _inputs(n: int, d: int = D, seed: int = 0, scale: float = 0.9) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {c: rng.uniform(-scale, scale, d) for c in range(n)}


def _seed_protocol_secrets(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Draw the round's secrets (each client's self-mask seed and X25519 key pairs) from a
    seeded generator, so that a statistical test of the masks is deterministic. For tests
    only: the protocol draws them from the operating system."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(secagg_client, "secrets", SimpleNamespace(token_bytes=rng.bytes))
    monkeypatch.setattr(
        keys.KeyPair, "generate", classmethod(lambda cls: cls.from_private_bytes(rng.bytes(32)))
    )


def _check_exact(outcome, inputs) -> float:
    """The server's total equals the survivors' quantized sum exactly; the dequantized sum
    is within the bound of the float sum. Returns the largest float error."""
    result = outcome.result
    expected = sum(outcome.clients[c].quantized.astype(np.int64) for c in result.survivors)
    np.testing.assert_array_equal(result.total, expected)
    error = float(np.abs(result.sum - sum(inputs[c] for c in result.survivors)).max())
    assert error < result.error_bound
    return error


# --- Shamir --------------------------------------------------------------------------


def test_shamir_every_t_subset_recovers_and_t_minus_1_do_not():
    secret = secrets.token_bytes(32)
    shares = shamir.split(secret, 4, [1, 2, 3, 4, 5, 6])
    for k in (4, 5, 6):
        for subset in itertools.combinations(shares, k):
            assert shamir.combine(subset) == secret
    for subset in itertools.combinations(shares, 3):
        assert shamir.combine(subset) != secret
    with pytest.raises(ValueError, match="3 shares cannot recover a secret shared at threshold 4"):
        shamir.combine(shares[:3], threshold=4)


@pytest.mark.parametrize("length", [1, 15, 16, 32, 33])
def test_shamir_shares_round_trip_through_bytes(length):
    secret = secrets.token_bytes(length)
    shares = shamir.split(secret, 2, [7, 9, 11])
    wire = [s.to_bytes() for s in shares]
    assert all(len(w) == 6 + 16 * math.ceil(length / 15) for w in wire)
    assert shamir.combine([shamir.Share.from_bytes(w) for w in wire[1:]]) == secret
    with pytest.raises(ValueError, match="share ids"):
        shamir.split(secret, 2, [0, 1])


def test_shamir_one_share_of_a_2_threshold_is_uniform_whatever_the_secret(monkeypatch):
    # t − 1 = 1 share: its value is uniform on the field for any secret, so two very
    # different secrets give indistinguishable first shares (top 4 bits of the value);
    # the polynomials' coefficients come from a seeded generator, so the test is fixed
    monkeypatch.setattr(shamir, "secrets", SimpleNamespace(randbelow=random.Random(0).randrange))

    def tops(secret: bytes) -> np.ndarray:
        return np.array([shamir.split(secret, 2, [1, 2])[0].values[0] >> 123 for _ in range(2000)])

    a, b = tops(bytes(15)), tops(b"\xff" * 15)
    for top in (a, b):
        counts = np.bincount(top, minlength=16)
        assert stats.chisquare(counts).pvalue > ALPHA  # 15 degrees of freedom


# --- keys and AEAD -------------------------------------------------------------------


def test_key_agreement_is_symmetric_and_purposes_differ():
    a, b = keys.KeyPair.generate(), keys.KeyPair.generate()
    assert keys.pair_seed(a.private, b.public) == keys.pair_seed(b.private, a.public)
    assert keys.encryption_key(a.private, b.public) == keys.encryption_key(b.private, a.public)
    assert keys.pair_seed(a.private, b.public) != keys.encryption_key(a.private, b.public)
    rebuilt = keys.KeyPair.from_private_bytes(a.private_bytes())
    assert rebuilt.public == a.public


def test_tampered_or_misdirected_ciphertext_fails_authentication():
    key = secrets.token_bytes(32)
    sealed = keys.encrypt(key, b"shares", round_=3, sender=1, receiver=2)
    assert keys.decrypt(key, sealed, round_=3, sender=1, receiver=2) == b"shares"
    tampered = bytearray(sealed)
    tampered[20] ^= 1
    with pytest.raises(ShareAuthenticationError, match="failed authentication"):
        keys.decrypt(key, bytes(tampered), round_=3, sender=1, receiver=2)
    # wrong round (a replay), swapped sender and receiver, another key
    for kwargs in (
        {"round_": 4, "sender": 1, "receiver": 2},
        {"round_": 3, "sender": 2, "receiver": 1},
    ):
        with pytest.raises(ShareAuthenticationError, match="round"):
            keys.decrypt(key, sealed, **kwargs)
    with pytest.raises(ShareAuthenticationError):
        keys.decrypt(secrets.token_bytes(32), sealed, round_=3, sender=1, receiver=2)


# --- masks ---------------------------------------------------------------------------


def test_pairwise_masks_cancel_and_stay_in_range():
    bits, d, n = 62, 500, 6
    seeds = {(i, j): secrets.token_bytes(32) for i in range(n) for j in range(i + 1, n)}
    total = np.zeros(d, dtype=np.uint64)
    for i in range(n):
        mine = {j: seeds[min(i, j), max(i, j)] for j in range(n) if j != i}
        m = masks.pair_masks(i, mine, 5, d, bits)
        assert m.max() < 1 << bits
        total += m
    assert not np.any(total & masks.modulus_mask(bits))
    seed = secrets.token_bytes(32)
    base = masks.expand(seed, 1, d, bits, masks.PAIR_MASK)
    np.testing.assert_array_equal(base, masks.expand(seed, 1, d, bits, masks.PAIR_MASK))
    assert not np.array_equal(base, masks.expand(seed, 2, d, bits, masks.PAIR_MASK))
    assert not np.array_equal(base, masks.expand(seed, 1, d, bits, masks.SELF_MASK))
    with pytest.raises(ValueError, match="secagg.bits"):
        masks.modulus_mask(63)


# --- quantization --------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_inside_the_range():
    q = Quantizer(clip_range=1.0, quant_bits=4)  # 15 steps of 2/15: coarse on purpose
    d, draws = 1000, 4000
    x = np.linspace(-1.0, 1.0, d)
    rng = np.random.default_rng(0)
    deq = q.dequantize(q.quantize(np.tile(x, draws), rng)).reshape(draws, d)
    assert np.all(np.abs(deq - x) < q.step)  # one client's error is below a step
    frac = (x + 1.0) * q.levels / 2.0
    frac -= np.floor(frac)
    sd = q.step * np.sqrt(frac * (1 - frac) / draws)  # the MC error of the mean
    random = sd > 0
    z = (deq.mean(axis=0) - x)[random] / sd[random]
    assert np.abs(z).max() < 5.0
    assert abs(z.mean()) < 5.0 / math.sqrt(random.sum())
    # outside the range: unbiased for the clipped value
    np.testing.assert_array_equal(q.quantize(np.array([-3.0, 3.0]), rng), [0, q.levels])


def test_overflow_is_refused_exactly_at_the_bound():
    assert max_clients(32, 16) == 65537  # (2^32 − 1) / (2^16 − 1) = 2^16 + 1
    check_overflow(65537, 32, 16)
    with pytest.raises(ValueError, match=r"secagg\.bits: .*at most 65537 clients"):
        check_overflow(65538, 32, 16)
    for n in (2, 10, 17, 1000):
        bq = quant_bits_for(n, 32)
        assert n * ((1 << bq) - 1) <= (1 << 32) - 1 < n * ((1 << (bq + 1)) - 1)
    config = SecAggConfig(bits=8, quant_bits=4)
    assert max_clients(8, 4) == 17
    setup_round(config, list(range(17)), 0, D)
    with pytest.raises(ValueError, match=r"secagg\.bits"):
        setup_round(config, list(range(18)), 0, D)


def test_the_largest_sum_at_the_bound_does_not_wrap():
    # 17 clients at +c: each q = 15, the sum 255 = 2^8 − 1, the largest value mod 2^8
    inputs = {c: np.full(64, 1.0) for c in range(17)}
    outcome = run_round(inputs, SecAggConfig(bits=8, quant_bits=4), rng=np.random.default_rng(0))
    assert np.all(outcome.result.total == 255)
    np.testing.assert_allclose(outcome.result.sum, 17.0)


# --- graph ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [5, 6, 11, 20])
@pytest.mark.parametrize("k", [2, 3, 4, 5, 8])
def test_harary_graph_degrees_symmetry_and_seed(n, k):
    seed = secrets.token_bytes(32)
    graph = neighbour_graph(list(range(n)), k, seed)
    degrees = sorted(len(v) for v in graph.values())
    if k >= n - 1:
        assert degrees == [n - 1] * n
    elif k % 2 and n % 2:
        assert degrees == [k] * (n - 1) + [k + 1]  # one node of degree k + 1
    else:
        assert degrees == [k] * n
    for i, nbrs in graph.items():
        assert i not in nbrs and all(i in graph[j] for j in nbrs)
    assert neighbour_graph(list(reversed(range(n))), k, seed) == graph
    assert len(harary(n, k)) == n


def test_graph_seed_and_defaults():
    clients = list(range(20))
    a = neighbour_graph(clients, 4, bytes(32))
    assert neighbour_graph(clients, 4, bytes(32)) == a
    assert neighbour_graph(clients, 4, b"\x01" + bytes(31)) != a
    assert complete_graph([3, 5, 9]) == {3: {5, 9}, 5: {3, 9}, 9: {3, 5}}
    assert [default_neighbours(n) for n in (3, 10, 20, 50, 1000)] == [2, 8, 10, 12, 20]


# --- the protocol: exact sums --------------------------------------------------------


@pytest.mark.parametrize(
    "dropouts",
    [
        {},
        {3: 2, 11: 2},  # after stage 1: shared keys, sent no masked input
        {3: 3, 11: 3},  # after stage 2: sent y, did not help unmask
        {1: 0, 5: 1, 3: 2, 11: 3},  # one at every stage
    ],
    ids=["none", "after-sharing", "after-masking", "every-stage"],
)
def test_exact_sum_with_dropouts_secagg_plus(dropouts):
    inputs = _inputs(20)
    seed = bytes(range(32))  # a graph where no neighbourhood (11 holders) loses 4 > 11 − t
    setup = setup_round(SecAggConfig(), list(range(20)), 0, D, graph_seed=seed)
    assert setup.neighbours == 10 and setup.threshold == 8 and _feasible(setup, dropouts)
    outcome = run_round(
        inputs, SecAggConfig(), dropouts=dropouts, rng=np.random.default_rng(1), graph_seed=seed
    )
    result = outcome.result
    stage = dict(dropouts)
    assert set(result.survivors) == {c for c in inputs if stage.get(c, 4) >= 3}
    assert set(result.dropouts) == {c for c, s in stage.items() if s == 2}
    assert set(result.left_out) == {c for c, s in stage.items() if s < 2}
    assert set(result.silent) == {c for c, s in stage.items() if s == 3}
    _check_exact(outcome, inputs)


def test_exact_sum_secagg_with_n_minus_t_dropouts_after_masking():
    inputs = _inputs(12)
    rng = np.random.default_rng(2)
    for _ in range(4):
        gone = rng.choice(12, size=4, replace=False)  # t = 8 of 12
        stages = rng.integers(2, 4, size=4)
        outcome = run_round(
            inputs,
            SecAggConfig(protocol="secagg"),
            dropouts={int(c): int(s) for c, s in zip(gone, stages)},
            rng=rng,
        )
        assert outcome.server.setup.threshold == 8
        _check_exact(outcome, inputs)


def _feasible(setup, dropouts: dict[int, int]) -> bool:
    """Whether a round with these drop-outs has t of every set and share it needs."""
    stage = {c: dropouts.get(c, 4) for c in setup.clients}
    u = [{c for c, s in stage.items() if s > k} for k in range(4)]  # U1..U4
    t = setup.threshold

    def held(c: int, among: set[int]) -> bool:
        return len(setup.group(c) & among) >= t

    return (
        all(len(x) >= t for x in u)
        and all(held(c, u[0]) for c in u[0])  # holders with keys, stage 1
        and all(held(c, u[1]) for c in u[1])  # shares received, stage 2
        and all(held(c, u[2]) for c in u[3])  # survivors a client is told of, stage 3
        and all(held(c, u[3]) for c in u[2])  # b-shares of every survivor
        and all(held(v, u[3]) for v in u[1] - u[2] if setup.graph[v] & u[2])  # key shares
    )


@pytest.mark.parametrize("protocol,n,first", [("secagg", 6, 0), ("secagg+", 10, 2)])
def test_every_dropout_pattern_small_n(protocol, n, first):
    """Every pattern of up to two drop-outs at the stages from ``first`` on: the sum is
    exact when t of every set and share survive, and refused (ProtocolError) otherwise.
    SecAgg with 6 clients: t = 4 of 6, any two may drop; SecAgg+ with 10: k = 4, t = 4 of
    the 5 holders, two drop-outs in one neighbourhood are too many."""
    config = SecAggConfig(protocol=protocol, neighbours=4)
    setup = setup_round(config, list(range(n)), 0, 50, graph_seed=bytes(32))
    inputs = _inputs(n, d=50)
    rng = np.random.default_rng(3)
    exact = refused = 0
    for size in (0, 1, 2):
        for gone in itertools.combinations(range(n), size):
            for stages in itertools.product(range(first, 4), repeat=size):
                dropouts = dict(zip(gone, stages))
                if _feasible(setup, dropouts):
                    outcome = run_round(
                        inputs, config, dropouts=dropouts, rng=rng, graph_seed=bytes(32)
                    )
                    _check_exact(outcome, inputs)
                    exact += 1
                else:
                    with pytest.raises(ProtocolError, match="fewer than"):
                        run_round(inputs, config, dropouts=dropouts, graph_seed=bytes(32))
                    refused += 1
    assert exact + refused == 1 + n * (4 - first) + math.comb(n, 2) * (4 - first) ** 2
    if protocol == "secagg":
        assert refused == 0
    else:
        assert exact == 1 + 2 * n + 4 * 5 and refused > 100  # 5 pairs at ring distance 5


def test_below_threshold_is_refused():
    inputs = _inputs(5, d=20)
    config = SecAggConfig(protocol="secagg")  # t = 4 of 5
    with pytest.raises(
        ProtocolError, match="3 clients sent a masked input, fewer than the threshold t = 4"
    ):
        run_round(inputs, config, dropouts={0: 2, 1: 2})
    with pytest.raises(ProtocolError, match="3 clients answered the unmasking, fewer than"):
        run_round(inputs, config, dropouts={0: 3, 1: 3})
    with pytest.raises(ProtocolError, match="advertised keys, fewer than"):
        run_round(inputs, config, dropouts={0: 0, 1: 0})


def test_secagg_plus_refuses_a_neighbourhood_below_threshold():
    # k = 4, t = 4 of 5 holders: two of one survivor's neighbours silent after masking
    # leave 3 of its self-mask shares
    inputs = _inputs(12, d=20)
    config = SecAggConfig(neighbours=4)
    setup = setup_round(config, list(range(12)), 0, 20, graph_seed=bytes(32))
    u = 0
    a, b = sorted(setup.graph[u])[:2]
    with pytest.raises(ProtocolError, match=f"3 self-mask shares of client {u}"):
        run_round(inputs, config, dropouts={a: 3, b: 3}, graph_seed=bytes(32))


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"protocol": "secagg", "threshold": 6}, "secagg.threshold: t = 6 exceeds the 5 shares"),
        ({"protocol": "secagg", "threshold": 2}, "secagg.threshold: t = 2 is not a majority"),
        ({"neighbours": 1}, "secagg.neighbours"),
        ({"bits": 63}, "secagg.bits"),
        ({"clip_range": 0.0}, "secagg.clip_range"),
        ({"protocol": "ckks"}, "secagg.protocol"),
    ],
)
def test_bad_settings_name_their_key(settings, match):
    with pytest.raises(ValueError, match=match):
        setup_round(SecAggConfig(**settings), list(range(5)), 0, 10)


# --- what the server sees ------------------------------------------------------------


def test_masked_input_is_uniform_mod_2b_and_unlike_the_input(monkeypatch):
    # every random source is seeded (the clients' secrets, the graph, the rounding), so
    # the tests below, at level ALPHA, give the same answer every run
    _seed_protocol_secrets(monkeypatch, 4)
    bits, d = 32, 4000
    # two very different inputs: every coordinate at −c, and every one at +c
    inputs = {c: np.full(d, -1.0 if c % 2 else 1.0) for c in range(10)}
    outcome = run_round(
        inputs, SecAggConfig(bits=bits), rng=np.random.default_rng(4), graph_seed=bytes(32)
    )
    for c in (0, 1):
        y = outcome.server.received[c]
        q = outcome.clients[c].quantized
        assert not np.any(y == q)
        assert stats.kstest(y / 2.0**bits, "uniform").pvalue > ALPHA
        # Pearson's χ² on the top 6 bits: 64 cells of d/64 = 62.5 expected, 63 d.o.f.
        counts = np.bincount((y >> np.uint64(bits - 6)).astype(np.int64), minlength=64)
        assert stats.chisquare(counts).pvalue > ALPHA
        # the same tests have the power to reject the quantized input itself
        assert stats.kstest(q / 2.0**bits, "uniform").pvalue < 1e-100
    two = outcome.server.received
    assert stats.ks_2samp(two[0] / 2.0**bits, two[1] / 2.0**bits).pvalue > ALPHA
    _check_exact(outcome, inputs)


# --- attacks -------------------------------------------------------------------------


def _staged(n: int, config: SecAggConfig, d: int = 20):
    """A round carried to the end of stage 1: the setup, clients, server, forwarded shares."""
    setup = setup_round(config, list(range(n)), 7, d)
    clients = {c: SecAggClient(c, setup, np.random.default_rng(c)) for c in range(n)}
    server = SecAggServer(setup)
    peer_keys = server.collect_keys([c.advertise() for c in clients.values()])
    forwarded = server.route_shares([clients[c].share_keys(peer_keys[c]) for c in clients])
    return setup, clients, server, forwarded


def test_client_refuses_both_shares_of_one_peer():
    _setup, clients, _server, forwarded = _staged(6, SecAggConfig(protocol="secagg"))
    # a client that sent no masked input answers nothing
    with pytest.raises(ClientRefusal, match="sent no masked input"):
        clients[0].unmask(UnmaskRequest(7, (0, 1, 2, 3, 4), ()))
    for c in clients:
        clients[c].masked_input(forwarded[c], np.zeros(20))
    # in one request: peer 2 listed as survivor and as dropped
    with pytest.raises(
        ClientRefusal, match="both the self-mask share and the key share of client 2"
    ):
        clients[0].unmask(UnmaskRequest(7, (0, 1, 2, 3, 4), (2,)))
    # across requests: the b-share of 2 first, then its key share
    clients[0].unmask(UnmaskRequest(7, (0, 1, 2, 3, 4), ()))
    with pytest.raises(ClientRefusal, match="already revealed client 2's self-mask share"):
        clients[0].unmask(UnmaskRequest(7, (0, 1, 3, 4), (2,)))
    # asked for its own key share: the server counts it as dropped
    with pytest.raises(ClientRefusal, match="counts it as dropped"):
        clients[1].unmask(UnmaskRequest(7, (0, 2, 3, 4), (1,)))
    # fewer than t survivors named
    with pytest.raises(ClientRefusal, match="fewer than t = 4"):
        clients[3].unmask(UnmaskRequest(7, (3, 4, 5), ()))


def test_tampered_or_redirected_share_fails_authentication():
    _setup, clients, _server, forwarded = _staged(5, SecAggConfig(protocol="secagg"))
    cts = dict(forwarded[0].ciphertexts)
    bad = bytearray(cts[1])
    bad[-1] ^= 0x80
    cts[1] = bytes(bad)
    with pytest.raises(ShareAuthenticationError, match="from client 1 to client 0 in round 7"):
        clients[0].masked_input(Forwarded(7, cts), np.zeros(20))
    # a genuine ciphertext relabelled as another sender's does not authenticate either
    swapped = dict(forwarded[0].ciphertexts)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    with pytest.raises(ShareAuthenticationError):
        clients[0].masked_input(Forwarded(7, swapped), np.zeros(20))
    # a forwarded bundle for another round is refused before decryption
    with pytest.raises(ProtocolError, match="round 7, not 8"):
        clients[0].masked_input(Forwarded(8, forwarded[0].ciphertexts), np.zeros(20))


def test_server_cannot_rebuild_from_fewer_than_t_or_corrupt_shares():
    _setup, clients, server, forwarded = _staged(5, SecAggConfig(protocol="secagg"))
    inputs = _inputs(5, d=20)
    masked = [clients[c].masked_input(forwarded[c], inputs[c]) for c in range(4)]
    requests = server.collect_masked(masked)  # client 4 dropped after sharing
    responses = [clients[c].unmask(requests[c]) for c in range(4)]
    # a corrupt key share of the dropped client 4: the rebuilt key does not match
    r = responses[0]
    share = r.key_shares[4]
    forged = shamir.Share(
        share.x, ((share.values[0] + 1) % shamir.PRIME, *share.values[1:]), share.length
    )
    corrupt = type(r)(r.client, r.round, r.self_mask_shares, {4: forged})
    with pytest.raises(ProtocolError, match="does not match the public key"):
        server.finish([corrupt, *responses[1:]])
    result = server.finish(responses)
    assert result.dropouts == (4,)
    expected = sum(clients[c].quantized.astype(np.int64) for c in range(4))
    np.testing.assert_array_equal(result.total, expected)


# --- message sizes -------------------------------------------------------------------


def test_message_sizes_n10_d1000_b32():
    inputs = _inputs(10)
    sizes = {}
    for protocol in ("secagg+", "secagg"):
        outcome = run_round(
            inputs, SecAggConfig(protocol=protocol, bits=32), rng=np.random.default_rng(5)
        )
        k = outcome.server.setup.neighbours
        sizes[protocol] = {s: outcome.mean_bytes(s) for s in outcome.traffic}
        # one encrypted bundle: nonce 12 + two 54-byte shares + tag 16
        assert sizes[protocol]["share"][0] == 12 + 4 + k * (4 + 4 + 136)
        # id, round, d, b, then d values of b bits
        assert sizes[protocol]["mask"] == (4 + 8 + 4 + 1 + D * 32 // 8, 0.0)
        assert sizes[protocol]["advertise"][0] == 76
    assert sizes["secagg+"]["share"][0] < sizes["secagg"]["share"][0]


# --- the wire ------------------------------------------------------------------------


def _over_the_wire(sent: list) -> Callable[[Any], Any]:
    """Every message to its tagged bytes and back, each checked: ``nbytes()`` is the
    length of its bytes, and the copy writes the same bytes."""

    def carry(message: Any) -> Any:
        data = message.to_bytes()
        assert len(data) == message.nbytes(), type(message).__name__
        copy = wire.unpack(wire.pack(message))
        assert type(copy) is type(message) and copy.to_bytes() == data
        sent.append(type(message).__name__)
        return copy

    return carry


@pytest.mark.parametrize(
    ("protocol", "n", "bits", "dropouts"),
    [("secagg+", 12, 32, {3: 2, 7: 3}), ("secagg", 5, 20, {1: 2}), ("secagg+", 8, 61, {0: 1})],
)
def test_every_message_survives_its_bytes_and_the_sum_stays_exact(protocol, n, bits, dropouts):
    inputs, sent = _inputs(n, d=257), []
    outcome = run_round(
        inputs,
        SecAggConfig(protocol=protocol, bits=bits),
        round_=3,
        dropouts=dropouts,
        rng=np.random.default_rng(1),
        transport=_over_the_wire(sent),
    )
    _check_exact(outcome, inputs)
    assert set(sent) == {
        "RoundSetup",
        "KeyAdvert",
        "PeerKeys",
        "EncryptedShares",
        "Forwarded",
        "MaskedInput",
        "UnmaskRequest",
        "UnmaskResponse",
    } and set(sent) <= set(wire.MESSAGES)


@pytest.mark.parametrize("bits", [1, 3, 8, 13, 16, 31, 32, 33, 63, 64])
def test_b_bit_values_pack_into_d_times_b_bits(bits):
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 1 << min(bits, 63), size=1001, dtype=np.uint64)
    if bits == 64:
        values |= np.uint64(1 << 63)
    data = pack_bits(values, bits)
    assert len(data) == math.ceil(1001 * bits / 8)
    np.testing.assert_array_equal(unpack_bits(data, 1001, bits), values)


def test_malformed_bytes_are_refused():
    request = UnmaskRequest(2, (1, 4), (3,))
    data = wire.pack(request)
    assert wire.unpack(data) == request
    for bad in (data[:-1], data + b"\0", b"\x05Share" + data[11:], b""):
        with pytest.raises(WireError):
            wire.unpack(bad)
    with pytest.raises(TypeError, match="not a protocol message"):
        wire.pack(SecAggConfig())

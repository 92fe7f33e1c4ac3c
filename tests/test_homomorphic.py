"""Homomorphic aggregation (``secagg.protocol = "ckks" | "paillier"``,
:mod:`fedloom.homomorphic`): the schemes, the protocol's stages, a run.

What is checked: each scheme decrypts the sum of n inputs to the exact integer sum, up to
the bound b + ⌈log2 n⌉ it states, and refuses a layout or an input that could wrap; a
ciphertext is randomized; the messages' bytes round-trip and ``nbytes()`` is their
length; a client that sends no ciphertexts is left out of the sum, a key holder that
drops ends the round naming it, and the key holder refuses a sum of one client; a tiny
run under CKKS or Paillier writes the same metrics as under SecAgg+ (the same integer
sum); every bad ``[secagg]`` setting is refused by its key, exit 2, nothing written.
Paillier runs with 2048-bit keys here (3072, the default, is slower).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tenseal as ts
import torch
from conftest import needs_glue, run_tiny_cli, tiny_config

from fedloom.experiment import Experiment
from fedloom.homomorphic import (
    Ciphertexts,
    DecryptRequest,
    EncryptRequest,
    HomomorphicConfig,
    KeyHolder,
    Layout,
    PlainSum,
    PublicContext,
    encrypt_input,
    packing,
    scheme_for,
    setup_round,
)
from fedloom.homomorphic.ckks import MAX_SUM_BITS as CKKS_MAX_SUM_BITS
from fedloom.runtime import secure_round
from fedloom.runtime.rundir import RunDir
from fedloom.runtime.secure_round import SecureClient
from fedloom.secagg import ClientRefusal, wire
from fedloom.server import simulate
from fedloom.transforms.secure_sum import SecureSum

KEY_BITS = 2048


def _inputs(n: int, dim: int, bits: int, seed: int = 0) -> list[np.ndarray]:
    """n inputs below 2^bits, the first at the largest value on every coordinate."""
    rng = np.random.default_rng(seed)
    xs = [rng.integers(0, 1 << bits, dim, dtype=np.uint64) for _ in range(n)]
    xs[0][:] = (1 << bits) - 1
    return xs


def _exact_sum(xs: list[np.ndarray]) -> list[int]:
    return [sum(int(x[i]) for x in xs) for i in range(xs[0].shape[0])]


@pytest.mark.parametrize(
    ("protocol", "n", "dim", "bits"),
    [
        ("ckks", 2, 1, 32),
        ("ckks", 5, 2049, 32),  # two ciphertexts, the second of one value
        ("ckks", 7, 300, CKKS_MAX_SUM_BITS - 3),  # b + ⌈log2 n⌉ = 44, the bound
        ("paillier", 2, 1, 32),
        ("paillier", 3, 130, 32),  # 60 slots of 34 bits a plaintext: 3 plaintexts
        ("paillier", 7, 40, 60),  # b + ⌈log2 n⌉ = 63, the bound
    ],
)
def test_the_sum_decrypts_to_the_exact_integer_sum(
    protocol: str, n: int, dim: int, bits: int
) -> None:
    scheme = scheme_for(protocol, Layout(dim, bits, n), KEY_BITS)
    secret = scheme.keygen()
    public = scheme.public_key(secret.public)
    xs = _inputs(n, dim, bits, seed=n)
    encrypted = [public.encrypt(x) for x in xs]
    assert all(len(c) == scheme.ciphertexts() for c in encrypted)
    total = secret.decrypt(public.sum(encrypted))
    assert total.dtype == np.uint64
    assert [int(v) for v in total] == _exact_sum(xs)


@pytest.mark.parametrize("protocol", ["ckks", "paillier"])
def test_adding_ciphertexts_adds_the_plaintexts(protocol: str) -> None:
    scheme = scheme_for(protocol, Layout(70, 32, 4), KEY_BITS)
    secret = scheme.keygen()
    public = scheme.public_key(secret.public)
    a, b, c = _inputs(3, 70, 30, seed=5)
    ea, eb, ec = (public.encrypt(x) for x in (a, b, c))
    assert np.array_equal(secret.decrypt(public.sum([ea])), a)
    assert np.array_equal(secret.decrypt(public.sum([ea, eb])), a + b)
    # a sum of sums is the sum of all: the server may add in any grouping
    grouped = public.sum([public.sum([ea, eb]), ec])
    assert np.array_equal(secret.decrypt(grouped), a + b + c)


@pytest.mark.parametrize("protocol", ["ckks", "paillier"])
def test_a_ciphertext_is_randomized_and_the_public_key_cannot_decrypt(protocol: str) -> None:
    scheme = scheme_for(protocol, Layout(64, 32, 3), KEY_BITS)
    secret = scheme.keygen()
    public = scheme.public_key(secret.public)
    x = np.arange(64, dtype=np.uint64)
    first, second = public.encrypt(x), public.encrypt(x)
    assert all(a != b for a, b in zip(first, second))
    if protocol == "paillier":
        packed = packing.pack(x, scheme.layout.sum_bits, scheme.per_plaintext)[0]
        plain = packed.to_bytes((packed.bit_length() + 7) // 8, "big")
        assert plain not in first[0]
    else:
        context = ts.context_from(secret.public)
        assert context.is_public() and not context.has_secret_key()
        with pytest.raises(ValueError):
            ts.ckks_vector_from(context, first[0]).decrypt()


def test_a_sum_that_could_wrap_is_refused() -> None:
    # CKKS: 8 inputs of 42 bits sum to 45 bits, past the 44 it decrypts exactly
    with pytest.raises(ValueError, match=r"secagg\.bits.*45 bits.*44"):
        scheme_for("ckks", Layout(10, 42, 8), 0)
    # Paillier: a slot of 62 + 2 bits overflows the int64 sum
    with pytest.raises(ValueError, match=r"secagg\.bits.*64 bits"):
        scheme_for("paillier", Layout(10, 62, 4), KEY_BITS)
    with pytest.raises(ValueError, match=r"secagg\.key_bits"):
        scheme_for("paillier", Layout(10, 32, 4), 1024)
    scheme = scheme_for("paillier", Layout(4, 16, 2), KEY_BITS)
    public = scheme.public_key(scheme.keygen().public)
    with pytest.raises(ValueError, match="not below 2"):
        public.encrypt(np.array([0, 1, 1 << 16, 2], dtype=np.uint64))
    # a packed integer with bits beyond its slots did wrap
    with pytest.raises(ValueError, match="beyond its slots"):
        packing.unpack([1 << 34], 17, 2, 2)
    # CKKS: a decryption that is not integral is refused, never rounded silently
    ckks = scheme_for("ckks", Layout(3, 16, 2), 0)
    secret = ckks.keygen()
    halves = ts.ckks_vector(ckks.public_key(secret.public).context, [0.5, 1.0, 2.0])
    with pytest.raises(ValueError, match="does not decrypt to integers"):
        secret.decrypt([halves.serialize()])


def test_the_messages_round_trip_through_their_bytes() -> None:
    config = HomomorphicConfig("paillier", bits=24, clip_range=0.5, key_bits=KEY_BITS)
    setup = setup_round(config, [9, 4, 7], 5, 33)
    assert setup.key_holder == 9  # round 5 modulo 3 = 2: the third of (4, 7, 9)
    messages: list[Any] = [
        setup,
        PublicContext(9, 5, b"\x01" * 256),
        EncryptRequest(setup, b"\x02" * 256),
        Ciphertexts(4, 5, (b"abc", b"", b"\x00" * 512)),
        DecryptRequest(5, (4, 9), (b"\x03" * 512,)),
    ]
    for m in messages:
        data = m.to_bytes()
        assert m.nbytes() == len(data)
        assert type(m).from_bytes(data) == m
        assert wire.unpack(wire.pack(m)) == m  # the tagged bytes a transport carries
    total = np.array([0, 1, (1 << 26) - 1], dtype=np.uint64)
    plain = PlainSum(7, 5, total, 26)
    back = PlainSum.from_bytes(plain.to_bytes())
    assert plain.nbytes() == len(plain.to_bytes())
    assert np.array_equal(back.total, total) and back.bits == 26


class _Host:
    """Client hosts reduced to the protocol, each client taking its step as every
    runtime's clients do (:class:`SecureClient`, holding an update); ``silent`` maps a
    client to the stage from which it stops answering."""

    def __init__(self, sides: dict[int, SecureClient]) -> None:
        self.sides = sides

    def exchange(self, round_: int, stage: str, messages: dict) -> dict:
        answers = {cid: self.sides[cid].answer(stage, m) for cid, m in messages.items()}
        return {cid: a for cid, a in answers.items() if a is not None}


def _round(protocol: str, silent: dict[int, str]) -> tuple[secure_round.SecureRound, dict]:
    """The protocol among 5 clients of weight 10 (client 0's update at the clip range on
    every coordinate); the round and each client's input x_k."""
    key_bits = KEY_BITS if protocol == "paillier" else None
    secure = SecureSum(HomomorphicConfig(protocol, key_bits=key_bits))
    weights = dict.fromkeys(range(5), 10)
    start = {"w": torch.zeros(38)}  # 38 values, the weight and the clipped count: 40
    rng = np.random.default_rng(3)
    c = secure.config.clip_range
    updates = {k: {"w": torch.from_numpy(rng.uniform(-c, c, 38))} for k in range(5)}
    updates[0]["w"][:] = c
    setup = secure.setup(weights, 2, SecureSum.dim(start))
    sides = {
        k: SecureClient(secure, k, (updates[k], start, 10),
                        secure.stages.index(silent[k]) if k in silent else None)
        for k in range(5)
    }
    inputs = {k: secure.encode(updates[k], start, 10, k, setup) for k in range(5)}
    return secure_round._homomorphic(_Host(sides), setup), inputs


@pytest.mark.parametrize("protocol", ["ckks", "paillier"])
def test_a_client_that_sends_no_ciphertexts_is_left_out_of_the_sum(protocol: str) -> None:
    done, inputs = _round(protocol, {3: "encrypt"})  # round 2: client 2 holds the key
    assert done.result is not None
    assert done.result.survivors == (0, 1, 2, 4) and done.result.dropouts == (3,)
    expected = _exact_sum([inputs[c] for c in (0, 1, 2, 4)])
    assert [int(v) for v in done.result.total] == expected
    assert list(done.missing) == [3] and "not in the sum" in done.missing[3]
    row = done.row()
    assert row["secagg_dropouts"] == 1
    assert row["secagg"]["key_holder"] == 2 and row["secagg"]["summed"] == 4
    # what the key holder sent beyond its ciphertexts: the public key and the sum
    assert done.bytes_up[2] > done.bytes_up[0] > 0 and 3 not in done.bytes_up


@pytest.mark.parametrize("stage", ["keys", "decrypt"])
def test_a_key_holder_that_drops_ends_the_round_naming_it(stage: str) -> None:
    done, _ = _round("ckks", {2: stage})
    assert done.result is None
    assert sorted(done.missing) == [0, 1, 2, 3, 4]
    assert all(
        f'the key holder, client 2, did not answer at "{stage}"' in why
        for why in done.missing.values()
    )


def test_the_key_holder_refuses_to_decrypt_one_clients_input() -> None:
    config = HomomorphicConfig("paillier", key_bits=KEY_BITS)
    setup = setup_round(config, [0, 1, 2], 0, 8)
    holder = KeyHolder(0, setup)
    request = EncryptRequest(setup, holder.public_context().key)
    alone = encrypt_input(1, request, np.arange(8, dtype=np.uint64))
    with pytest.raises(ClientRefusal, match="refuses to decrypt a sum of 1 client"):
        holder.decrypt(DecryptRequest(0, (1,), alone.blobs))


# --- a run ----------------------------------------------------------------------------

#: a tiny run with a small adapter (LoRA r = 1 on query and value: 386 values), so that
#: Paillier's encryption stays cheap
_SMALL = ("model.lora.r=1", 'model.lora.target_modules=["query", "value"]')


def _run(tmp: Path, protocol: str, *overrides: str) -> list[dict]:
    extra = ["secagg.key_bits=2048"] if protocol == "paillier" else []
    cfg = tiny_config(
        "partition.num_clients=6",
        "partition.scheme=dirichlet",
        "partition.alpha=0.5",
        "federation.rounds=2",
        f"secagg.protocol={protocol}",
        *_SMALL,
        *extra,
        *overrides,
        output_dir=tmp,
    )
    run = RunDir.create(tmp / protocol, "tiny")
    simulate(Experiment.build(cfg), run)
    return [json.loads(x) for x in run.metrics_path.read_text().splitlines()]


def _without_protocol_counts(rows: list[dict]) -> list[dict]:
    """The rows less what differs between protocols: their bytes, their own entries and
    their words for why a client is missing."""
    out = []
    for r in rows:
        r = dict(r)
        if r.get("scope") == "train":
            for key in ("secagg", "bytes_up", "bytes_down"):
                r.pop(key)
            r["missing"] = sorted(r["missing"])
        out.append(r)
    return out


@pytest.fixture(scope="module")
def secagg_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run(tmp_path_factory.mktemp("secagg"), "secagg+")


@needs_glue
@pytest.mark.parametrize("protocol", ["ckks", "paillier"])
def test_a_run_writes_the_same_metrics_as_under_secagg_plus(
    protocol: str, secagg_rows: list[dict], tmp_path: Path
) -> None:
    rows = _run(tmp_path, protocol)
    assert _without_protocol_counts(rows) == _without_protocol_counts(secagg_rows)
    train = [r for r in rows if r.get("scope") == "train"]
    assert [r["secagg"]["protocol"] for r in train] == [protocol, protocol]
    assert [r["secagg"]["summed"] for r in train] == [6, 6]
    plain = [r for r in secagg_rows if r.get("scope") == "train"]
    # the bytes of the update travel inside the protocol, encrypted: more of them
    assert all(r["bytes_up"] > p["bytes_up"] for r, p in zip(train, plain))


@needs_glue
def test_a_run_with_drop_outs_leaves_them_out_of_the_sum(tmp_path: Path) -> None:
    dropout = ("faults.dropout=0.3",)
    plain = _run(tmp_path, "secagg+", *dropout)
    rows = _run(tmp_path, "ckks", *dropout)
    train = [r for r in rows if r.get("scope") == "train"]
    dropped = [sorted(r["missing"]) for r in train]
    assert any(dropped) and all(r["secagg"]["key_holder"] not in d for r, d in zip(train, dropped))
    assert [r["secagg_dropouts"] for r in train] == [len(d) for d in dropped]
    assert all("not in the sum" in why for r in train for why in r["missing"].values())
    # SecAgg+ recovers the same clients' masks and sums the others: the same sum
    assert _without_protocol_counts(rows) == _without_protocol_counts(plain)


# --- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["secagg.protocol=paillier", "secagg.key_bits=1024"], "secagg.key_bits"),
        (["secagg.protocol=ckks", "secagg.key_bits=3072"], "secagg.key_bits: Paillier's"),
        (["secagg.protocol=secagg+", "secagg.key_bits=3072"], "secagg.key_bits: Paillier's"),
        (["secagg.protocol=ckks", "secagg.neighbours=4"], "secagg.neighbours: SecAgg's"),
        (["secagg.protocol=paillier", "secagg.threshold=3"], "secagg.threshold: SecAgg's"),
        (["secagg.protocol=ckks", "secagg.bits=42"], "secagg.bits: 6 inputs of b = 42"),
        (["secagg.protocol=ckks", "secagg.bits=8", "secagg.quant_bits=6"], "secagg.bits"),
        (["secagg.protocol=paillier", "aggregation.rule=median"], "aggregation.rule: median"),
        (["secagg.protocol=ckks", "faults.garbage={1 = 'nan'}"], "faults.garbage"),
    ],
)
def test_a_bad_setting_is_refused_by_its_key(
    overrides: list[str], fragment: str, tmp_path: Path
) -> None:
    result = run_tiny_cli(tmp_path, *overrides)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_the_schemes_libraries_load_only_for_a_homomorphic_run() -> None:
    """Building an experiment imports neither TenSEAL nor phe: a federation without
    ``[secagg] protocol = "ckks" | "paillier"`` runs on a machine without them."""
    code = (
        "import sys; import fedloom.experiment, fedloom.homomorphic; "
        "print(sorted(m for m in ('tenseal', 'phe') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

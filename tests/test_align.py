"""PQ-LoRA factor alignment across backbones (fedloom.models.align): known maps recovered
on synthetic data, token matching, target layers, activation capture, the whole pair on
tiny models, and the safetensors cache."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from fedloom.models import align
from fedloom.models.backbones import load_backbone
from fedloom.models.catalog import resolve_backbone
from fedloom.models.pqlora import orthonormal


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _projector(columns: torch.Tensor) -> torch.Tensor:
    q, _ = torch.linalg.qr(columns.double())
    return q @ q.T


def _correlated(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Rows with an anisotropic covariance and a nonzero mean, like real activations."""
    return torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g) + 3.0


def test_char_alignment_pairs_tokens_ending_at_the_same_character() -> None:
    # "it's unbelievable ." — BERT-style (specials (0, 0), spaces not owned) vs byte-level
    # BPE (spaces owned by the next token, "unbelievable" split differently, a byte-split
    # character: two tokens ending at 18).
    bert = [(0, 0), (0, 2), (2, 3), (3, 4), (5, 7), (7, 17), (18, 19), (0, 0)]
    bpe = [(0, 2), (2, 4), (4, 9), (9, 17), (17, 18), (17, 18), (18, 19)]
    assert align.char_alignment(bert, bpe) == [(1, 0), (3, 1), (5, 3), (6, 6)]
    assert align.char_alignment(bpe, bert) == [(0, 1), (1, 3), (3, 5), (6, 6)]
    assert align.char_alignment(bert, []) == []


def test_paired_stacks_matched_rows() -> None:
    rows_a = [torch.arange(4.0).unsqueeze(1), torch.arange(10.0, 12.0).unsqueeze(1)]
    rows_b = [torch.arange(3.0).unsqueeze(1) * -1, torch.zeros(1, 1)]
    a, b = align.paired(rows_a, rows_b, [[(1, 0), (3, 2)], []])
    assert a.flatten().tolist() == [1.0, 3.0]
    assert b.flatten().tolist() == [0.0, -2.0]


def test_fit_projection_recovers_a_known_orthonormal_map() -> None:
    g = _gen(1)
    x = _correlated(2000, 48, g)
    a_star = orthonormal(6, 48, g)
    z = x @ a_star.T + 0.01 * torch.randn(2000, 6, generator=g)
    a = align.fit_projection(x, z)
    assert torch.allclose(a @ a.T, torch.eye(6), atol=1e-5)
    assert torch.linalg.norm(a - a_star) / torch.linalg.norm(a_star) < 0.01


def test_fit_projection_improves_on_the_projected_least_squares_fit() -> None:
    # The least-squares optimum is 2 A*, not orthonormal; its projection A* is the start
    # (steps=0), and with anisotropic x Adam on orthonormal rows finds a closer fit.
    g = _gen(2)
    x = _correlated(1000, 32, g)
    a_star = orthonormal(4, 32, g)
    z = 2 * x @ a_star.T
    start = align.fit_projection(x, z, steps=0)
    assert torch.linalg.norm(start - a_star) < 1e-4
    a = align.fit_projection(x, z)
    assert torch.allclose(a @ a.T, torch.eye(4), atol=1e-5)
    assert (x @ a.T - z).square().sum() < 0.9 * (x @ a_star.T - z).square().sum()


def test_polar_is_the_nearest_orthonormal_matrix() -> None:
    g = _gen(3)
    m = torch.randn(3, 8, generator=g)
    p = align.polar(m)
    assert torch.allclose(p @ p.T, torch.eye(3), atol=1e-5)
    assert torch.allclose(_projector(p.T), _projector(m.T), atol=1e-6)  # same row space
    for _ in range(20):
        other = orthonormal(3, 8, g)
        assert torch.linalg.norm(p - m) <= torch.linalg.norm(other - m)


@pytest.mark.parametrize("method", ["lstsq", "cca"])
def test_output_map_recovers_a_known_linear_map(method: align.Method) -> None:
    # y_big = y_anchor M* (d_big > d_anchor): both methods give G = M*ᵀ, so B_big spans
    # the column space of M*ᵀ B_anchor, with orthonormal columns.
    g = _gen(4)
    y_anchor = _correlated(3000, 10, g)
    m_star = torch.randn(10, 16, generator=g)
    y_big = y_anchor @ m_star
    b_anchor = orthonormal(10, 3, g)
    g_map = align.output_map(y_anchor, y_big, ridge=1e-9, method=method)
    assert torch.linalg.norm(g_map - m_star.T.double()) / torch.linalg.norm(m_star) < 1e-3
    b_big = align.fit_output_map(y_anchor, y_big, b_anchor, ridge=1e-9, method=method)
    assert b_big.shape == (16, 3)
    assert torch.allclose(b_big.T @ b_big, torch.eye(3), atol=1e-5)
    assert torch.allclose(_projector(b_big), _projector(m_star.T @ b_anchor), atol=1e-4)


def test_regularized_cca_finds_the_correlation_one_directions() -> None:
    # y_big's first 5 dims are a mix of y_anchor's first 3; its last 3 are independent
    # noise: three canonical correlations are 1, the rest about 0.
    g = _gen(5)
    n = 4000
    y_anchor = _correlated(n, 6, g)
    mixed = y_anchor[:, :3] @ torch.randn(3, 5, generator=g)
    y_big = torch.cat([mixed, torch.randn(n, 3, generator=g)], 1)
    cca = align.regularized_cca(y_anchor, y_big, ridge=1e-9)
    assert cca.dirs_a.shape == (6, 6) and cca.dirs_b.shape == (8, 6)
    assert torch.all(cca.correlations[:3] > 0.999)
    assert torch.all(cca.correlations[3:] < 0.1)
    u = (y_anchor - y_anchor.mean(0)).double() @ cca.dirs_a[:, :3]
    v = (y_big - y_big.mean(0)).double() @ cca.dirs_b[:, :3]
    assert torch.linalg.norm(u - v) / torch.linalg.norm(u) < 1e-3
    assert torch.allclose(u.T @ u / n, torch.eye(3, dtype=u.dtype), atol=1e-3)


def test_output_map_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match="method"):
        align.output_map(torch.ones(4, 2), torch.ones(4, 2), method="pca")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[tuple, tuple]:
    anchor = load_backbone(resolve_backbone("tiny-bert"), seed=0)
    return anchor, load_backbone(resolve_backbone("tiny-llama"), seed=1)


TEXTS = [
    "a gripping , funny film .",
    "the plot is thin",
    "it 's not worth the price of admission , and the acting is wooden .",
    "charming",
    "one of the year 's best",
    "dull , dull , dull .",
]


def test_collect_captures_every_token_whatever_the_batching(tiny_pair: tuple[tuple, tuple]) -> None:
    _, (model, tokenizer) = tiny_pair
    name = "model.layers.1.mlp.down_proj"
    one = align.collect(model, tokenizer, TEXTS, [name], batch_size=1)[name]
    many = align.collect(model, tokenizer, TEXTS, [name], batch_size=4)[name]
    linear = model.get_submodule(name)
    for t, text in enumerate(TEXTS):
        num_tokens = len(tokenizer(text)["input_ids"])
        assert one.inputs[t].shape == (num_tokens, linear.in_features)
        assert len(one.offsets[t]) == num_tokens
        assert torch.allclose(one.outputs[t], one.inputs[t] @ linear.weight.T, atol=1e-5)
        # right padding is invisible to a causal model's real tokens
        assert torch.allclose(many.inputs[t], one.inputs[t], atol=1e-5)
    with pytest.raises(ValueError, match="lm_head"):
        align.collect(model, tokenizer, TEXTS, ["lm_head"])


def test_align_pair_on_tiny_models(tiny_pair: tuple[tuple, tuple]) -> None:
    anchor, big = tiny_pair
    params = align.align_pair(anchor, big, TEXTS * 4, rank=4, num_blocks=2, seed=0, steps=50)
    roles_big = set(align.ROLES["llama"])
    assert {k for k in params if k.startswith("big.")} == {
        f"big.block{k}.{role}.{f}" for k in range(2) for role in roles_big for f in "AB"
    }
    assert len([k for k in params if k.startswith("anchor.")]) == 2 * 6 * 2
    targets = align.pq_targets(big[0], 2)
    assert targets["block1.mlp_gate"] == "model.layers.1.mlp.gate_proj"
    for slot, module in targets.items():
        linear = big[0].get_submodule(module)
        a, b = params[f"big.{slot}.A"], params[f"big.{slot}.B"]
        assert a.shape == (4, linear.in_features) and b.shape == (linear.out_features, 4)
        assert torch.allclose(a @ a.T, torch.eye(4), atol=1e-5)
        assert torch.allclose(b.T @ b, torch.eye(4), atol=1e-5)
    # the fitted A matches the anchor's rank space better than a random orthonormal one
    acts = align.collect_pair(anchor, big, TEXTS * 4, num_blocks=2)
    for m in acts.matches:
        x_a, x_b = acts.rows(m, "inputs")
        z = x_a @ params[f"anchor.{m.anchor_slot}.A"].T
        fitted = (x_b @ params[f"big.{m.big_slot}.A"].T - z).square().sum()
        random = (x_b @ orthonormal(4, x_b.shape[1], _gen(9)).T - z).square().sum()
        assert fitted < random, m.big_slot
    again = align.align_pair(anchor, big, TEXTS * 4, rank=4, num_blocks=2, seed=0, steps=50)
    assert all(torch.equal(again[k], v) for k, v in params.items())


def test_anchor_adapters_depend_on_the_seed_only(tiny_pair: tuple[tuple, tuple]) -> None:
    (model, _), _ = tiny_pair
    first, second = (align.anchor_adapters(model, 4, 2, seed=7) for _ in range(2))
    other = align.anchor_adapters(model, 4, 2, seed=8)
    key = "anchor.block0.query.A"
    assert torch.equal(first[key], second[key]) and not torch.equal(first[key], other[key])
    b = first["anchor.block1.mlp_down.B"]
    assert b.shape == (32, 4) and torch.allclose(b.T @ b, torch.eye(4), atol=1e-5)


def _meta(**changes: object) -> dict[str, str]:
    base: dict = {"anchor_name": "minilm", "big_name": "smollm2-135m", "texts": TEXTS, "rank": 8,
                  "num_blocks": 4, "seed": 0, "method": "cca"}
    return align.alignment_meta(**(base | changes))


def test_cache_round_trip_and_invalidation(tmp_path) -> None:
    path = tmp_path / "sub" / "align.safetensors"
    calls: list[int] = []

    def compute() -> dict[str, torch.Tensor]:
        calls.append(1)
        return {"big.block0.query.A": torch.randn(2, 5, generator=_gen(len(calls)))}

    first = align.cached(path, _meta(), compute)
    again = align.cached(path, _meta(), compute)
    assert len(calls) == 1 and torch.equal(first["big.block0.query.A"], again["big.block0.query.A"])
    changes = [{"seed": 1}, {"texts": TEXTS[:-1]}, {"texts": [*TEXTS[:-1], "x"]}]
    for change in [*changes, {"method": "lstsq"}]:
        assert align.load_alignment(path, _meta(**change)) is None
    recomputed = align.cached(path, _meta(seed=1), compute)
    key = "big.block0.query.A"
    assert len(calls) == 2 and not torch.equal(recomputed[key], first[key])
    assert align.load_alignment(path, _meta(seed=1)) is not None
    assert align.load_alignment(path, _meta()) is None
    assert align.load_alignment(tmp_path / "absent.safetensors", _meta()) is None


@pytest.mark.parametrize("content", ["garbage", "truncated", "foreign"])
def test_unreadable_cache_raises_naming_the_file(tmp_path, content: str) -> None:
    path = tmp_path / "align.safetensors"
    if content == "garbage":
        path.write_bytes(b"not a safetensors file at all")
    elif content == "truncated":
        align.save_alignment(path, {"x": torch.ones(100)}, _meta())
        path.write_bytes(path.read_bytes()[:-40])
    else:  # a valid safetensors file that is not an alignment cache
        save_file({"x": torch.ones(3)}, str(path))
    with pytest.raises(align.AlignmentCacheError, match=str(path)):
        align.load_alignment(path, _meta())

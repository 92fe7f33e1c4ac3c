"""RELA's math (fedloom.algorithms.relevance): similarity, weights, the personalized
aggregate, compression and sanitization, checked on hand-computed cases and statistically."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedloom.algorithms import relevance as rel


def _vectors(n: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=generator) for _ in range(n)]


# --- relevance ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["columns", "flat"])
def test_similarity_is_symmetric_with_unit_diagonal_and_follows_client_order(mode: str) -> None:
    vectors = _vectors(4)
    similarity = rel.relevance(vectors, mode)
    assert torch.equal(similarity, similarity.T)
    assert torch.allclose(similarity.diagonal(), torch.ones(4, dtype=similarity.dtype))
    perm = [2, 0, 3, 1]
    permuted = rel.relevance([vectors[p] for p in perm], mode)
    assert torch.allclose(permuted, similarity[perm][:, perm], atol=1e-12)


def test_columns_similarity_matches_hand_computed_case() -> None:
    vectors = [
        torch.tensor([[1.0, 0.0], [0.0, 1.0]]),  # columns (1, 0), (0, 1)
        torch.tensor([[1.0, 1.0], [0.0, 1.0]]),  # columns (1, 0), (1, 1)
        torch.tensor([[1.0, 0.0], [1.0, 0.0]]),  # columns (1, 1), (0, 0): a zero column
    ]
    r = 1 / math.sqrt(2)
    expected = torch.tensor([
        [1.0, (1 + r) / 2, r / 2],
        [(1 + r) / 2, 1.0, r / 2],
        [r / 2, r / 2, 0.5],
    ], dtype=torch.float64)
    assert torch.allclose(rel.relevance(vectors, "columns"), expected, atol=1e-12)


def test_flat_similarity_is_the_cosine_of_the_flattened_vectors() -> None:
    vectors = _vectors(3, seed=1)
    similarity = rel.relevance(vectors, "flat")
    for i in range(3):
        for j in range(3):
            a, b = vectors[i].flatten().double(), vectors[j].flatten().double()
            cosine = F.cosine_similarity(a, b, dim=0)
            assert similarity[i, j].item() == pytest.approx(cosine.item(), abs=1e-12)


def test_relevance_refuses_mixed_shapes() -> None:
    with pytest.raises(ValueError, match="different shapes"):
        rel.relevance([torch.ones(2, 2), torch.ones(2, 3)])


# --- weights -----------------------------------------------------------------------------
def test_mixing_weights_exclude_self_and_sum_to_one() -> None:
    row = torch.tensor([0.9, 0.2, 0.5, -0.1])
    weights = rel.mixing_weights(row, self_index=0, temperature=0.5)
    assert weights[0] == 0
    assert weights.sum().item() == pytest.approx(1.0, abs=1e-12)
    logits = row[1:].double() / 0.5
    assert torch.allclose(weights[1:], torch.softmax(logits, dim=0))


def test_mixing_weights_temperature_limits_and_eligibility() -> None:
    row = torch.tensor([1.0, 0.2, 0.7, 0.6])
    cold = rel.mixing_weights(row, self_index=0, temperature=1e-4)
    assert torch.allclose(cold, torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64))
    hot = rel.mixing_weights(row, self_index=0, temperature=1e6)
    uniform = torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3], dtype=torch.float64)
    assert torch.allclose(hot, uniform, atol=1e-6)
    eligible = torch.tensor([True, True, False, True])
    masked = rel.mixing_weights(row, self_index=0, temperature=1e-4, eligible=eligible)
    assert torch.allclose(masked, torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64))


def test_mixing_weights_refuse_when_nobody_is_eligible() -> None:
    with pytest.raises(ValueError, match="no eligible"):
        rel.mixing_weights(torch.tensor([1.0, 0.5]), 0, 1.0, eligible=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="no eligible"):
        rel.mixing_weights(torch.tensor([1.0]), 0, 1.0)


def test_relevance_weights_known_follow_the_softmax_unknown_are_uniform() -> None:
    similarity = rel.relevance(_vectors(5, seed=2))
    clients = [10, 11, 12, 13, 14]
    known = {10: True, 11: True, 12: True, 13: False}  # 14 is missing: never seen
    weights = rel.relevance_weights(similarity, clients, 0.3, known)
    eligible = torch.tensor([True, True, True, False, False])
    for index in range(3):
        expected = rel.mixing_weights(similarity[index], index, 0.3, eligible)
        others = [j for j in range(3) if j != index]
        expected_row = {clients[j]: expected[j].item() for j in others}
        assert weights[clients[index]] == pytest.approx(expected_row)
    for unknown in (13, 14):
        assert weights[unknown] == pytest.approx({10: 1 / 3, 11: 1 / 3, 12: 1 / 3})


def test_relevance_weights_with_no_known_others_are_empty() -> None:
    weights = rel.relevance_weights(torch.eye(2), [1, 2], 1.0, {1: True})
    assert weights == {1: {}, 2: {1: 1.0}}


# --- the personalized aggregate ----------------------------------------------------------
def test_aggregate_never_includes_the_targets_own_params() -> None:
    shapes = {"a": torch.Size([2])}
    others = {1: {"a": torch.tensor([1.0, 2.0])}, 2: {"a": torch.tensor([3.0, 6.0])}}
    weights = {0: 0.0, 1: 0.25, 2: 0.75}
    small = rel.personalized_aggregates({0: {"a": torch.zeros(2)}, **others}, {0: weights},
                                        shapes)[0]
    params = {0: {"a": torch.full((2,), 1e30)}, **others}
    huge = rel.personalized_aggregates(params, {0: weights}, shapes)[0]
    assert torch.equal(small["a"], huge["a"])
    assert torch.allclose(small["a"], torch.tensor([2.5, 5.0]))
    # a zero weight times inf would be nan: a non-finite tensor is refused, never mixed in
    params = {0: {"a": torch.full((2,), math.inf)}, **others}
    with pytest.raises(ValueError, match="non-finite"):
        rel.personalized_aggregates(params, {0: weights}, shapes)


def test_aggregate_refuses_weight_on_the_target() -> None:
    params = {0: {"a": torch.zeros(1)}, 1: {"a": torch.ones(1)}}
    with pytest.raises(ValueError, match="target client 0"):
        rel.personalized_aggregates(params, {0: {0: 0.1, 1: 0.9}}, {"a": torch.Size([1])})


def test_aggregate_is_the_hand_computed_weighted_mean() -> None:
    params = {
        1: {"a": torch.tensor([[1.0, 0.0]]), "b": torch.tensor([2.0])},
        2: {"a": torch.tensor([[5.0, 4.0]]), "b": torch.tensor([-2.0])},
    }
    shapes = {"a": torch.Size([1, 2]), "b": torch.Size([1])}
    out = rel.personalized_aggregates(params, {0: {1: 1.0, 2: 3.0}}, shapes)[0]
    assert torch.allclose(out["a"], torch.tensor([[4.0, 3.0]]))
    assert torch.allclose(out["b"], torch.tensor([-1.0]))


def test_aggregate_renormalizes_over_clients_with_the_right_shape() -> None:
    params = {
        0: {"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)},
        1: {"a": torch.full((2,), 1.0), "b": torch.full((3,), 7.0)},
        2: {"a": torch.full((2,), 2.0), "b": torch.full((4,), 100.0)},  # b: another shape
        3: {"a": torch.full((2,), 4.0)},  # b: missing
    }
    shapes = {"a": torch.Size([2]), "b": torch.Size([3]), "c": torch.Size([1])}
    out = rel.personalized_aggregates(params, {0: {1: 0.2, 2: 0.3, 3: 0.5}}, shapes)[0]
    assert set(out) == {"a", "b"}  # nobody else has c
    assert torch.allclose(out["a"], torch.full((2,), 0.2 * 1 + 0.3 * 2 + 0.5 * 4))
    assert torch.allclose(out["b"], torch.full((3,), 7.0))


def test_aggregate_gives_the_weight_of_clients_lacking_a_tensor_to_its_absent_value() -> None:
    """Weights 1 : 1.5 : 2.5 scale to 0.2, 0.3, 0.5. b: only client 1 has it (2 has another
    shape, 3 none), so 0.2 · 7 + 0.8 · (-1); a: everybody, the plain weighted mean."""
    params = {
        1: {"a": torch.full((2,), 1.0), "b": torch.full((3,), 7.0)},
        2: {"a": torch.full((2,), 2.0), "b": torch.full((4,), 100.0)},
        3: {"a": torch.full((2,), 4.0)},
    }
    shapes = {"a": torch.Size([2]), "b": torch.Size([3])}
    absent = {"a": torch.full((2,), 50.0), "b": torch.full((3,), -1.0)}
    out = rel.personalized_aggregates(params, {0: {1: 1.0, 2: 1.5, 3: 2.5}}, shapes, absent)[0]
    assert torch.allclose(out["a"], torch.full((2,), 0.2 * 1 + 0.3 * 2 + 0.5 * 4))
    assert torch.allclose(out["b"], torch.full((3,), 0.2 * 7 - 0.8))


@pytest.mark.parametrize("absent", [False, True])
def test_all_targets_at_once_equal_each_target_alone(absent: bool) -> None:
    """Six clients, a tensor one of them holds in another shape and one that two lack:
    the product for every target equals each target's aggregate computed alone, and the
    hand-written sum Σ_j w_ij θ_j / Σ_j w_ij."""
    g = torch.Generator().manual_seed(5)
    params = {j: {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
              for j in range(6)}
    params[2]["b"] = torch.randn(6, generator=g)  # another shape: never takes part in b
    del params[4]["a"], params[5]["a"]
    shapes = {"a": torch.Size([3, 4]), "b": torch.Size([5])}
    weights = {i: {j: float(torch.rand(1, generator=g)) + 0.05 for j in range(6) if j != i}
               for i in range(6)}
    weights[1][3] = 0.0  # a zero weight: no part in 1's aggregate
    init = {"a": torch.full((3, 4), 0.5), "b": torch.full((5,), -0.5)} if absent else None
    together = rel.personalized_aggregates(params, weights, shapes, init)
    for i in range(6):
        alone = rel.personalized_aggregates(params, {i: weights[i]}, shapes, init)[i]
        assert together[i].keys() == alone.keys()
        for name, value in alone.items():
            torch.testing.assert_close(together[i][name], value)
            has = [j for j, w in weights[i].items() if w > 0 and name in params[j]
                   and params[j][name].shape == shapes[name]]
            total = sum(weights[i].values()) if absent else sum(weights[i][j] for j in has)
            expected = sum(weights[i][j] / total * params[j][name].double() for j in has)
            if absent:
                expected = expected + (1 - sum(weights[i][j] for j in has) / total) * init[name]
            torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-6)


# --- compression -------------------------------------------------------------------------
def test_project_is_deterministic_per_seed_and_shape() -> None:
    grad = torch.randn(12, 10, generator=torch.Generator().manual_seed(3))
    first = rel.project(grad, 4, 3, seed=7)
    rel._projections.cache_clear()  # regenerated from the seed, not remembered
    assert first.shape == (4, 3)
    assert torch.equal(first, rel.project(grad, 4, 3, seed=7))
    assert not torch.allclose(first, rel.project(grad, 4, 3, seed=8))


def test_project_preserves_inner_products_in_expectation() -> None:
    generator = torch.Generator().manual_seed(4)
    a = torch.randn(12, 10, generator=generator)
    b = a + torch.randn(12, 10, generator=generator)
    exact = float((a * b).sum())
    samples = torch.tensor([
        float((rel.project(a, 4, 3, seed) * rel.project(b, 4, 3, seed)).sum())
        for seed in range(400)
    ], dtype=torch.float64)
    standard_error = samples.std().item() / math.sqrt(len(samples))
    assert abs(samples.mean().item() - exact) < 4 * standard_error
    assert standard_error < 0.1 * abs(exact)  # the test can tell a wrong scale apart


def test_keep_rows_keeps_the_first_ceil_fraction_of_rows() -> None:
    grad = torch.arange(30.0).reshape(10, 3)
    assert torch.equal(rel.keep_rows(grad, 0.4), grad[:4])
    assert torch.equal(rel.keep_rows(grad, 0.7), grad[:7])
    assert torch.equal(rel.keep_rows(grad, 0.35), grad[:4])
    with pytest.raises(ValueError):
        rel.keep_rows(grad, 0.0)


# --- sanitization ------------------------------------------------------------------------
def test_sanitize_without_noise_has_unit_norm() -> None:
    vector = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    out = rel.sanitize(vector, 0.0, torch.Generator().manual_seed(0))
    assert torch.linalg.vector_norm(out).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(out, vector / 5)


def test_sanitize_noise_has_the_stated_std() -> None:
    n, sigma = 20_000, 0.5
    vector = torch.randn(n, generator=torch.Generator().manual_seed(1))
    out = rel.sanitize(vector, sigma, torch.Generator().manual_seed(2))
    noise = (out - vector / torch.linalg.vector_norm(vector)).double()
    tolerance = 4 * sigma / math.sqrt(2 * (n - 1))  # standard error of a sample std
    assert abs(noise.std().item() - sigma) < tolerance
    assert abs(noise.mean().item()) < 4 * sigma / math.sqrt(n)


def test_sanitize_keeps_a_zero_vector_zero_before_the_noise() -> None:
    out = rel.sanitize(torch.zeros(3, 2), 0.3, torch.Generator().manual_seed(5))
    expected = 0.3 * torch.randn(3, 2, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(out, expected)
    assert torch.equal(rel.sanitize(torch.zeros(4), 0.0, torch.Generator()), torch.zeros(4))


def test_ema() -> None:
    current = torch.tensor([2.0, 4.0])
    assert rel.ema(None, current) is current
    assert torch.allclose(rel.ema(torch.tensor([0.0, 8.0]), current), torch.tensor([1.0, 6.0]))
    quarter = rel.ema(torch.tensor([0.0, 8.0]), current, decay=0.25)
    assert torch.allclose(quarter, torch.tensor([1.5, 5.0]))


# --- diagnostics ---------------------------------------------------------------------------
def test_own_group_share_hand_computed() -> None:
    weights = {0: {1: 0.8, 2: 0.2}, 1: {0: 0.5, 2: 0.5}, 2: {0: 0.1, 1: 0.3, 3: 0.6}, 3: {}}
    groups = {0: 0, 1: 0, 2: 1, 3: 1}
    share = rel.own_group_share(weights, groups)
    assert share["own_share"] == pytest.approx((0.8 + 0.5 + 0.6) / 3)
    assert share["uniform_share"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 3) / 3)


def test_within_minus_cross_hand_computed() -> None:
    similarity = torch.tensor([[1.0, 0.9, 0.1], [0.9, 1.0, 0.3], [0.1, 0.3, 1.0]])
    clients = [5, 6, 7]
    difference = rel.within_minus_cross(similarity, clients, {5: 0, 6: 0, 7: 1})
    assert difference == pytest.approx(0.9 - 0.2)
    assert rel.within_minus_cross(similarity, clients, {5: 0, 6: 0, 7: 0}) is None
    assert rel.within_minus_cross(similarity, clients, {5: 0, 6: 1, 7: 2}) is None

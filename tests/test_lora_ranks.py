"""Per-client LoRA ranks ([[model.ranks]]): the config's checks, one model at the largest
rank with every client's scaling alpha / r, zero components that stay zero through local
training, and the mixed-rank methods by their defining properties: HetLoRA's truncation,
norm-weighted zero-padded average and rank self-pruning, FlexLoRA's redistribution as
the best rank-r approximation (Eckart–Young, against a direct SVD), FLoRA's fresh A cut
to each rank."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import needs_glue, tiny_raw

from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult
from fedloom.algorithms.lora_factors import A_SUFFIX, B_SUFFIX, factor_modules, truncated
from fedloom.config import ConfigError, validate
from fedloom.experiment import Experiment
from fedloom.models.merged import merged_name
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

MODULE = "layer.0.query"
RANKS = {0: 1, 1: 2, 2: 4}


def ranked_raw(*overrides: str, tmp_path: Path | None = None) -> dict:
    raw = tiny_raw("diagnostics.every=0", "model.lora.r=4", "model.lora.alpha=8",
                   *overrides, output_dir=tmp_path)
    raw["model"]["ranks"] = [{"clients": [0], "r": 2}, {"clients": [1], "r": 8}]
    return raw


@pytest.mark.parametrize(("ranks", "message"), [
    ([{"clients": [0], "r": 2}, {"clients": [0], "r": 8}], r"ranks\[1\].clients: client 0"),
    ([{"clients": [7], "r": 2}], r"ranks\[0\].clients: \[7\] are not clients"),
    ([{"clients": [0], "r": 0}], r"model.ranks\[0\].r"),
])
def test_rank_groups_are_checked(ranks: list, message: str) -> None:
    raw = tiny_raw()
    raw["model"]["ranks"] = ranks
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def test_ranks_refuse_a_mixed_backbone_federation_and_dual_adapters() -> None:
    raw = ranked_raw()
    raw["model"]["groups"] = [{"clients": [2], "backbone": "tiny-llama"}]
    with pytest.raises(ConfigError, match="model.ranks: per-client ranks are for one backbone"):
        validate(raw)
    with pytest.raises(ConfigError, match="need single LoRA adapters"):
        validate(ranked_raw('model.adapters="dual"'))


@needs_glue
def test_a_method_not_defined_on_ranks_refuses_them() -> None:
    with pytest.raises(ConfigError, match="model.ranks: fedavg is not defined .* flexlora, "
                                          "flora, hetlora"):
        Experiment.build(validate(ranked_raw("algorithm.name=fedavg")))


@needs_glue
def test_the_model_is_built_at_the_largest_rank_with_the_configured_scaling(tmp_path: Path) -> None:
    exp = Experiment.build(validate(ranked_raw("algorithm.name=hetlora", tmp_path=tmp_path)))
    assert exp.ranks == {0: 2, 1: 8, 2: 4}
    params = exp.model.initial_params
    module = factor_modules(params)[0]
    assert params[module + A_SUFFIX].shape[0] == 8
    layer = exp.model.merged.layers[module]
    assert layer.scaling["default"] == pytest.approx(8 / 4)  # alpha / r of [model.lora]


@needs_glue
@pytest.mark.parametrize("method", ["hetlora", "flexlora", "flora"])
def test_a_client_trains_only_its_first_r_components(method: str, tmp_path: Path) -> None:
    exp = Experiment.build(validate(ranked_raw(f"algorithm.name={method}", tmp_path=tmp_path)))
    alg = exp.algorithm
    state = alg.init_ranked(exp.model.get_params(), exp.ranks)
    client = exp.clients[0]  # rank 2 of 8
    payload = alg.payload(state, 0)
    ctx = ClientContext(0, exp.model, client.train, exp.cfg.train, 0, 2, {}, 0, rank=2)
    sent = alg.local_train(ctx, payload).params
    for module in factor_modules(payload):
        a, b = sent[module + A_SUFFIX], sent[module + B_SUFFIX]
        assert torch.count_nonzero(payload[module + A_SUFFIX][2:]) == 0
        assert torch.count_nonzero(a[2:]) == 0 and torch.count_nonzero(b[:, 2:]) == 0
    assert any(torch.count_nonzero(sent[m + B_SUFFIX][:, :2]) for m in factor_modules(sent))


def padded(generator: torch.Generator, rank: int, width: int = 4, d_out: int = 6,
           d_in: int = 5) -> dict[str, torch.Tensor]:
    params = {"head.weight": torch.randn(2, 3, generator=generator),
              MODULE + A_SUFFIX: torch.randn(width, d_in, generator=generator),
              MODULE + B_SUFFIX: torch.randn(d_out, width, generator=generator)}
    return truncated(params, rank)


def ranked_results(seed: int = 0) -> list[ClientResult]:
    g = torch.Generator().manual_seed(seed)
    return [ClientResult(k, padded(g, r), 10 * (k + 1), {"rank": float(r)})
            for k, r in RANKS.items()]


def test_hetlora_averages_zero_padded_factors_weighted_by_their_product_norms() -> None:
    alg = algorithms.create("hetlora")
    start = padded(torch.Generator().manual_seed(5), 4)
    results = ranked_results()
    state = alg.aggregate(alg.init_ranked(start, RANKS), results)
    norms = torch.tensor([float(torch.linalg.matrix_norm(
        r.params[MODULE + B_SUFFIX].double() @ r.params[MODULE + A_SUFFIX].double()))
        for r in results], dtype=torch.float64)
    p = norms / norms.sum()
    for suffix in (A_SUFFIX, B_SUFFIX):
        expected = sum(p[k] * r.params[MODULE + suffix].double() for k, r in enumerate(results))
        torch.testing.assert_close(state.global_params[MODULE + suffix].double(), expected,
                                   rtol=0, atol=1e-6)
    # the head by examples, as FedAvg
    n = torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64)
    head = sum(n[k] / n.sum() * r.params["head.weight"].double() for k, r in enumerate(results))
    torch.testing.assert_close(state.global_params["head.weight"].double(), head,
                               rtol=0, atol=1e-6)
    sent = alg.payload(state, 0)  # rank 1: only the first component
    assert torch.count_nonzero(sent[MODULE + A_SUFFIX][1:]) == 0
    torch.testing.assert_close(sent[MODULE + A_SUFFIX][:1], state.global_params[MODULE + A_SUFFIX][:1])


@needs_glue
def test_hetlora_prunes_a_rank_whose_tail_shrank(monkeypatch, tmp_path: Path) -> None:
    """γ = 0.5: a rank-8 client regularizes components 4..7; when their norm after a round
    is below the last round's, it keeps 4, sends zeros there, and the server's next payload
    to it is cut to 4."""
    import fedloom.algorithms.hetlora as hetlora_mod

    exp = Experiment.build(validate(ranked_raw("algorithm.name=hetlora", "algorithm.gamma=0.5",
                                               tmp_path=tmp_path)))
    alg = exp.algorithm
    tails = iter([1.0, 0.5])

    def fake_training(ctx, regularizer=None, **_):
        assert regularizer is not None and regularizer().requires_grad
        value = next(tails)
        with torch.no_grad():
            for name, p in ctx.model.trainable_parameters().items():
                if name.endswith((A_SUFFIX, B_SUFFIX)):
                    p.fill_(value)
        return {"train_loss": 0.0}

    monkeypatch.setattr(hetlora_mod, "train_locally", fake_training)
    state = alg.init_ranked(exp.model.get_params(), exp.ranks)
    ctx = ClientContext(1, exp.model, exp.clients[1].train, exp.cfg.train, 0, 2, {}, 0, rank=8)
    first = alg.local_train(ctx, alg.payload(state, 1))
    assert first.metrics["rank"] == 8.0  # nothing to compare with yet
    state = alg.aggregate(state, [first])
    second = alg.local_train(ctx, alg.payload(state, 1))
    assert second.metrics["rank"] == 4.0 and ctx.state["rank"] == 4
    module = factor_modules(second.params)[0]
    assert torch.count_nonzero(second.params[module + A_SUFFIX][4:]) == 0
    state = alg.aggregate(state, [second])
    assert torch.count_nonzero(alg.payload(state, 1)[module + A_SUFFIX][4:]) == 0
    assert alg.round_rows(state) == [{"scope": "ranks", "ranks": {"0": 2, "1": 4, "2": 4}}]


def test_flexlora_redistributes_the_best_rank_r_approximation() -> None:
    alg = algorithms.create("flexlora")
    start = padded(torch.Generator().manual_seed(5), 4)
    results = ranked_results()
    state = alg.aggregate(alg.init_ranked(start, RANKS), results)
    w = torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64) / 60
    delta = sum(w[k] * r.params[MODULE + B_SUFFIX].double() @ r.params[MODULE + A_SUFFIX].double()
                for k, r in enumerate(results))
    torch.testing.assert_close(state.global_params[merged_name(MODULE)].double(), delta,
                               rtol=0, atol=1e-6)
    u, s, vh = torch.linalg.svd(delta)
    for cid, rank in RANKS.items():
        sent = alg.payload(state, cid)
        approx = sent[MODULE + B_SUFFIX].double() @ sent[MODULE + A_SUFFIX].double()
        direct = u[:, :rank] @ torch.diag(s[:rank]) @ vh[:rank]
        torch.testing.assert_close(approx, direct, rtol=0, atol=1e-5)
        error = torch.linalg.matrix_norm(delta - approx)
        assert float(error) == pytest.approx(float(s[rank:].pow(2).sum().sqrt()), abs=1e-5)
        assert merged_name(MODULE) not in sent


def test_flora_cuts_each_client_s_fresh_a_to_its_rank() -> None:
    alg = algorithms.create("flora")
    start = padded(torch.Generator().manual_seed(5), 4)
    state = alg.aggregate(alg.init_ranked(start, RANKS), ranked_results())
    for cid, rank in RANKS.items():
        a = alg.payload(state, cid)[MODULE + A_SUFFIX]
        assert torch.count_nonzero(a[rank:]) == 0 and torch.count_nonzero(a[:rank]) == a[:rank].numel()


@needs_glue
@pytest.mark.parametrize(("method", "extra"), [
    ("hetlora", ()), ("hetlora", ("algorithm.gamma=0.5",)), ("flexlora", ()), ("flora", ())])
def test_a_mixed_rank_federation_runs(method: str, extra: tuple, tmp_path: Path) -> None:
    """Also HetLoRA's regularized training from B = 0 (the tail's norm has a zero
    subgradient there, not NaN)."""
    cfg = validate(ranked_raw(f"algorithm.name={method}", *extra, tmp_path=tmp_path))
    summary = simulate(Experiment.build(cfg), RunDir.create(tmp_path / "runs", cfg.name))
    assert summary["global"]["dev"]["accuracy"] is not None
    assert math.isfinite(summary["global"]["dev"]["loss"])
    if method != "flora":
        assert summary["personal"]["clients"]["accuracy"]["n"] == 3


def test_wire_bytes_count_a_client_s_rank_only() -> None:
    from fedloom.algorithms.lora_factors import wire_bytes

    params = padded(torch.Generator().manual_seed(0), 4)  # A 4 x 5, B 6 x 4, head 2 x 3
    assert wire_bytes(params) == 4 * (20 + 24 + 6)
    assert wire_bytes(params, 1) == 4 * (5 + 6 + 6)
    assert wire_bytes(params, 8) == wire_bytes(params)


@needs_glue
def test_the_train_rows_count_the_round_s_traffic(tmp_path: Path) -> None:
    import json

    cfg = validate(ranked_raw("algorithm.name=hetlora", "federation.rounds=1", tmp_path=tmp_path))
    exp = Experiment.build(cfg)
    run = RunDir.create(tmp_path / "runs", cfg.name)
    simulate(exp, run)
    (row,) = [json.loads(line) for line in run.metrics_path.read_text().splitlines()
              if json.loads(line)["scope"] == "train"]
    params = exp.model.initial_params
    per_rank = {r: sum(t.numel() * 4 for n, t in params.items() if "lora_" in n) * r // 8
                for r in (2, 4, 8)}
    head = sum(t.numel() * 4 for n, t in params.items() if "lora_" not in n)
    assert row["bytes_down"] == row["bytes_up"] == sum(per_rank.values()) + 3 * head

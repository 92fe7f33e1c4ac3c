"""LoRA-aware aggregation, each method by its defining property: FedEx-LoRA's global weight
is the exact mean of the clients' full weights (on constructed factors and through PEFT's
layers), FLoRA merges Σ_k p_k B_k A_k and starts afresh, FFA-LoRA's A never moves,
FedSVD's re-factorization keeps the product and makes A's rows orthonormal; merged
updates are applied to and removed from the frozen weights exactly; every method runs end
to end and its checkpoint scores as the run did."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import needs_glue

from fedloom import algorithms
from fedloom.algorithms import ClientContext, ClientResult
from fedloom.algorithms.fedsvd import refactorize
from fedloom.algorithms.lora_factors import A_SUFFIX, B_SUFFIX, factor_modules
from fedloom.evaluation.score import evaluate
from fedloom.experiment import Experiment
from fedloom.models.merged import merged_name
from fedloom.params import Params
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate

MODULES = ("layer.0.query", "layer.1.value")
COUNTS = (10, 30, 60)


def constructed(generator: torch.Generator, d_out: int = 6, d_in: int = 5, r: int = 2) -> Params:
    params: Params = {"head.weight": torch.randn(2, d_out, generator=generator)}
    for m in MODULES:
        params[m + A_SUFFIX] = torch.randn(r, d_in, generator=generator)
        params[m + B_SUFFIX] = torch.randn(d_out, r, generator=generator)
    return params


def weights(counts=COUNTS) -> list[float]:
    return [n / sum(counts) for n in counts]


def product(params: Params, module: str) -> torch.Tensor:
    return params[module + B_SUFFIX].double() @ params[module + A_SUFFIX].double()


def clients(seed: int = 1) -> list[ClientResult]:
    g = torch.Generator().manual_seed(seed)
    return [ClientResult(k, constructed(g), n) for k, n in enumerate(COUNTS)]


def test_fedex_lora_global_weight_is_the_mean_of_the_clients_full_weights() -> None:
    g = torch.Generator().manual_seed(0)
    start = constructed(g) | {merged_name(m): torch.randn(6, 5, generator=g) for m in MODULES}
    alg = algorithms.create("fedex_lora")
    results = clients()
    state = alg.aggregate(alg.init(start), results)
    new = state.global_params
    for m in MODULES:
        # W0 + s (M' + B̄ Ā) = Σ_k p_k (W0 + s M + s B_k A_k), W0 and s common to both sides
        expected = start[merged_name(m)].double() + sum(
            p * product(r.params, m) for p, r in zip(weights(), results))
        got = new[merged_name(m)].double() + product(new, m)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        mean_a = sum(p * r.params[m + A_SUFFIX] for p, r in zip(weights(), results))
        torch.testing.assert_close(new[m + A_SUFFIX], mean_a)  # FedIT's factor average too


def test_flora_merges_the_stacked_update_and_restarts_the_adapter() -> None:
    g = torch.Generator().manual_seed(0)
    start = constructed(g) | {merged_name(m): torch.randn(6, 5, generator=g) for m in MODULES}
    alg = algorithms.create("flora")
    results = clients()
    state = alg.aggregate(alg.init(start), results)
    new = state.global_params
    for m in MODULES:
        stacked_b = torch.cat([p * r.params[m + B_SUFFIX].double()
                               for p, r in zip(weights(), results)], dim=1)
        stacked_a = torch.cat([r.params[m + A_SUFFIX].double() for r in results], dim=0)
        assert stacked_b.shape[1] == 3 * 2  # rank Σ_k r_k
        torch.testing.assert_close(new[merged_name(m)].double(),
                                   start[merged_name(m)].double() + stacked_b @ stacked_a,
                                   rtol=0, atol=1e-5)
        assert torch.count_nonzero(new[m + B_SUFFIX]) == 0
        assert not any(torch.equal(new[m + A_SUFFIX], r.params[m + A_SUFFIX]) for r in results)
    again = alg.aggregate(alg.init(start), results).global_params
    later = alg.aggregate(state, results).global_params
    assert torch.equal(again[MODULES[0] + A_SUFFIX], new[MODULES[0] + A_SUFFIX])  # seeded
    assert not torch.equal(later[MODULES[0] + A_SUFFIX], new[MODULES[0] + A_SUFFIX])


def test_fedsvd_refactorization_keeps_the_product_with_orthonormal_rows_in_a() -> None:
    g = torch.Generator().manual_seed(0)
    b, a = torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randn(
        3, 9, generator=g, dtype=torch.float64)
    new_b, new_a = refactorize(b, a)
    torch.testing.assert_close(new_b @ new_a, b @ a, rtol=0, atol=1e-12)
    torch.testing.assert_close(new_a @ new_a.T, torch.eye(3, dtype=torch.float64))


@pytest.mark.parametrize("every", [1, 2])
def test_fedsvd_aggregates_b_over_the_shared_a_and_refactorizes_every_n_rounds(every: int) -> None:
    start = constructed(torch.Generator().manual_seed(0))
    alg = algorithms.create("fedsvd", every=every)
    results = [ClientResult(r.client_id, {n: t for n, t in r.params.items()
                                          if not n.endswith(A_SUFFIX)}, r.num_examples)
               for r in clients()]
    new = alg.aggregate(alg.init(start), results).global_params
    for m in MODULES:
        mean_b = sum(p * r.params[m + B_SUFFIX].double() for p, r in zip(weights(), results))
        torch.testing.assert_close(product(new, m), mean_b @ start[m + A_SUFFIX].double(),
                                   rtol=0, atol=1e-5)
        orthonormal = torch.allclose(new[m + A_SUFFIX] @ new[m + A_SUFFIX].T, torch.eye(2),
                                     atol=1e-5)
        assert orthonormal == (every == 1)
        assert torch.equal(new[m + A_SUFFIX], start[m + A_SUFFIX]) == (every == 2)


def test_a_method_on_lora_factors_refuses_an_adapter_without_them() -> None:
    for name in ("ffa_lora", "fedex_lora", "flora", "fedsvd"):
        with pytest.raises(ValueError, match="algorithm.name: .* LoRA factor pairs"):
            algorithms.create(name).check_model({"head.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="model.lora.r: 4 exceeds"):
        algorithms.create("fedsvd").check_model({
            "m" + A_SUFFIX: torch.zeros(4, 3), "m" + B_SUFFIX: torch.zeros(8, 4)})


# --------------------------------------------------------------- through the real model


def lora_layer_output(exp: Experiment, params: Params, module: str, x: torch.Tensor) -> torch.Tensor:
    exp.model.set_params(params)
    with torch.no_grad():
        return exp.model.merged.layers[module](x).double()


def perturbed(params: Params, seed: int) -> Params:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in params.items()
            if not n.endswith(".merged.weight")}


@needs_glue
def test_fedex_lora_layers_compute_the_mean_of_the_clients_layers(make_config) -> None:
    """Two rounds: the global adapter's LoRA layer, merged residual included, outputs the
    weighted mean of the clients' layers (a linear layer is linear in its weight); the
    frozen weights come back bit for bit when a payload has no merged update."""
    exp = Experiment.build(make_config("algorithm.name=fedex_lora"))
    exp.model.head.eval()
    alg, start = exp.algorithm, exp.model.get_params()
    module = factor_modules(start)[0]
    layer = exp.model.merged.base(module)
    original = layer.weight.detach().clone()
    x = torch.randn(4, layer.weight.shape[1], generator=torch.Generator().manual_seed(9))
    state = alg.init(start)
    for round_ in range(2):
        payload = state.global_params
        sent = [{**payload, **perturbed(payload, 10 * round_ + k)} for k in range(3)]
        state = alg.aggregate(state, [ClientResult(k, perturbed(payload, 10 * round_ + k), n)
                                      for k, n in enumerate(COUNTS)])
        expected = sum(p * lora_layer_output(exp, s, module, x) for p, s in zip(weights(), sent))
        got = lora_layer_output(exp, state.global_params, module, x)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        assert not torch.equal(layer.weight, original)
    exp.model.set_params(start)
    assert torch.equal(layer.weight, original)


@needs_glue
def test_a_bad_merged_update_is_refused_before_anything_is_written(make_config) -> None:
    exp = Experiment.build(make_config())
    start = exp.model.get_params()
    module = factor_modules(start)[0]
    before = exp.model.merged.base(module).weight.detach().clone()
    changed = {n: t + 1 for n, t in start.items()}
    with pytest.raises(ValueError, match=r"merged.weight: shape \(2, 2\)"):
        exp.model.set_params(changed | {merged_name(module): torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="no LoRA layer 'nowhere'"):
        exp.model.set_params(changed | {merged_name("nowhere"): torch.zeros(2, 2)})
    assert all(torch.equal(t, start[n]) for n, t in exp.model.get_params().items())
    assert torch.equal(exp.model.merged.base(module).weight, before)


@needs_glue
def test_ffa_lora_clients_train_and_send_only_b_and_the_head(make_config) -> None:
    exp = Experiment.build(make_config("algorithm.name=ffa_lora"))
    start = exp.model.get_params()
    client = exp.clients[0]
    ctx = ClientContext(client.client_id, exp.model, client.train, exp.cfg.train, 0, 2, {}, 0)
    result = exp.algorithm.local_train(ctx, start)
    assert not any(n.endswith(A_SUFFIX) for n in result.params)
    assert any(not torch.equal(t, start[n]) for n, t in result.params.items())
    assert all(torch.equal(t, start[n]) for n, t in exp.model.get_params().items()
               if n.endswith(A_SUFFIX))


NEW_METHODS = {"fedit": [], "ffa_lora": [], "fedex_lora": [], "flora": [],
               "fedsvd": ["algorithm.every=1"]}


@needs_glue
@pytest.mark.parametrize("name", sorted(NEW_METHODS))
def test_lora_aware_method_runs_and_its_checkpoint_scores_as_the_run(
    name: str, make_config, tmp_path: Path
) -> None:
    cfg = make_config(f"algorithm.name={name}", *NEW_METHODS[name])
    exp = Experiment.build(cfg)
    start = exp.model.get_params()
    run = RunDir.create(tmp_path / "runs", cfg.name)
    summary = simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert all(math.isfinite(r["train_loss"]) for r in rows if r["scope"] == "train")
    final = load_params(run.checkpoints / "global.safetensors")
    merges = name in ("fedex_lora", "flora")
    assert any(n.endswith(".merged.weight") for n in final) == merges
    if name == "ffa_lora":
        assert all(torch.equal(final[n], start[n]) for n in start if n.endswith(A_SUFFIX))
    rescored = evaluate(exp.model, final, exp.dev, 32)
    assert rescored["accuracy"] == summary["global"]["dev"]["accuracy"]
    assert rescored["loss"] == pytest.approx(summary["global"]["dev"]["loss"], rel=1e-5)

"""Differential privacy: the accountant against dp-accounting and the published values, the
noise multiplier chosen for a target ε, DP-FedAvg's clip stage against its definition and
Flower's DP wrappers (clipping exact, noise std statistical), client-side noise, adaptive
clipping against Andrew et al.'s update, the configuration's refusals, and a run's ε per
round."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from conftest import needs_glue, tiny_raw
from dp_accounting import pld, rdp
from dp_accounting.privacy_accountant import NeighboringRelation
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.config import ConfigError, validate
from fedloom.experiment import Experiment, build_algorithm, transform_chain
from fedloom.privacy import accountant, client_level
from fedloom.privacy.accountant import epsilon, noise_for_epsilon
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate
from fedloom.transforms.client_noise import ClientNoise
from fedloom.transforms.clip_update import clip_delta, delta_norm
from fedloom.transforms.dp_fedavg import DPFedAvg, update_multiplier

# ---------------------------------------------------------------- the accountant


@pytest.mark.parametrize(("rounds", "published"),
                         [(10**3, 0.774), (10**4, 0.884), (10**5, 1.899), (10**6, 6.830)])
def test_mcmahan_2018_golden_values_with_rdp(rounds: int, published: float) -> None:
    # K = 1e5 clients, 100 a round (q = 1e-3), z = 1, delta = K^-1.1 (McMahan et al. 2018,
    # Table 1, with the improved RDP-to-DP conversion of today's accountants)
    got = epsilon(1.0, 1e-3, rounds, 1e5**-1.1, accountant="rdp")
    assert got == pytest.approx(published, abs=0.002)
    # PLD is tight: below RDP, never above it
    assert epsilon(1.0, 1e-3, rounds, 1e5**-1.1) < got


def test_abadi_2016_dp_sgd_today_and_as_published() -> None:
    # q = 0.01, sigma = 4, delta = 1e-5, 1e4 steps: the moments accountant published 1.26;
    # today's RDP conversion gives 1.035 and PLD 0.947
    assert epsilon(4.0, 0.01, 10**4, 1e-5, accountant="rdp") == pytest.approx(1.0355, abs=1e-3)
    assert epsilon(4.0, 0.01, 10**4, 1e-5) == pytest.approx(0.947, abs=2e-3)
    assert epsilon(4.0, 0.01, 10**4, 1e-5, accountant="rdp") < 1.26


GRID = [(0.7, 0.01, 300, 1e-5), (0.7, 0.1, 10, 1e-5), (2.0, 0.1, 300, 1e-5),
        (2.0, 0.01, 10, 1e-5), (1.0, 0.05, 100, 1e-3)]


@pytest.mark.parametrize(("z", "q", "t", "d"), GRID)
def test_the_accountant_lies_between_pld_and_rdp(z: float, q: float, t: int, d: float) -> None:
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t)
    tight = pld.PLDAccountant().compose(event).get_epsilon(d)
    loose = rdp.RdpAccountant().compose(event).get_epsilon(d)
    for name in ("pld", "rdp"):
        got = epsilon(z, q, t, d, accountant=name)
        assert tight * 0.98 <= got <= loose * 1.02


def test_sampling_without_replacement_is_replace_one_with_twice_the_sensitivity() -> None:
    # a fixed 10 of 50 clients: dp-accounting's RDP for sampling without replacement,
    # between datasets that differ in one replaced client (the sum moves by up to 2C)
    got = epsilon(2.0, 0.2, 30, 1e-3, sampling="without_replacement", population=50,
                  accountant="rdp")
    acc = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.SampledWithoutReplacementDpEvent(
        50, 10, dp_accounting.GaussianDpEvent(1.0)), 30))
    assert got == pytest.approx(acc.get_epsilon(1e-3), rel=1e-12)
    # never mistaken for Poisson sampling at the same rate, which is looser a relation
    assert got > epsilon(2.0, 0.2, 30, 1e-3, accountant="rdp")
    with pytest.raises(ValueError, match="PLD accounting .* no sampling without replacement"):
        epsilon(2.0, 0.2, 30, 1e-3, sampling="without_replacement", population=50)
    # every client every round: no amplification, plain Gaussian composition
    assert epsilon(2.0, 1.0, 30, 1e-3, sampling="none") == pytest.approx(
        pld.PLDAccountant().compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(2.0), 30)).get_epsilon(1e-3), rel=1e-9)


@pytest.mark.parametrize("name", ["rdp", "pld"])
def test_the_noise_for_a_target_epsilon_is_the_smallest_that_reaches_it(name: str) -> None:
    z = noise_for_epsilon(2.0, 0.05, 200, 1e-5, accountant=name)
    assert epsilon(z, 0.05, 200, 1e-5, accountant=name) <= 2.0
    assert epsilon(z - 2e-3, 0.05, 200, 1e-5, accountant=name) > 2.0
    with pytest.raises(ValueError, match="out of reach"):
        noise_for_epsilon(1e-4, 0.05, 200, 1e-5, accountant=name)


def test_a_run_of_unequal_rounds_composes_each() -> None:
    a = accountant.release(1.0, 1.0, 3, "none")
    b = accountant.release(0.5, 1.0, 2, "none")
    both = accountant.epsilon_of([a, b], 1e-5)
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0), 3),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.5), 2)])
    assert both == pytest.approx(pld.PLDAccountant().compose(event).get_epsilon(1e-5), rel=1e-9)
    assert accountant.epsilon_of([], 1e-5) == 0.0
    assert accountant.epsilon_of([accountant.release(0.0, 1.0, 1, "none")], 1e-5) == math.inf


# ---------------------------------------------------------------- the clip and noise stages


def _updates(m: int, p: int, scale: float, seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    payload = {"lora_A": torch.zeros(p // 2), "head": torch.ones(p - p // 2)}
    updates = {cid: {n: t + scale * torch.randn(t.shape, generator=g) for n, t in payload.items()}
               for cid in range(m)}
    return updates, {cid: payload for cid in range(m)}


def test_after_the_chain_every_shared_update_is_within_the_clip_norm() -> None:
    dp = DPFedAvg(noise_multiplier=0.0, clip_norm=0.5, clients_per_round=4)
    updates, payloads = _updates(4, 100, scale=1.0)
    for cid, update in updates.items():
        sent = dp.up(update, payloads[cid], cid, 0, {})
        assert delta_norm(sent, payloads[cid]) <= 0.5 * (1 + 1e-6)
    # the server clips again: a client that skipped clipping is bounded all the same
    served = dp.server(updates, payloads, 0, dp.init_state())
    assert all(delta_norm(u, payloads[c]) <= 0.5 * (1 + 1e-6) for c, u in served.updates.items())
    # a tensor the payload lacks cannot be clipped, so DP refuses to send it
    with pytest.raises(ValueError, match="'task_vector'"):
        dp.up({**updates[0], "task_vector": torch.ones(3)}, payloads[0], 0, 0, {})


def test_server_noise_on_the_mean_has_std_z_c_over_m() -> None:
    m, p, z, c = 8, 200_000, 1.5, 0.1
    updates, payloads = _updates(m, p, scale=1e-3)  # norms far inside C: clipping is a no-op
    dp = DPFedAvg(noise_multiplier=z, clip_norm=c, clients_per_round=m, seed=3)
    served = dp.server(updates, payloads, 5, dp.init_state())
    names = sorted(payloads[0])
    noise = torch.cat([
        (sum(served.updates[k][n] - updates[k][n] for k in range(m)) / m).double()
        for n in names])
    expected = z * c / m  # Flower's compute_stdv(z, C, m) for the aggregate
    # the sample std of P Gaussian values has relative standard error 1/sqrt(2P)
    assert abs(float(noise.std()) / expected - 1) < 4 / math.sqrt(2 * p)
    assert abs(float(noise.mean())) < 4 * expected / math.sqrt(p)
    assert served.measurements["noise_std"] == pytest.approx(z * c)
    # seeded by (seed, round, client): the same round draws the same noise
    again = dp.server(updates, payloads, 5, dp.init_state())
    assert all(torch.equal(again.updates[k][n], served.updates[k][n]) for k in range(m)
               for n in names)


def test_client_noise_shares_sum_to_the_noise_of_the_sum() -> None:
    m, p, z, c = 10, 100_000, 2.0, 0.3
    updates, payloads = _updates(m, p, scale=1e-4)
    share = ClientNoise(std=z * c, clients_per_round=m, seed=1)
    noised = {k: share.up(u, payloads[k], k, 0, {}) for k, u in updates.items()}
    total = torch.cat([sum(noised[k][n] - updates[k][n] for k in range(m)).double()
                       for n in sorted(payloads[0])])
    assert abs(float(total.std()) / (z * c) - 1) < 4 / math.sqrt(2 * p)
    one = torch.cat([(noised[0][n] - updates[0][n]).double() for n in sorted(payloads[0])])
    assert abs(float(one.std()) / (z * c / math.sqrt(m)) - 1) < 4 / math.sqrt(2 * p)
    # the server accounts the shares that arrived: 6 of 10 carry z * sqrt(0.6)
    dp = DPFedAvg(noise_multiplier=z, clip_norm=c, clients_per_round=m, noise="client")
    six = {k: noised[k] for k in range(6)}
    served = dp.server(six, {k: payloads[k] for k in six}, 0, dp.init_state())
    assert served.updates is six
    assert served.measurements["noise_multiplier"] == pytest.approx(z * math.sqrt(0.6))


def test_adaptive_clipping_follows_the_unclipped_fraction_geometrically() -> None:
    # Andrew et al. 2021: C' = C exp(-eta (b - gamma)), b the fraction of updates with
    # norm <= C (noised; here with negligible count noise)
    updates, payloads = _updates(10, 40, scale=1.0)
    norms = sorted(delta_norm(u, payloads[k]) for k, u in updates.items())
    c = norms[2]  # 3 of 10 unclipped
    dp = DPFedAvg(noise_multiplier=0.0, clip_norm=c, clients_per_round=10,
                  adaptive_quantile=0.5, adaptive_lr=0.2, count_noise=1e-9)
    served = dp.server(updates, payloads, 0, dp.init_state())
    assert served.state["clip_norm"] == pytest.approx(c * math.exp(-0.2 * (0.3 - 0.5)))
    assert served.state["clip_norm"] > c  # too many clipped: C grows
    assert all(delta_norm(u, payloads[k]) <= c * (1 + 1e-6) for k, u in served.updates.items())
    # the next round clips to the new norm
    again = dp.server(updates, payloads, 1, served.state)
    assert again.measurements["clip_norm"] == served.state["clip_norm"]


def test_adaptive_noise_split_equals_flowers() -> None:
    flwr_dp = pytest.importorskip("flwr.supercore.differential_privacy")
    for z, m in ((0.5, 20), (1.0, 100), (0.0, 10)):
        count_std, z_update = flwr_dp.compute_adaptive_noise_params(z, m, None)
        dp = DPFedAvg(noise_multiplier=z, clip_norm=0.1, clients_per_round=m,
                      adaptive_quantile=0.5)
        assert dp.count_std == pytest.approx(count_std)
        assert dp.update_noise_multiplier == pytest.approx(z_update, rel=1e-12)
    with pytest.raises(ValueError, match="needs count noise above"):
        update_multiplier(1.0, 0.5)


def test_fixed_clipping_equals_flowers() -> None:
    flwr_dp = pytest.importorskip("flwr.supercore.differential_privacy")
    updates, payloads = _updates(3, 30, scale=1.0, seed=7)
    for k, update in updates.items():
        names = sorted(update)
        ours, _ = clip_delta(update, payloads[k], 0.8)
        theirs = [update[n].numpy().copy() for n in names]
        flwr_dp.compute_clip_model_update(theirs, [payloads[k][n].numpy() for n in names], 0.8)
        for n, t in zip(names, theirs):
            np.testing.assert_allclose(ours[n].numpy(), t, rtol=1e-6, atol=1e-7)
    assert flwr_dp.compute_stdv(1.5, 0.1, 8) == pytest.approx(1.5 * 0.1 / 8)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(("overrides", "message"), [
    (["privacy.noise_multiplier=-1"], "privacy.noise_multiplier: Input should be greater"),
    (["privacy.clip_norm=0"], "privacy.clip_norm: Input should be greater than 0"),
    (["privacy.delta=0.25", "partition.num_clients=4"], "privacy.delta: 0.25 is not below 1/K"),
    (["privacy.target_epsilon=0.001", "partition.num_clients=30", "federation.rounds=100"],
     "privacy.target_epsilon: 0.001 is out of reach"),
    (["algorithm.name=fedmosaic"],
     "privacy.level: dp_fedavg does not cover algorithm.name = 'fedmosaic'"),
    (["algorithm.name=scaffold"],
     "privacy.level: dp_fedavg does not cover algorithm.name = 'scaffold'"),
    (["algorithm.name=feddbe"], "privacy.level: dp_fedavg does not cover algorithm.name = 'feddbe'"),
    (["aggregation.rule=median"], "aggregation.rule: median is not a mean of the updates"),
    (["algorithm.weighting=examples"], "algorithm.weighting: DP-FedAvg averages uniformly"),
    (["privacy.accountant=pld", "federation.fraction=0.5"], "privacy.accountant: PLD accounting"),
    (["privacy.adaptive_quantile=0.5", "privacy.noise=client"],
     "privacy.adaptive_quantile: adaptive clipping needs noise = 'server'"),
    (["privacy.adaptive_quantile=0.5", "privacy.noise_multiplier=1"],
     "privacy.noise_multiplier: 1.0 needs count noise above 0.5"),
    (["privacy.target_epsilon=1", "privacy.noise_multiplier=1"],
     "privacy.target_epsilon: set either noise_multiplier or target_epsilon"),
])
def test_a_bad_privacy_setting_is_one_line_naming_its_key(overrides: list, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_algorithm(validate(tiny_raw("privacy.level=client", *overrides)))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_privacy_setting_without_privacy_is_refused_but_defaults_spelled_out_are_not() -> None:
    with pytest.raises(ConfigError, match=r"^privacy.noise_multiplier: only with privacy.level"):
        validate(tiny_raw("privacy.noise_multiplier=1"))
    validate(tiny_raw("privacy.clip_norm=1.0", "privacy.noise=server"))


def test_privacy_makes_the_mean_uniform_and_places_its_stages() -> None:
    cfg = validate(tiny_raw("privacy.level=client", "privacy.noise=client",
                            "transforms=[{name = 'half_precision'}]"))
    assert build_algorithm(cfg).weighting == "uniform"
    assert [t.name for t in transform_chain(cfg).transforms] == [
        "dp_fedavg", "half_precision", "client_noise"]  # clip > compress > noise


@needs_glue
def test_the_cli_refuses_dp_on_an_uncovered_algorithm_with_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'output_dir = "{tmp_path / "runs"}"\n[algorithm]\nname = "ifca"\n'
                      '[privacy]\nlevel = "client"\n')
    done = CliRunner().invoke(app, ["run", "--no-report", str(config)])
    assert done.exit_code == 2
    assert "privacy.level: dp_fedavg does not cover algorithm.name = 'ifca'" in done.stderr
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- a run


@needs_glue
def test_a_run_reports_epsilon_every_round_as_the_accountant_composes_it(tmp_path: Path) -> None:
    raw = tiny_raw("federation.rounds=3", "partition.num_clients=4", "federation.fraction=0.5",
                   "data.max_train_examples=80", "privacy.level=client",
                   "privacy.target_epsilon=30", "privacy.clip_norm=0.05", output_dir=tmp_path)
    cfg = validate(raw)
    run = RunDir.create(tmp_path, "dp")
    summary = simulate(Experiment.build(cfg), run)
    z = client_level.noise_multiplier(cfg)
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["scope"] == "train"]
    delta = 4**-1.1
    for t, row in enumerate(train, 1):
        assert row["delta"] == pytest.approx(delta)
        assert row["epsilon"] == pytest.approx(epsilon(
            z, 0.5, t, delta, sampling="without_replacement", population=4, accountant="rdp"))
        assert row["privacy"]["clip_norm"] == 0.05
    assert summary["privacy"]["epsilon"] == pytest.approx(train[-1]["epsilon"])
    assert summary["privacy"]["epsilon"] <= 30
    assert summary["privacy"]["accountant"] == "rdp"
    assert summary["privacy"]["neighbours"] == "replace_one"
    log = (run.path / "run.log").read_text()
    assert f"noise multiplier {z:.4g} (chosen for target epsilon 30 over 3 rounds)" in log
    # a guarantee this loose is said to be one, with its cause
    assert "exceeds 10, which promises little: " in log and "raise privacy.noise_multiplier" in log


# ---------------------------------------------------------------- sample-level DP (DP-SGD)


def _dp_sgd_client(z: float, clip: float):
    from fedloom.runtime.clients import client_context

    cfg = validate(tiny_raw(
        "privacy.level=sample", "privacy.noise_multiplier=1.0", f"privacy.clip_norm={clip}",
        "train.optimizer=sgd", "train.lr=1.0", "train.head_lr=1.0", "train.weight_decay=0.0",
        "train.local_steps=1", "train.schedule=constant", "model.lora.dropout=0.0"))
    # z = 0, which a config refuses (no guarantee), isolates the clipping from the noise
    privacy = cfg.privacy.model_copy(update={"noise_multiplier": z})
    exp = Experiment.build(cfg.model_copy(update={"privacy": privacy}))
    for m in exp.model.transformer.modules():  # no dropout: per-example gradients by hand
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    exp.model.head.dropout.p = 0.0
    return exp, client_context(exp, exp.clients[0], 0, {})


@needs_glue
def test_dp_sgd_steps_along_the_mean_of_clipped_per_example_gradients() -> None:
    from fedloom.train.dp_sgd import poisson_batch

    exp, ctx = _dp_sgd_client(0.0, 0.05)
    model, start = exp.model, exp.model.get_params()
    n, batch = len(ctx.train), exp.cfg.train.batch_size
    indices = poisson_batch(n, batch / n, np.random.default_rng(ctx.seed))
    assert len(indices) > 0
    named = model.trainable_parameters()
    clipped = {name: torch.zeros_like(p) for name, p in named.items()}
    for i in indices:  # each example's gradient, clipped to C, by hand
        model.set_params(start)
        for p in named.values():
            p.grad = None
        model.loss(model.head.collate([ctx.train[i]])).backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in named.values()))
        for name, p in named.items():
            clipped[name] += p.grad * min(1.0, 0.05 / float(norm))
    model.set_params(start)
    metrics = exp.algorithm.local_train(ctx, start).metrics
    after = model.get_params()
    for name in named:  # lr 1: the step is minus the sum over the expected batch size
        assert torch.allclose(after[name] - start[name], -clipped[name] / batch, atol=1e-6)
    assert metrics["epsilon"] == math.inf  # no noise, no guarantee
    assert ctx.state["dp_sgd_steps"] == 1


@needs_glue
def test_dp_sgd_noise_has_std_z_c_over_the_expected_batch() -> None:
    exp, quiet = _dp_sgd_client(0.0, 0.05)
    start = exp.model.get_params()
    plain = exp.algorithm.local_train(quiet, start).params
    exp2, noisy = _dp_sgd_client(2.0, 0.05)
    result = exp2.algorithm.local_train(noisy, start)
    noise = torch.cat([(result.params[n] - plain[n]).flatten().double() for n in start])
    expected = 2.0 * 0.05 / exp.cfg.train.batch_size  # lr 1
    assert abs(float(noise.std()) / expected - 1) < 4 / math.sqrt(2 * noise.numel())
    n = len(noisy.train)
    assert result.metrics["epsilon"] == pytest.approx(epsilon(
        2.0, exp.cfg.train.batch_size / n, 1, n**-1.1, sampling="poisson"))


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.name=fedprox"], "privacy.level: DP-SGD does not cover algorithm 'fedprox'"),
    (["model.precision=bf16"], "model.precision: DP-SGD through Opacus runs in fp32"),
    (["train.clients_per_pass=2"], "train.clients_per_pass: DP-SGD needs each example's"),
    (["train.grad_accum=2"], "train.grad_accum: DP-SGD draws one Poisson batch per step"),
    (["privacy.target_epsilon=3"], "privacy.target_epsilon: with level = 'sample' each"),
    (["privacy.noise=client"], "privacy.noise: a client-level setting"),
])
def test_dp_sgd_refuses_what_it_cannot_cover_by_key(overrides: list, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_algorithm(validate(tiny_raw("privacy.level=sample", *overrides)))
    assert str(err.value).startswith(message)

"""FedAvg with each client's label prior (``fedavg_la``) on tiny-bert and a small real MRPC
subset: FedAvg's training and step unchanged; the label counts the server sums over every
participation; T fitted on a grid from the clients' validation NLL sums (what a fit on
their validation splits pooled finds, to the grid's spacing); a client's adapter = the
global logits over T plus log p_k − log p; the refusals (a regression task, DP-FedAvg)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tomli_w
import torch
from conftest import identical, needs_glue, require_glue, tiny_config, tiny_raw
from typer.testing import CliRunner

from fedloom import algorithms
from fedloom.algorithms import ClientContext
from fedloom.algorithms.base import ClientResult
from fedloom.algorithms.fedavg_la import NLL_METRIC, TEMPERATURE, TRAINED_COUNTS, FedAvgLA
from fedloom.cli import app
from fedloom.config import ConfigError, validate
from fedloom.experiment import Experiment
from fedloom.models.calibration import (
    T_GRID,
    fit_temperature,
    grid_temperature,
    held_out_log_probs,
    nll_by_temperature,
)
from fedloom.models.label_prior import count_metrics, label_counts
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate


@pytest.fixture(scope="module")
def tiny_exp(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    require_glue()
    return Experiment.build(tiny_config(output_dir=tmp_path_factory.mktemp("runs")))


def context(exp: Experiment, client: int, train: list | None = None,
            val: list | None = None) -> ClientContext:
    c = exp.clients[client]
    ctx = ClientContext(c.client_id, exp.model, c.train if train is None else train,
                        exp.cfg.train, 0, 2, {}, 5)
    ctx.val = val or []
    return ctx


def moved_head(exp: Experiment) -> dict[str, torch.Tensor]:
    """The initial adapter with its head moved off its initial values."""
    gen = torch.Generator().manual_seed(0)
    return {n: t + 0.5 * torch.randn(t.shape, generator=gen) if "lora_" not in n else t
            for n, t in exp.model.initial_params.items()}


def test_it_personalizes_a_global_model_and_adjusts_logits() -> None:
    alg = algorithms.create("fedavg_la")
    assert alg.personalized and alg.has_global and alg.adjusts_logits and not alg.pools_data


@needs_glue
def test_the_server_sums_the_counts_of_every_participation(tiny_exp: Experiment) -> None:
    """Round 1: clients 0 and 1 report (3, 1) and (0, 4); round 2: client 0 again. The
    global adapter is FedAvg's step, the counts (6, 2) + (0, 4): what the model trained on."""
    alg, fedavg = FedAvgLA(), algorithms.create("fedavg")
    state = alg.init(tiny_exp.model.initial_params)
    assert TRAINED_COUNTS not in alg.payload(state, 0)
    adapter = moved_head(tiny_exp)

    def result(cid: int, counts: list[float], scale: float) -> ClientResult:
        params = {n: t * scale for n, t in adapter.items()}
        return ClientResult(cid, params, 10 + cid, count_metrics(np.array(counts)))

    first = [result(0, [3, 1], 1.0), result(1, [0, 4], 2.0)]
    after = alg.aggregate(state, first)
    assert identical(after.global_params, fedavg.aggregate(state, first).global_params)
    assert after.extra[TRAINED_COUNTS].tolist() == [3.0, 5.0]
    second = alg.aggregate(after, [result(0, [3, 1], 0.5)])
    payload = alg.payload(second, 1)
    assert payload[TRAINED_COUNTS].tolist() == [6.0, 6.0]
    assert set(payload) - {TRAINED_COUNTS} == set(tiny_exp.model.param_names)
    with pytest.raises(ValueError, match="fedavg_la: client 3: no label counts reported"):
        alg.aggregate(state, [ClientResult(3, adapter, 5, {})])


@needs_glue
def test_a_client_reports_its_own_counts_and_trains_as_fedavg(tiny_exp: Experiment) -> None:
    alg, fedavg = FedAvgLA(), algorithms.create("fedavg")
    payload = {**tiny_exp.model.initial_params, TRAINED_COUNTS: torch.tensor([5.0, 5.0])}
    mine = alg.local_train(context(tiny_exp, 0), payload)
    plain = fedavg.local_train(context(tiny_exp, 0), tiny_exp.model.initial_params)
    assert identical(mine.params, plain.params)
    counts = label_counts(tiny_exp.clients[0].train, 2)
    assert [mine.metrics[f"label_count_{y}"] for y in range(2)] == counts.tolist()


@needs_glue
def test_the_adapter_is_the_global_logits_over_t_plus_the_prior_offset(
    tiny_exp: Experiment,
) -> None:
    """Client labels (0, 0, 0, 1), trained-on counts (10, 30): offset log p_k − log p with
    add-one smoothing; the adapter's log-probabilities are log-softmax(z / T + offset) at
    the T the server sent (none sent: T = 1); no counts yet: the global adapter as is."""
    features = [dict(f, label=y) for f, y in zip(tiny_exp.clients[0].train[:4], (0, 0, 0, 1))]
    offset = torch.as_tensor(np.log([4 / 6, 2 / 6]) - np.log([11 / 42, 31 / 42]))
    adapter = moved_head(tiny_exp)
    model, test = tiny_exp.model, tiny_exp.clients[0].test
    model.set_params(adapter)
    z, _ = held_out_log_probs(model, test, 32)
    counts = {TRAINED_COUNTS: torch.tensor([10.0, 30.0])}
    for sent, temperature in (({}, 1.0), ({TEMPERATURE: torch.tensor([2.5])}, 2.5)):
        mine = FedAvgLA().client_adapter(
            context(tiny_exp, 0, train=features), {**adapter, **counts, **sent}
        )
        assert set(mine) == set(adapter)
        model.set_params(mine)
        moved, _ = held_out_log_probs(model, test, 32)
        want = torch.log_softmax(z.double() / temperature + offset, -1)
        torch.testing.assert_close(moved.double(), want, rtol=0, atol=1e-5)
    assert identical(FedAvgLA().client_adapter(context(tiny_exp, 0), adapter), adapter)


@needs_glue
def test_t_is_fitted_on_the_clients_validation_sums(tiny_exp: Experiment) -> None:
    """Clients 0 and 1 report the received adapter's validation NLL at each grid T; the
    server's T is the grid point nearest (within the grid's 10 % spacing) to the T a fit
    on their validation splits pooled finds, and stays when a later round reports none.
    ``calibrate = False``: nothing reported, no T."""
    adapter = moved_head(tiny_exp)
    vals = {c: tiny_exp.clients[c].test for c in (0, 1)}  # held out from training
    alg = FedAvgLA()
    state = alg.init(adapter)
    results = [alg.local_train(context(tiny_exp, c, val=vals[c]), alg.payload(state, c))
               for c in (0, 1)]
    model = tiny_exp.model
    model.set_params(adapter)
    for c, result in zip((0, 1), results):
        own = nll_by_temperature(*held_out_log_probs(model, vals[c], 32))
        reported = [result.metrics[NLL_METRIC.format(i)] for i in range(len(T_GRID))]
        np.testing.assert_allclose(reported, own, rtol=1e-12)
    pooled = [f for c in (0, 1) for f in vals[c]]
    exact = fit_temperature(*held_out_log_probs(model, pooled, 32))
    after = alg.aggregate(state, results)
    fitted = float(after.extra[TEMPERATURE])
    summed = sum(nll_by_temperature(*held_out_log_probs(model, vals[c], 32)) for c in (0, 1))
    assert fitted == pytest.approx(grid_temperature(summed), rel=1e-6)
    assert exact / 1.1 <= fitted <= exact * 1.1
    assert alg.payload(after, 0)[TEMPERATURE].item() == pytest.approx(fitted)
    silent = alg.local_train(context(tiny_exp, 0), alg.payload(after, 0))  # no val split
    assert not any(k.startswith("validation_nll") for k in silent.metrics)
    assert float(alg.aggregate(after, [silent]).extra[TEMPERATURE]) == pytest.approx(fitted)
    plain = FedAvgLA(calibrate=False)
    quiet = plain.local_train(context(tiny_exp, 0, val=vals[0]), plain.payload(state, 0))
    assert TEMPERATURE not in plain.aggregate(state, [quiet]).extra
    partial = {**results[0].metrics}
    del partial[NLL_METRIC.format(3)]
    with pytest.raises(ValueError, match="80 of 81 validation NLL sums reported"):
        alg.aggregate(state, [ClientResult(0, results[0].params, 5, partial)])


def test_the_fit_with_an_offset_finds_the_temperature_that_generated_the_labels() -> None:
    """Labels drawn from softmax(z / 3 + o): the offset-aware fit recovers T ≈ 3 within a
    few Monte-Carlo errors (20,000 examples); ignoring the offset it does not."""
    gen = torch.Generator().manual_seed(0)
    z = 4 * torch.randn(20_000, 3, generator=gen, dtype=torch.float64)
    offset = torch.tensor([1.5, -0.5, -1.0], dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(z / 3 + offset, -1), 1, generator=gen).squeeze(1)
    assert fit_temperature(z, labels, offset) == pytest.approx(3.0, rel=0.05)
    assert fit_temperature(z, labels) != pytest.approx(3.0, rel=0.05)
    with pytest.raises(ValueError, match="a \\(classes,\\) offset"):
        fit_temperature(z, labels, offset[:2])


@needs_glue
def test_a_run_scores_each_client_with_its_prior_on_fedavg_global_adapter(
    tmp_path: Path,
) -> None:
    """End to end: the global adapter is FedAvg's, bit for bit; each client's checkpointed
    adapter differs from it only in the classifier."""
    runs = {}
    for name in ("fedavg", "fedavg_la"):
        exp = Experiment.build(tiny_config(f"algorithm.name={name}", output_dir=tmp_path / name))
        rundir = RunDir.create(tmp_path / name / "runs", name)
        runs[name] = (exp, rundir, simulate(exp, rundir))
    (_, plain, plain_summary), (exp, rundir, summary) = runs["fedavg"], runs["fedavg_la"]
    glob = load_params(rundir.checkpoints / "global.safetensors")
    assert identical(glob, load_params(plain.checkpoints / "global.safetensors"))
    assert summary["global"] == plain_summary["global"] and "personal" in summary
    for client in exp.clients:
        mine = load_params(
            rundir.checkpoints / "personal" / f"client_{client.client_id:03d}.safetensors"
        )
        assert all(torch.equal(mine[n], glob[n]) for n in glob if "classifier" not in n)


@needs_glue("STS-B")
def test_a_regression_task_is_refused_in_one_line_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "stsb.toml"
    config.write_text(tomli_w.dumps(tiny_raw('data.task="STS-B"', 'algorithm.name="fedavg_la"')))
    result = CliRunner().invoke(
        app, ["run", "--no-report", str(config), "--output-dir", str(tmp_path / "runs")],
        catch_exceptions=False,
    )
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: algorithm.name: fedavg_la"), lines
    assert "regression" in lines[0] and not (tmp_path / "runs").exists()


def test_client_level_dp_refuses_it_the_counts_are_not_noised() -> None:
    raw = tiny_raw('algorithm.name="fedavg_la"', 'privacy.level="client"',
                   "privacy.noise_multiplier=1.0")
    with pytest.raises(ConfigError, match="label counts and validation NLL sums travel"):
        Experiment.build(validate(raw))

"""The label-prior oracle (``oracle_prior``) on tiny-bert and a small real MRPC subset:
centralized training, then each client's prior, by logit adjustment (the offset
log p_k − log p on the classifier's logits, the centralized model itself where p_k = p)
or by fine-tuning the head; what crosses (the pooled label counts, never a client's); and
its refusals (a regression task, the clients' data on their nodes)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import tomli_w
import torch
from conftest import identical, needs_glue, require_glue, tiny_config, tiny_raw
from typer.testing import CliRunner

from fedloom import algorithms
from fedloom.algorithms import ClientContext
from fedloom.algorithms.oracle import POOLED_COUNTS, TEMPERATURE, OraclePrior
from fedloom.cli import app
from fedloom.config import ConfigError, validate
from fedloom.evaluation.score import evaluate
from fedloom.experiment import Experiment
from fedloom.models.label_prior import COUNT_METRIC, label_counts, offset_logits
from fedloom.runtime.checkpoint import load_point
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate
from fedloom.train.passes import counting

BIAS = "classifier.bias"


@pytest.fixture(scope="module")
def tiny_exp(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    require_glue()
    return Experiment.build(tiny_config(output_dir=tmp_path_factory.mktemp("runs")))


def context(exp: Experiment, client: int, state: dict, train: list | None = None) -> ClientContext:
    c = exp.clients[client]
    return ClientContext(
        c.client_id, exp.model, c.train if train is None else train, exp.cfg.train, 0, 2, state, 5
    )


def trained_adapter(exp: Experiment) -> dict[str, torch.Tensor]:
    """The initial adapter with its head moved off its initial values (a model whose
    logits are not all alike)."""
    gen = torch.Generator().manual_seed(0)
    return {
        n: t + 0.5 * torch.randn(t.shape, generator=gen) if "lora_" not in n else t
        for n, t in exp.model.initial_params.items()
    }


# --- hyperparameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hp", "message"),
    [
        ({"ft_epochs": 2.0}, "algorithm.ft_epochs: only with prior = 'head_finetune'"),
        ({"prior": "head_finetune", "ft_epochs": 0.0}, "algorithm.ft_epochs: must be > 0"),
        ({"prior": "bayes"}, "algorithm.prior: expected one of 'logit_adjust', 'head_finetune'"),
    ],
)
def test_bad_hyperparameters_name_the_key(hp: dict, message: str) -> None:
    with pytest.raises(algorithms.AlgorithmError, match=message):
        algorithms.create("oracle_prior", **hp)


def test_it_pools_the_data_and_adjusts_logits() -> None:
    alg = algorithms.create("oracle_prior")
    assert alg.pools_data and alg.personalized and alg.has_global and alg.adjusts_logits


# --- logit adjustment ---------------------------------------------------------------------


@needs_glue
def test_a_client_with_the_pooled_prior_scores_as_the_centralized_model(
    tiny_exp: Experiment,
) -> None:
    adapter = trained_adapter(tiny_exp)
    client = tiny_exp.clients[0]
    ctx = context(tiny_exp, 0, {})
    counts = torch.tensor(label_counts(client.train, 2), dtype=torch.float32)
    scored = OraclePrior().evaluate_local(
        ctx, {**adapter, POOLED_COUNTS: counts}, {"test": client.test}, 32
    )
    assert scored is not None
    mine, scores = scored
    assert identical(mine, adapter)
    assert scores["test"] == evaluate(tiny_exp.model, adapter, client.test, 32)


@needs_glue
def test_the_offset_is_log_p_k_minus_log_p_on_a_hand_built_two_class_client(
    tiny_exp: Experiment,
) -> None:
    """Client labels (0, 0, 0, 1), pooled counts (10, 30): with add-one smoothing
    p_k = (4/6, 2/6) and p = (11/42, 31/42); the client's logits move by log p_k − log p,
    exactly what :func:`offset_logits` adds."""
    features = [dict(f, label=y) for f, y in zip(tiny_exp.clients[0].train[:4], (0, 0, 0, 1))]
    offset = np.log([4 / 6, 2 / 6]) - np.log([11 / 42, 31 / 42])
    adapter = trained_adapter(tiny_exp)
    ctx = context(tiny_exp, 0, {}, train=features)
    payload = {**adapter, POOLED_COUNTS: torch.tensor([10.0, 30.0])}
    mine = OraclePrior().client_adapter(ctx, payload)
    assert set(mine) == set(adapter)
    assert all(torch.equal(mine[n], adapter[n]) for n in adapter if n != BIAS)
    torch.testing.assert_close(
        mine[BIAS] - adapter[BIAS], torch.tensor(offset, dtype=torch.float32), rtol=0, atol=1e-6
    )
    # scoring the client's adapter = scoring the global one through the seam
    test, model = tiny_exp.clients[0].test, tiny_exp.model
    model.set_params(adapter)
    plain = model.predict_each(test, 32)
    with offset_logits(model, offset):
        seam = model.predict_each(test, 32)
    model.set_params(mine)
    moved = model.predict_each(test, 32)
    np.testing.assert_array_equal(moved[0], seam[0])
    np.testing.assert_allclose(moved[2], seam[2], rtol=1e-5, atol=1e-6)
    assert not np.allclose(seam[2], plain[2])  # the offset moved the losses


@needs_glue
def test_training_is_centralized_and_only_pooled_counts_cross(tmp_path: Path) -> None:
    """The oracle's global adapter is the centralized run's, bit for bit; the server gets
    the pooled label counts (kept in its checkpointed state) and the clients score the
    global adapter moved by their own offsets."""
    runs = {}
    for name in ("centralized", "oracle_prior"):
        exp = Experiment.build(tiny_config(f"algorithm.name={name}", output_dir=tmp_path / name))
        rundir = RunDir.create(tmp_path / name / "runs", name)
        runs[name] = (exp, rundir, simulate(exp, rundir))
    (_, central, central_summary), (exp, rundir, summary) = (
        runs["centralized"],
        runs["oracle_prior"],
    )
    glob = load_params(rundir.checkpoints / "global.safetensors")
    assert identical(glob, load_params(central.checkpoints / "global.safetensors"))
    assert summary["global"] == central_summary["global"]
    assert "personal" in summary and "personal" not in central_summary

    pooled = sum(label_counts(c.train, 2) for c in exp.clients)
    (state,) = load_point(rundir)[0].states.values()
    assert state.extra[POOLED_COUNTS].tolist() == pooled.tolist()
    for client in exp.clients:
        mine = load_params(
            rundir.checkpoints / "personal" / f"client_{client.client_id:03d}.safetensors"
        )
        assert all(torch.equal(mine[n], glob[n]) for n in glob if n != BIAS)
        own = label_counts(client.train, 2)
        offset = np.log((own + 1) / (own + 1).sum()) - np.log((pooled + 1) / (pooled + 1).sum())
        torch.testing.assert_close(
            mine[BIAS] - glob[BIAS], torch.tensor(offset, dtype=torch.float32), rtol=0, atol=1e-6
        )


@needs_glue
def test_the_party_reports_pooled_counts_and_trains_on_the_adapter_alone(
    tiny_exp: Experiment,
) -> None:
    alg = OraclePrior()
    state = alg.init(tiny_exp.model.initial_params)
    assert POOLED_COUNTS not in alg.payload(state, 0)  # nothing reported yet
    pooled = [f for c in tiny_exp.clients for f in c.train]
    ctx = context(tiny_exp, 0, {}, train=pooled)
    result = alg.local_train(ctx, alg.payload(state, 0))
    assert set(result.params) == set(tiny_exp.model.param_names)
    counts = label_counts(pooled, 2)
    assert [result.metrics[COUNT_METRIC.format(y)] for y in range(2)] == counts.tolist()
    assert result.metrics[TEMPERATURE] == 1.0  # no validation split to fit T on
    after = alg.aggregate(state, [result])
    payload = alg.payload(after, 0)
    assert payload[POOLED_COUNTS].tolist() == counts.tolist()
    assert payload[TEMPERATURE].tolist() == [1.0]
    assert set(payload) - {POOLED_COUNTS, TEMPERATURE} == set(tiny_exp.model.param_names)
    alg.local_train(ctx, payload)  # the counts and T are not model tensors: stripped
    # head_finetune needs no counts: none reported, none sent
    other = OraclePrior(prior="head_finetune")
    plain = other.local_train(context(tiny_exp, 0, {}, train=pooled), other.payload(state, 0))
    assert not any(k.startswith("label_count") for k in plain.metrics)
    assert POOLED_COUNTS not in other.payload(other.aggregate(state, [plain]), 0)


# --- head fine-tuning ---------------------------------------------------------------------


@needs_glue
def test_head_finetune_changes_only_the_head_and_never_the_state(tiny_exp: Experiment) -> None:
    alg = OraclePrior(prior="head_finetune", ft_epochs=1.0)
    adapter = trained_adapter(tiny_exp)
    state = {"optimizer": {"kept": torch.ones(2)}}
    ctx = context(tiny_exp, 2, state)
    before = copy.deepcopy(ctx.state)
    with counting() as counted:
        mine = alg.client_adapter(ctx, adapter)
    assert counted.passes == math.ceil(len(ctx.train) / ctx.settings.batch_size)
    assert identical(ctx.state, before)
    head = {n for n in adapter if "lora_" not in n}
    assert head and all(not torch.equal(mine[n], adapter[n]) for n in head)
    assert all(torch.equal(mine[n], adapter[n]) for n in adapter if n not in head)
    default = OraclePrior(prior="head_finetune")  # 5 passes, FedBABU's
    with counting() as counted:
        default.client_adapter(ctx, adapter)
    assert counted.passes == math.ceil(5 * len(ctx.train) / ctx.settings.batch_size)


# --- refusals -----------------------------------------------------------------------------


@needs_glue("STS-B")
@pytest.mark.parametrize("prior", ["logit_adjust", "head_finetune"])
def test_a_regression_task_is_refused_in_one_line_exit_2(tmp_path: Path, prior: str) -> None:
    config = tmp_path / "stsb.toml"
    config.write_text(
        tomli_w.dumps(
            tiny_raw(
                'data.task="STS-B"', 'algorithm.name="oracle_prior"', f'algorithm.prior="{prior}"'
            )
        )
    )
    result = CliRunner().invoke(
        app,
        ["run", "--no-report", str(config), "--output-dir", str(tmp_path / "runs")],
        catch_exceptions=False,
    )
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: algorithm.name: oracle_prior"), lines
    assert "regression" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_the_clients_data_on_their_nodes_is_refused() -> None:
    nodes = ('runtime.name="flower"', 'runtime.client_data="nodes"')
    with pytest.raises(ConfigError, match="algorithm.name: oracle_prior trains on every client"):
        Experiment.build(validate(tiny_raw(*nodes, 'algorithm.name="oracle_prior"')))


def test_shift_classifier_folds_both_deltas_and_refuses_a_verbalizer(
        tiny_exp: Experiment) -> None:
    """The fold FedRoD, FedDBE and the oracle share: (W + ΔW) z + (b + Δb), every other
    tensor untouched; a causal LM's verbalizer has no classifier to fold into."""
    from fedloom.models.label_prior import classifier_names, shift_classifier

    adapter = trained_adapter(tiny_exp)
    weight, bias = classifier_names(tiny_exp.model)
    assert bias == BIAS
    delta_w = torch.full_like(adapter[weight], 0.25)
    shifted = shift_classifier(tiny_exp.model, adapter, weight=delta_w, bias=np.array([1.0, -2.0]))
    assert all(torch.equal(shifted[n], adapter[n]) for n in adapter if n not in (weight, bias))
    torch.testing.assert_close(shifted[weight], adapter[weight] + 0.25)
    torch.testing.assert_close(shifted[bias], adapter[bias] + torch.tensor([1.0, -2.0]))
    assert shifted[bias].dtype == adapter[bias].dtype
    llama = Experiment.build(tiny_config('model.backbone="tiny-llama"'))
    with pytest.raises(ValueError, match="model.head: tiny-llama has no classifier layer"):
        shift_classifier(llama.model, llama.model.get_params(), bias=np.zeros(2))


@needs_glue
def test_the_party_fits_t_on_the_pooled_validation_split_and_clients_divide_by_it(
        tiny_exp: Experiment) -> None:
    """With the pooled validation split the party reports the T that
    :func:`fit_temperature` finds there (``calibrate = False``: 1); a client's adapter
    then gives log-softmax(z / T + log p_k − log p), z the global adapter's logits."""
    from fedloom.models.calibration import fit_temperature, held_out_log_probs

    pooled = [f for c in tiny_exp.clients for f in c.train]
    val = [f for c in tiny_exp.clients for f in c.test]  # held out from training
    alg = OraclePrior()
    state = alg.init(tiny_exp.model.initial_params)
    ctx = context(tiny_exp, 0, {}, train=pooled)
    ctx.val = val
    result = alg.local_train(ctx, alg.payload(state, 0))
    tiny_exp.model.set_params(result.params)
    # at the party's batch size: another pads the examples differently, which moves the
    # log-probabilities in the last float32 bits and the bounded fit within its tolerance
    expected = fit_temperature(*held_out_log_probs(tiny_exp.model, val, ctx.settings.batch_size))
    assert result.metrics[TEMPERATURE] == pytest.approx(expected, rel=1e-9)
    assert OraclePrior(calibrate=False).temperature(ctx, result.params) == 1.0
    # the fold: T = 2 and the hand-built prior of the offset test
    features = [dict(f, label=y) for f, y in zip(tiny_exp.clients[0].train[:4], (0, 0, 0, 1))]
    offset = np.log([4 / 6, 2 / 6]) - np.log([11 / 42, 31 / 42])
    adapter = trained_adapter(tiny_exp)
    payload = {**adapter, POOLED_COUNTS: torch.tensor([10.0, 30.0]),
               TEMPERATURE: torch.tensor([2.0])}
    mine = OraclePrior().client_adapter(context(tiny_exp, 0, {}, train=features), payload)
    test, model = tiny_exp.clients[0].test, tiny_exp.model
    model.set_params(adapter)
    z, _ = held_out_log_probs(model, test, 32)
    model.set_params(mine)
    moved, _ = held_out_log_probs(model, test, 32)
    want = torch.log_softmax(z.double() / 2 + torch.as_tensor(offset), -1)
    torch.testing.assert_close(moved.double(), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="algorithm.calibrate: only with prior"):
        OraclePrior(prior="head_finetune", calibrate=False)

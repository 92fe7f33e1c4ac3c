"""FedALA on tiny-bert and a small real MRPC subset: the adaptive local aggregation's weight
update and mixed model against a NumPy transcription, which tensors are mixed, the start
phase's stopping rule, what crosses the client/server boundary, the passes counted, the
refused hyperparameters and a resumed run's exactness."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import identical, needs_glue, require_glue, tiny_config

from fedloom import algorithms
from fedloom.algorithms import ClientContext
from fedloom.algorithms.fedala import LOCAL, WEIGHTS, FedALA, mix
from fedloom.experiment import Experiment
from fedloom.params import Params
from fedloom.runtime.client_state import load_client_state
from fedloom.runtime.rundir import RunDir, load_params
from fedloom.server import simulate
from fedloom.train.passes import counting

HEAD = ("classifier.weight", "classifier.bias")


@pytest.fixture(scope="module")
def tiny_exp(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    require_glue()
    return Experiment.build(tiny_config(output_dir=tmp_path_factory.mktemp("runs")))


def context(exp: Experiment, state: dict, round_: int = 0, **train: Any) -> ClientContext:
    client = exp.clients[0]
    settings = exp.cfg.train.model_copy(update=train)
    return ClientContext(
        client.client_id,
        exp.model,
        client.train,
        settings,
        round_,
        exp.cfg.federation.rounds,
        state,
        seed=7,
    )


def perturbed(params: Params, seed: int, scale: float = 1.0) -> Params:
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in params.items()}


# --- the defining update --------------------------------------------------------------------


def test_weight_update_and_mixed_model_match_numpy(tiny_exp: Experiment) -> None:
    """One batch (the whole client, s = 100 %), weights given (no start phase): one step of
    W ← clip(W − η ∇L(θ̂) ⊙ (θ_g − θ_k), 0, 1), θ̂ ← θ_k + (θ_g − θ_k) ⊙ W on the head,
    the global values on every LoRA tensor (top_blocks = 0)."""
    model = tiny_exp.model
    glob = perturbed(model.initial_params, seed=1, scale=0.05)
    local = {n: t for n, t in perturbed(model.initial_params, seed=2).items() if n in HEAD}
    weights = {n: torch.full_like(t, 0.5) for n, t in local.items()}
    eta = 20.0
    alg = FedALA(rand_percent=100.0, eta=eta)
    ctx = context(tiny_exp, {}, batch_size=64)
    with counting() as counted:
        mixed, learned, metrics = alg.local_aggregation(ctx, glob, local, weights)
    assert metrics["ala_epochs"] == 1 and counted.passes == 1

    # NumPy: the cross-entropy's gradient at θ̂ = θ_k + (θ_g − θ_k) ⊙ 0.5 from the pooled
    # representations (eval mode; the head does not change them)
    sample = alg.sample(ctx)
    assert len(sample) == len(ctx.train)
    model.set_params(glob)
    h = model.embed(sample, 64).astype(np.float64)
    y = np.eye(2)[[f["label"] for f in sample]]
    g_np = {n: glob[n].double().numpy() for n in HEAD}
    l_np = {n: local[n].double().numpy() for n in HEAD}
    start = {n: l_np[n] + (g_np[n] - l_np[n]) * 0.5 for n in HEAD}
    z = h @ start["classifier.weight"].T + start["classifier.bias"]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    grad = {"classifier.weight": (p - y).T @ h / len(h), "classifier.bias": (p - y).mean(0)}
    for n in HEAD:
        w = np.clip(0.5 - eta * grad[n] * (g_np[n] - l_np[n]), 0.0, 1.0)
        assert np.allclose(learned[n].numpy(), w, atol=1e-5), n
        assert np.allclose(mixed[n].numpy(), l_np[n] + (g_np[n] - l_np[n]) * w, atol=1e-5), n
    flat = np.concatenate([learned[n].numpy().ravel() for n in HEAD])
    assert (flat == 0).any() and (flat == 1).any() and ((flat > 0) & (flat < 1)).any()
    for n in glob:
        if n not in HEAD:
            assert torch.equal(mixed[n], glob[n]), n  # lower layers: the global values
    assert set(learned) == set(HEAD)


def test_mix_is_the_paper_formula_on_the_chosen_tensors_only() -> None:
    glob = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([5.0])}
    local = {"a": torch.tensor([3.0, 0.0])}
    out = mix(glob, local, {"a": torch.tensor([0.25, 1.0])})
    assert torch.equal(out["a"], torch.tensor([3.0 + (1 - 3) * 0.25, 2.0]))
    assert torch.equal(out["b"], glob["b"])


def test_the_higher_tensors_are_the_head_and_the_top_blocks(tiny_exp: Experiment) -> None:
    names = tiny_exp.model.param_names  # tiny-bert: blocks 0 and 1, LoRA in both
    assert FedALA().higher(names) == list(HEAD)
    top1 = set(FedALA(top_blocks=1).higher(names))
    assert top1 == {n for n in names if "layer.1." in n} | set(HEAD)
    assert set(FedALA(top_blocks=2).higher(names)) == set(names)
    FedALA(top_blocks=2).check_model(tiny_exp.model.initial_params)
    with pytest.raises(ValueError, match="algorithm.top_blocks: 3, but .* in 2 transformer"):
        FedALA(top_blocks=3).check_model(tiny_exp.model.initial_params)
    lora_only = {n: t for n, t in tiny_exp.model.initial_params.items() if n not in HEAD}
    with pytest.raises(ValueError, match="algorithm.top_blocks: 0 mixes the head alone"):
        FedALA().check_model(lora_only)


# --- the start phase ------------------------------------------------------------------------


def test_start_phase_runs_to_convergence_then_one_epoch(tiny_exp: Experiment) -> None:
    """Half of 16 examples in batches of 8: one pass an epoch, every one counted."""
    glob = perturbed(tiny_exp.model.initial_params, seed=3, scale=0.05)
    local = {n: t for n, t in perturbed(tiny_exp.model.initial_params, seed=4).items() if n in HEAD}
    ctx = context(tiny_exp, {}, batch_size=8)

    def epochs(alg: FedALA, weights: Params | None) -> int:
        with counting() as counted:
            _, _, metrics = alg.local_aggregation(ctx, glob, local, weights)
        assert counted.passes == metrics["ala_epochs"]
        return int(metrics["ala_epochs"])

    # a std below any threshold: stops as soon as num_pre_loss + 1 losses are recorded
    assert epochs(FedALA(rand_percent=50.0, threshold=1e9, num_pre_loss=3), None) == 4
    # never converged: the cap
    assert epochs(FedALA(rand_percent=50.0, threshold=0.0, max_start_epochs=6), None) == 6
    # after the start phase: one epoch whatever the threshold
    ones = {n: torch.ones_like(t) for n, t in local.items()}
    assert epochs(FedALA(rand_percent=50.0, threshold=0.0), ones) == 1


# --- the client's rounds ----------------------------------------------------------------------


def test_rounds_keep_the_personal_state_and_send_the_trained_adapter(
    tiny_exp: Experiment, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fedloom.algorithms.fedala as fedala_mod

    starts: list[Params] = []
    real = fedala_mod.train_locally

    def recording(ctx: ClientContext, *args: Any, **kwargs: Any) -> dict[str, float]:
        starts.append(ctx.model.get_params())
        return real(ctx, *args, **kwargs)

    monkeypatch.setattr(fedala_mod, "train_locally", recording)
    names = tiny_exp.model.param_names
    alg = FedALA(top_blocks=1, num_pre_loss=2, threshold=1e9)
    higher = alg.higher(names)
    state: dict[str, Any] = {}
    first = tiny_exp.model.initial_params
    steps = tiny_exp.cfg.train.local_steps
    # first participation: no model of its own, no ALA, FedAvg's local training
    with counting() as counted:
        r1 = alg.local_train(context(tiny_exp, state), first)
    assert counted.passes == steps and "ala_epochs" not in r1.metrics
    assert all(torch.equal(starts[0][n], first[n]) for n in names)
    assert set(r1.params) == set(names)
    assert set(state) == {"optimizer", LOCAL} and list(state[LOCAL]) == higher
    assert all(torch.equal(state[LOCAL][n], r1.params[n]) for n in higher)
    # second: the start phase (num_pre_loss + 1 epochs of 80 % of 16 examples in
    # batches of 8: 2 passes each), then training from θ̂
    glob = perturbed(first, seed=5, scale=0.01)
    before = copy.deepcopy(state[LOCAL])
    with counting() as counted:
        r2 = alg.local_train(context(tiny_exp, state, round_=1), glob)
    assert r2.metrics["ala_epochs"] == 3 and counted.passes == 3 * 2 + steps
    assert set(r2.params) == set(names)  # the trained adapter; W and θ_k stay home
    weights = state[WEIGHTS]
    assert list(weights) == higher
    assert all(((w >= 0) & (w <= 1)).all() for w in weights.values())
    assert any(((w > 0) & (w < 1)).any() for w in weights.values())
    expected = mix(glob, before, weights)
    assert all(torch.allclose(starts[1][n], expected[n], atol=1e-7) for n in names)
    assert all(torch.equal(starts[1][n], glob[n]) for n in names if n not in higher)
    assert all(torch.equal(state[LOCAL][n], r2.params[n]) for n in higher)


def test_the_client_adapter_is_the_mixture_and_leaves_the_state_alone(tiny_exp: Experiment) -> None:
    alg = FedALA()
    glob = perturbed(tiny_exp.model.initial_params, seed=6, scale=0.01)
    assert alg.client_adapter(context(tiny_exp, {}), glob) is glob  # nothing of its own yet
    local = {n: torch.zeros_like(glob[n]) for n in HEAD}
    weights = {n: torch.full_like(glob[n], 0.25) for n in HEAD}
    state = {LOCAL: local, WEIGHTS: weights}
    before = copy.deepcopy(state)
    adapter = alg.client_adapter(context(tiny_exp, state), glob)
    assert identical(state, before)
    for n in glob:
        assert torch.equal(adapter[n], glob[n] * 0.25 if n in HEAD else glob[n])


# --- hyperparameters ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hp", "key"),
    [
        ({"rand_percent": 0.0}, "rand_percent"),
        ({"rand_percent": 101}, "rand_percent"),
        ({"top_blocks": -1}, "top_blocks"),
        ({"eta": 0.0}, "eta"),
        ({"threshold": -0.1}, "threshold"),
        ({"num_pre_loss": 0}, "num_pre_loss"),
        ({"max_start_epochs": 0}, "max_start_epochs"),
        ({"eta": "big"}, "eta"),
    ],
)
def test_bad_hyperparameters_name_the_key(hp: dict[str, Any], key: str) -> None:
    with pytest.raises(algorithms.AlgorithmError, match=f"^algorithm.{key}: "):
        algorithms.create("fedala", **hp)


def test_defaults_are_the_papers() -> None:
    alg = algorithms.create("fedala")
    assert (alg.rand_percent, alg.top_blocks, alg.eta, alg.threshold, alg.num_pre_loss) == (
        80.0,
        0,
        1.0,
        0.01,
        10,
    )
    assert alg.personalized and alg.has_global


# --- a run: checkpoints and resume ------------------------------------------------------------


class Stop(Exception):
    """Stands for a crash."""


def _stop_in_round(round_: int):
    def hook(kind: str, done: int, total: int) -> None:
        if kind == "client" and done == 1 and hook.rounds == round_ - 1:
            raise Stop
        if kind == "round":
            hook.rounds = done

    hook.rounds = 0
    return hook


def _outputs(run: Path) -> tuple[list[str], dict]:
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("wall_seconds")
    return (run / "metrics.jsonl").read_text().splitlines(), summary


@needs_glue
def test_a_resumed_run_ends_as_the_uninterrupted_one(tmp_path: Path) -> None:
    cfg = tiny_config(
        "algorithm.name=fedala",
        "algorithm.num_pre_loss=2",
        "algorithm.threshold=1e9",
        "federation.rounds=3",
        output_dir=tmp_path,
    )
    whole = RunDir.create(tmp_path / "whole", cfg.name)
    exp = Experiment.build(cfg)
    simulate(exp, whole)
    broken = RunDir.create(tmp_path / "broken", cfg.name)
    with pytest.raises(Stop):  # in round 3, after its first client trained
        simulate(Experiment.build(cfg), broken, _stop_in_round(3))
    simulate(Experiment.build(cfg), RunDir(broken.path), resume=True)
    assert _outputs(broken.path) == _outputs(whole.path)
    # each client's state holds θ_k's head and W; its personal checkpoint is their mixture
    glob = load_params(whole.checkpoints / "global.safetensors")
    for cid in range(3):
        file = f"client_{cid:03d}.safetensors"
        state = load_client_state(whole.checkpoints / "clients" / file)
        assert set(state[LOCAL]) == set(state[WEIGHTS]) == set(HEAD)
        mine = load_params(whole.checkpoints / "personal" / file)
        assert all(torch.equal(mine[n], mix(glob, state[LOCAL], state[WEIGHTS])[n]) for n in glob)
    rows = [json.loads(line) for line in whole.metrics_path.read_text().splitlines()]
    passes = [r["train_passes"] for r in rows if r.get("scope") == "train"]
    # round 1: FedAvg's 2 steps; round 2: the start phase (3 epochs of 12 examples in
    # batches of 8) and 2 steps; round 3: one epoch and 2 steps
    assert passes == [{str(c): p for c in range(3)} for p in (2.0, 3 * 2 + 2.0, 2 + 2.0)]

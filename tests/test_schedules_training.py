"""Learning-rate schedules on the global clock, steps per round, and local training
(loss goes down, gradient accumulation, optimizer state, divergence)."""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import pytest
import torch
from conftest import identical

import fedloom.train.local as local_mod
from fedloom.algorithms import ClientContext
from fedloom.config import LoraConfig, ModelConfig, TrainConfig
from fedloom.data import Example, get_task
from fedloom.models.fedmodel import FedModel
from fedloom.train.local import build_optimizer, steps_per_round, train_locally
from fedloom.train.schedules import lr_factor

# --- lr_factor ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "pos", "expected"),
    [
        # total = 110, warmup = 10: warm-up factors (pos + 1) / 10
        ("linear", 0, 0.1),
        ("linear", 4, 0.5),
        ("linear", 9, 1.0),
        ("linear", 10, 1.0),  # decay starts at the end of warm-up
        ("linear", 60, 0.5),  # midpoint of the decay: (60 - 10) / 100
        ("linear", 109, 0.01),
        ("linear", 110, 0.0),  # the end
        ("linear", 500, 0.0),  # clamped past the end
        ("cosine", 0, 0.1),
        ("cosine", 10, 1.0),
        ("cosine", 35, 0.5 * (1 + math.cos(math.pi * 0.25))),
        ("cosine", 60, 0.5),
        ("cosine", 110, 0.0),
        ("constant", 0, 0.1),
        ("constant", 9, 1.0),
        ("constant", 60, 1.0),
        ("constant", 110, 1.0),
    ],
)
def test_lr_factor_hand_computed(schedule: str, pos: int, expected: float) -> None:
    assert lr_factor(schedule, pos, total=110, warmup=10) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("pos", "warmup", "expected"),
    [
        (0, 4, 0.25),  # (0 + 1) / 4
        (1, 4, 0.5),
        (3, 4, 1.0),  # the peak, normalized to 1
        (15, 4, 0.5),  # sqrt(4 / 16)
        (63, 4, 0.25),  # sqrt(4 / 64)
        (0, 0, 1.0),  # no warm-up: w = 1
        (3, 0, 0.5),  # sqrt(1 / 4)
    ],
)
def test_noam_hand_computed(pos: int, warmup: int, expected: float) -> None:
    assert lr_factor("noam", pos, total=100, warmup=warmup) == pytest.approx(expected)


def test_no_warmup_starts_at_full_rate() -> None:
    assert lr_factor("linear", 0, total=10, warmup=0) == 1.0
    assert lr_factor("linear", 5, total=10, warmup=0) == pytest.approx(0.5)
    assert lr_factor("cosine", 0, total=10, warmup=0) == 1.0


def test_unknown_schedule() -> None:
    with pytest.raises(ValueError, match=r"^train\.schedule: unknown schedule 'step'"):
        lr_factor("step", 20, total=100, warmup=10)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant", "noam"])
def test_schedule_is_continuous_across_rounds(schedule: str) -> None:
    """pos = round * steps + step: the first step of round r + 1 continues where the
    last step of round r left off (no restart of warm-up or decay per round)."""
    steps, rounds = 7, 5
    total, warmup = steps * rounds, 3
    factors = [
        lr_factor(schedule, r * steps + s, total, warmup) for r in range(rounds) for s in range(steps)
    ]
    assert factors[:warmup] == pytest.approx([1 / 3, 2 / 3, 1.0])  # warm-up only once
    after = factors[warmup:]
    if schedule != "constant":
        assert all(a > b for a, b in itertools.pairwise(after))  # strictly decaying, no restart
    if schedule != "noam":
        # steady: no step (within or across rounds) moves by more than the steepest slope
        slope = (math.pi / 2 if schedule == "cosine" else 1.0) / (total - warmup)
        assert max(abs(a - b) for a, b in itertools.pairwise(after)) <= slope + 1e-12
    for r in range(1, rounds):  # at each round boundary
        last, first = factors[r * steps - 1], factors[r * steps]
        assert first <= last


# --- steps_per_round ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("train", "n", "expected"),
    [
        ({"local_steps": 5}, 1000, 5),
        ({"local_steps": 5, "batch_size": 1, "grad_accum": 4}, 3, 5),
        ({"local_epochs": 1, "batch_size": 8}, 20, 3),  # ceil(20 / 8)
        ({"local_epochs": 1, "batch_size": 8, "grad_accum": 2}, 20, 2),  # ceil(20 / 16)
        ({"local_epochs": 0.5, "batch_size": 8}, 20, 2),  # ceil(10 / 8)
        ({"local_epochs": 2, "batch_size": 8}, 16, 4),
        ({"local_epochs": 1, "batch_size": 32}, 1, 1),
        ({"local_epochs": 0.01, "batch_size": 32}, 10, 1),  # at least one step
    ],
)
def test_steps_per_round(train: dict, n: int, expected: int) -> None:
    assert steps_per_round(TrainConfig(**train), n) == expected


# --- local training -----------------------------------------------------------------------

SST2 = get_task("SST-2")
POSITIVE = ["good great wonderful", "a truly great film", "wonderful and good", "great fun",
            "good acting and a great story", "simply wonderful"]
NEGATIVE = ["bad awful terrible", "a truly awful film", "terrible and bad", "awful boredom",
            "bad acting and a terrible story", "simply terrible"]


def synthetic() -> list[Example]:
    out = []
    for p, n in zip(POSITIVE, NEGATIVE):
        out += [Example(p, None, 1), Example(n, None, 0)]
    return out


def tiny_bert(dropout: float = 0.1, seed: int = 0) -> FedModel:
    cfg = ModelConfig(backbone="tiny-bert", head_dropout=dropout, lora=LoraConfig(r=4, dropout=dropout),
                      precision="fp32")
    model = FedModel.build(cfg, SST2, max_length=32, seed=seed)
    if dropout == 0.0:
        # the backbone's own dropout (BERT's hidden/attention dropout, 0.1) is active in
        # training mode too; switch it off for exact comparisons
        for module in model.head.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return model


def context(model: FedModel, features: list, settings: TrainConfig, round_: int = 0,
            total_rounds: int = 1, state: dict | None = None, seed: int = 123) -> ClientContext:
    return ClientContext(
        client_id=4, model=model, train=features, settings=settings, round=round_,
        total_rounds=total_rounds, state={} if state is None else state, seed=seed,
    )


def test_train_locally_lowers_the_training_loss() -> None:
    model = tiny_bert()
    features = model.encode(synthetic())
    settings = TrainConfig(local_steps=5, batch_size=6, lr=5e-3, schedule="constant", warmup_ratio=0)
    _, _, before = model.predict(features, 16)
    state: dict = {}
    losses = []
    for r in range(4):
        metrics = train_locally(context(model, features, settings, r, 4, state, seed=r))
        assert metrics["local_steps"] == 5
        losses.append(metrics["train_loss"])
    _, _, after = model.predict(features, 16)
    assert after < 0.5 * before, (before, after)
    assert losses[-1] < losses[0]
    assert "optimizer" in state


def test_train_locally_only_changes_the_adapter() -> None:
    model = tiny_bert()
    frozen = {n: p.detach().clone() for n, p in model.head.named_parameters() if not p.requires_grad}
    start = model.get_params()
    features = model.encode(synthetic())
    train_locally(context(model, features, TrainConfig(local_steps=2, batch_size=4)))
    after = model.get_params()
    assert any(not torch.equal(after[n], start[n]) for n in start)
    now = dict(model.head.named_parameters())
    assert all(torch.equal(now[n], v) for n, v in frozen.items())


def test_train_locally_uses_the_global_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    real = lr_factor

    def spy(schedule: str, pos: int, total: int, warmup: int) -> float:
        calls.append((pos, total, warmup))
        return real(schedule, pos, total, warmup)

    monkeypatch.setattr(local_mod, "lr_factor", spy)
    model = tiny_bert()
    features = model.encode(synthetic())
    settings = TrainConfig(local_steps=3, batch_size=4, warmup_ratio=0.2)
    state: dict = {}
    for r in range(3):
        train_locally(context(model, features, settings, r, 3, state))
    # round r step s -> position 3 r + s, out of 3 x 3 steps, warm-up int(0.2 * 9) = 1
    assert calls == [(pos, 9, 1) for pos in range(9)]


def test_schedule_scope_round_restarts_every_round(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    real = lr_factor

    def spy(schedule: str, pos: int, total: int, warmup: int) -> float:
        calls.append((pos, total, warmup))
        return real(schedule, pos, total, warmup)

    monkeypatch.setattr(local_mod, "lr_factor", spy)
    model = tiny_bert()
    features = model.encode(synthetic())
    settings = TrainConfig(local_steps=4, batch_size=4, warmup_ratio=0.25, schedule_scope="round")
    for r in range(2):
        train_locally(context(model, features, settings, r, 2))
    # each round is its own clock: positions 0..3 of 4, warm-up int(0.25 * 4) = 1
    assert calls == [(pos, 4, 1) for pos in range(4)] * 2


def test_train_locally_applies_the_scheduled_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[float]] = []
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append([g["lr"] for g in self.param_groups])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    model = tiny_bert()
    features = model.encode(synthetic())
    settings = TrainConfig(local_steps=2, batch_size=4, lr=1e-3, head_lr=1e-2, schedule="linear",
                           warmup_ratio=0)
    train_locally(context(model, features, settings, round_=1, total_rounds=2))
    # positions 2 and 3 of 4: factors 1 - 2/4 and 1 - 3/4
    assert seen == [pytest.approx([5e-4, 5e-3]), pytest.approx([2.5e-4, 2.5e-3])]


def test_build_optimizer_groups() -> None:
    model = tiny_bert()
    named = model.trainable_parameters()
    opt = build_optimizer(TrainConfig(lr=1e-3, head_lr=5e-3), named)
    assert isinstance(opt, torch.optim.AdamW)
    lora, head = opt.param_groups
    assert lora["lr"] == 1e-3 and head["lr"] == 5e-3
    assert {id(p) for p in lora["params"]} == {id(p) for n, p in named.items() if "lora_" in n}
    assert {id(p) for p in head["params"]} == {id(named["classifier.weight"]), id(named["classifier.bias"])}
    sgd = build_optimizer(TrainConfig(optimizer="sgd", lr=0.1), named)
    assert isinstance(sgd, torch.optim.SGD)
    assert [g["lr"] for g in sgd.param_groups] == [0.1, 0.1]  # head_lr defaults to lr


def one_sgd_step(model: FedModel, start: dict, features: list, batch_size: int, accum: int) -> dict:
    model.set_params(start)
    settings = TrainConfig(
        local_steps=1, batch_size=batch_size, grad_accum=accum, optimizer="sgd", momentum=0.0,
        weight_decay=0.0, lr=0.5, schedule="constant", warmup_ratio=0, clip_norm=0,
        optimizer_state="reset",
    )
    train_locally(context(model, features, settings, seed=7))
    return model.get_params()


def test_gradient_accumulation_matches_the_larger_batch() -> None:
    model = tiny_bert(dropout=0.0)
    g = torch.Generator().manual_seed(0)
    # non-zero B so that lora_A gets gradients too
    start = {n: torch.randn(p.shape, generator=g) * 0.2 for n, p in model.get_params().items()}
    # exactly one batch of 8: the same examples in the same order whichever way it is cut
    features = model.encode(synthetic()[:8])
    assert len({len(f["input_ids"]) for f in features}) > 1  # micro-batches pad differently

    big = one_sgd_step(model, start, features, batch_size=8, accum=1)
    accumulated = one_sgd_step(model, start, features, batch_size=4, accum=2)
    half = one_sgd_step(model, start, features, batch_size=4, accum=1)

    moved = [n for n in start if not torch.allclose(big[n], start[n], atol=1e-6)]
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)
    assert "classifier.weight" in moved
    for n in start:
        assert torch.allclose(accumulated[n], big[n], atol=1e-6, rtol=1e-4), n
    # and the comparison can tell batches apart: half of the batch is a different step
    assert any(not torch.allclose(half[n], big[n], atol=1e-5) for n in start)


def test_optimizer_state_persist_carries_over() -> None:
    model = tiny_bert()
    features = model.encode(synthetic())
    settings = TrainConfig(local_steps=3, batch_size=4, optimizer_state="persist")
    state: dict = {}
    train_locally(context(model, features, settings, 0, 2, state))
    assert "optimizer" in state
    first = state["optimizer"]
    assert {int(s["step"]) for s in first["state"].values()} == {3}
    train_locally(context(model, features, settings, 1, 2, state))
    # loaded and continued: AdamW's bias correction did not restart
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {6}


def test_a_round_never_accepted_leaves_the_saved_moments_as_they_were() -> None:
    """The host trains on a copy of the client's state and keeps it only when the server
    accepts the round; the moments loaded from the saved state must not be stepped in
    place (torch's load_state_dict keeps the tensors it is given)."""
    model = tiny_bert()
    features = model.encode(synthetic())
    settings = TrainConfig(local_steps=2, batch_size=4)
    saved: dict = {}
    train_locally(context(model, features, settings, 0, 2, saved))
    before = copy.deepcopy(saved["optimizer"])
    train_locally(context(model, features, settings, 1, 2, dict(saved)))  # never committed
    assert identical(saved["optimizer"], before)


def test_optimizer_state_reset_keeps_nothing() -> None:
    model = tiny_bert()
    features = model.encode(synthetic())
    settings = TrainConfig(local_steps=2, batch_size=4, optimizer_state="reset")
    state: dict = {}
    train_locally(context(model, features, settings, 0, 2, state))
    assert "optimizer" not in state


def test_reset_ignores_a_stored_optimizer_state() -> None:
    model = tiny_bert()
    features = model.encode(synthetic())
    persisted: dict = {}
    train_locally(context(model, features, TrainConfig(local_steps=2, batch_size=4), 0, 2, persisted))
    state = dict(persisted)
    # with "reset" a stored state is neither loaded nor updated
    train_locally(context(model, features, TrainConfig(local_steps=2, batch_size=4,
                                                       optimizer_state="reset"), 1, 2, state))
    assert state["optimizer"] is persisted["optimizer"]


def test_training_is_reproducible_for_a_seed() -> None:
    out = []
    for _ in range(2):
        model = tiny_bert(seed=1)
        features = model.encode(synthetic())
        metrics = train_locally(context(model, features, TrainConfig(local_steps=3, batch_size=4), seed=9))
        out.append((metrics, model.get_params()))
    (m1, p1), (m2, p2) = out
    assert m1 == m2
    assert all(torch.equal(p1[n], p2[n]) for n in p1)


def test_non_finite_loss_raises() -> None:
    model = tiny_bert()
    params = model.get_params()
    params["classifier.weight"] = torch.full_like(params["classifier.weight"], float("nan"))
    model.set_params(params)
    features = model.encode(synthetic())
    with pytest.raises(FloatingPointError, match="client 4: non-finite loss"):
        train_locally(context(model, features, TrainConfig(local_steps=2, batch_size=4)))


def test_no_training_examples() -> None:
    model = tiny_bert()
    with pytest.raises(ValueError, match="client 4: no training examples"):
        train_locally(context(model, [], TrainConfig(local_steps=1)))


def test_random_batching_draws_plain_random_batches() -> None:
    """``train.batching = "random"``: every epoch covers each example once, in batches
    whose members are not sorted by length across the epoch (the padding of random
    batches); ``"bucketed"`` sorts each window, so its batches pad less."""
    from fedloom.train.batching import client_batches

    lengths = np.random.default_rng(0).integers(5, 100, size=256)

    def epoch(batching: str) -> list[np.ndarray]:
        stream = client_batches(batching, lengths, 16, np.random.default_rng(1))  # type: ignore[arg-type]
        return [next(stream) for _ in range(16)]

    for batching in ("random", "bucketed"):
        assert sorted(np.concatenate(epoch(batching)).tolist()) == list(range(256))
    padded = {b: np.mean([lengths[ix].max() for ix in epoch(b)]) for b in ("random", "bucketed")}
    assert padded["bucketed"] < 0.7 * padded["random"]

"""SCAFFOLD, FedNova and FedSGD: validation, what travels, hand-computed server steps and
the learning-rate sum of SCAFFOLD's option II. (Convergence on quadratic clients is in
test_quadratic_convergence.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from fedloom import algorithms
from fedloom.algorithms import AlgorithmError, ClientContext, ClientResult, ServerState
from fedloom.algorithms.fednova import normalizer
from fedloom.algorithms.scaffold import DC, C
from fedloom.config import TrainConfig


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize(
    ("name", "hp", "key"),
    [
        ("scaffold", {"eta_g": 0.0}, "eta_g"),
        ("scaffold", {"num_clients": 0}, "num_clients"),
        ("fednova", {"eta_g": -1.0}, "eta_g"),
    ],
)
def test_bad_hyperparameter_names_the_key(name: str, hp: dict, key: str) -> None:
    with pytest.raises(AlgorithmError) as info:
        algorithms.create(name, **hp)
    assert str(info.value).startswith(f"algorithm.{key}: ")


def test_defaults() -> None:
    s = algorithms.create("scaffold")
    assert (s.eta_g, s.num_clients, s.weighting) == (1.0, None, "uniform")  # the paper's mean
    assert algorithms.create("fednova").eta_g == 1.0
    assert algorithms.create("fedsgd").weighting == "examples"


def test_scaffold_payload_carries_the_server_control_variate() -> None:
    alg = algorithms.create("scaffold")
    state = alg.init({"w": t(1.0, 2.0)})
    assert state.extra["c"]["w"].tolist() == [0.0, 0.0]
    payload = alg.payload(state, 3)
    assert set(payload) == {"w", C + "w"}


def test_scaffold_server_step_by_hand() -> None:
    alg = algorithms.create("scaffold", eta_g=0.5, num_clients=4)
    state = ServerState(2, {"w": t(1.0)}, extra={"c": {"w": t(0.25)}})
    results = [
        ClientResult(0, {"w": t(3.0), DC + "w": t(1.0)}, 10),
        ClientResult(1, {"w": t(5.0), DC + "w": t(-3.0)}, 30),
    ]
    new = alg.aggregate(state, results)
    # uniform: mean y = 4, x = 1 + 0.5 * (4 - 1); c = 0.25 + (2 / 4) * mean(1, -3)
    assert math.isclose(new.global_params["w"].item(), 2.5)
    assert math.isclose(new.extra["c"]["w"].item(), 0.25 + 0.5 * -1.0)
    assert set(new.global_params) == {"w"} and new.round == 3
    assert state.extra["c"]["w"].item() == 0.25  # pure


class Linear:
    """F(w) = <g, w>: constant gradient g, so SGD moves w by exactly -(sum of lrs) g."""

    device, precision = torch.device("cpu"), "fp32"  # FedModel's, as local training reads them

    def __init__(self, g: torch.Tensor) -> None:
        self.g = g
        self.w = torch.nn.Parameter(torch.zeros_like(g))
        self.head = type(
            "H", (), {"train": lambda self, mode=True: self, "collate": lambda self, f: None}
        )()

    def trainable_parameters(self) -> dict:
        return {"w": self.w}

    def set_params(self, p: dict) -> None:
        with torch.no_grad():
            self.w.copy_(p["w"])

    def get_params(self) -> dict:
        return {"w": self.w.detach().clone()}

    def loss(self, batch: object) -> torch.Tensor:
        return (self.g * self.w).sum()


def test_reported_lr_sums_are_the_rates_train_locally_applied() -> None:
    from fedloom.train.local import train_locally

    g = torch.tensor([1.0, -2.0], dtype=torch.float64)
    settings = TrainConfig(
        local_steps=4,
        batch_size=1,
        optimizer="sgd",
        momentum=0.0,
        lr=0.1,
        head_lr=0.3,
        weight_decay=0.0,
        schedule="linear",
        warmup_ratio=0.25,
        clip_norm=0.0,
    )
    model = Linear(g)
    ctx = ClientContext(0, model, [{"input_ids": [0]}], settings, 1, 3, {}, 0)  # type: ignore[arg-type]
    metrics = train_locally(ctx)
    applied = float(-model.w.detach()[0] / g[0])
    assert math.isclose(applied, metrics["lr_sum_head"], rel_tol=1e-9)
    # round 1 of 3, 4 steps each: positions 4..7 of 12, warm-up 3, linear decay over 9
    assert math.isclose(metrics["lr_sum_head"], 0.3 * (8 + 7 + 6 + 5) / 9, rel_tol=1e-12)
    constant = settings.model_copy(update={"schedule": "constant", "warmup_ratio": 0.0})
    model = Linear(g)
    ctx = ClientContext(0, model, [{"input_ids": [0]}], constant, 0, 3, {}, 0)  # type: ignore[arg-type]
    metrics = train_locally(ctx)
    assert math.isclose(metrics["lr_sum_head"], 4 * 0.3)  # "w" is not a LoRA factor
    assert "lr_sum_adapters" not in metrics  # no LoRA factor trained


def test_scaffold_client_sends_the_control_variate_change_and_keeps_its_own() -> None:
    g = torch.tensor([1.0, -2.0], dtype=torch.float64)
    settings = TrainConfig(
        local_steps=3,
        batch_size=1,
        optimizer="sgd",
        momentum=0.0,
        lr=0.1,
        weight_decay=0.0,
        schedule="constant",
        warmup_ratio=0.0,
        clip_norm=0.0,
    )
    alg = algorithms.create("scaffold")
    state: dict = {}
    c = torch.tensor([0.5, 0.5], dtype=torch.float64)
    payload = {"w": torch.zeros(2, dtype=torch.float64), C + "w": c}
    ctx = ClientContext(0, Linear(g), [{"input_ids": [0]}], settings, 0, 1, state, 0)  # type: ignore[arg-type]
    res = alg.local_train(ctx, payload)
    # corrected gradient g - c_i + c = g + c; three steps of 0.1
    assert torch.allclose(res.params["w"], -0.3 * (g + c))
    # option II: c_i+ = 0 - c + (x - y) / (3 * 0.1) = g: the client's true gradient
    assert torch.allclose(state["scaffold_c"]["w"].double(), g)
    assert torch.allclose(res.params[DC + "w"].double(), g)
    assert res.metrics["train_loss"] == pytest.approx(
        float(sum((g * (-0.1 * k * (g + c))).sum() for k in range(3)) / 3)
    )  # the correction adds nothing to the reported loss


def test_fednova_normalizer() -> None:
    assert normalizer(TrainConfig(optimizer="sgd", momentum=0.0), 5) == 5.0
    assert normalizer(TrainConfig(optimizer="adamw"), 7) == 7.0
    rho, tau = 0.9, 3
    # momentum SGD: a = (1, 1 + rho, 1 + rho + rho^2), ||a||_1 = 3 + 2 rho + rho^2
    assert math.isclose(
        normalizer(TrainConfig(optimizer="sgd", momentum=rho), tau), 3 + 2 * rho + rho**2
    )


def test_fednova_server_step_by_hand() -> None:
    alg = algorithms.create("fednova")
    state = ServerState(0, {"w": t(0.0)})
    results = [
        ClientResult(0, {"w": t(1.0)}, 10, {"fednova_a": 1.0, "train_loss": 0.0}),
        ClientResult(1, {"w": t(-5.0)}, 30, {"fednova_a": 5.0, "train_loss": 0.0}),
    ]
    new = alg.aggregate(state, results)
    # p = (1/4, 3/4); d = (-1, 1); tau_eff = 1/4 + 15/4 = 4; x = 0 - 4 * (-1/4 + 3/4)
    assert math.isclose(new.global_params["w"].item(), -2.0)
    # FedAvg would give 1/4 - 15/4 = -3.5: the five-step client dominates
    assert math.isclose(
        algorithms.create("fedavg").aggregate(state, results).global_params["w"].item(), -3.5
    )


# --- FedSGD over micro-batches --------------------------------------------------------------


class _PointsHead:
    training = True

    def train(self, mode: bool = True) -> _PointsHead:
        self.training = mode
        return self

    def collate(self, features: list) -> torch.Tensor:
        return torch.stack([f["x"] for f in features])


class _Points:
    """Per-example loss ½‖w − x_i‖², a batch's loss the mean over its examples: the
    full-data gradient is w − mean(x)."""

    device, precision = torch.device("cpu"), "fp32"  # FedModel's, as local training reads them

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        self.head = _PointsHead()

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {"w": self.w}

    def set_params(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.w.copy_(params["w"])

    def get_params(self) -> dict[str, torch.Tensor]:
        return {"w": self.w.detach().clone()}

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((self.w - batch) ** 2).sum(1).mean()


@pytest.mark.parametrize("batch_size", [1, 3, 4, 11, 64])
def test_fedsgd_takes_the_exact_full_batch_step_over_micro_batches(batch_size: int) -> None:
    """11 examples in micro-batches of 3 (3 + 3 + 3 + 2) or 4 (4 + 4 + 3): the step is
    still w − η (w − mean x), because accumulation weights micro-batches by size."""
    gen = torch.Generator().manual_seed(0)
    points = torch.randn(11, 3, generator=gen, dtype=torch.float64)
    model = _Points()
    settings = TrainConfig(local_steps=5, batch_size=batch_size, lr=0.3, schedule="constant",
                           warmup_ratio=0.0)
    ctx = ClientContext(0, model, [{"x": p, "input_ids": [0]} for p in points], settings,
                        0, 1, {}, seed=4)  # type: ignore[arg-type]
    w0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    result = algorithms.create("fedsgd").local_train(ctx, {"w": w0})
    expected = w0 - 0.3 * (w0 - points.mean(0))
    assert torch.allclose(result.params["w"], expected, atol=1e-12)
    assert result.metrics["local_steps"] == 1

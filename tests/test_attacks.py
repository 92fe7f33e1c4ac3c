"""``[attack]``: each attack's rule against a numpy transcription, the attackers' choice,
data poisoning on exactly the intended examples, the backdoor's attack-success rate, an
end-to-end tiny run per attack, and the refusals (exit 2, nothing written)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tomli_w
import torch
from conftest import needs_glue, tiny_config, tiny_raw
from scipy.stats import norm
from typer.testing import CliRunner

from fedloom.algorithms import ClientResult, sharing
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.ifca import IFCA
from fedloom.attacks import (
    ATTACKS,
    DATA_POISONING,
    MODEL_POISONING,
    Attack,
    RoundView,
    choose_attackers,
    create,
    z_max,
)
from fedloom.cli import app
from fedloom.config import AttackConfig, ConfigError, validate
from fedloom.data import ClientSplit, Example, get_task
from fedloom.experiment import Experiment
from fedloom.params import pack
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

RNG = np.random.default_rng(7)
SHAPES = {"a.lora_A": (4, 6), "a.lora_B": (6, 4), "head": (3,)}


def updates(k: int, scale: float = 1.0) -> list[dict[str, torch.Tensor]]:
    return [
        {n: torch.from_numpy(scale * RNG.standard_normal(s)) for n, s in SHAPES.items()}
        for _ in range(k)
    ]


def view(f: int = 2, benign: int = 5, weights: list[float] | None = None) -> RoundView:
    honest = dict(enumerate(updates(f)))
    others = updates(benign, 0.5)
    w = weights or [10.0] * (f + benign)
    return RoundView(honest, others, {c: w[c] for c in range(f + benign)}, seed=3)


def np_stack(ups: list[dict[str, torch.Tensor]], name: str) -> np.ndarray:
    return np.stack([u[name].numpy() for u in ups])


# --- each attack's rule -------------------------------------------------------------------


def test_registry_matches_the_config_names() -> None:
    names = AttackConfig.model_fields["name"].annotation.__args__
    assert set(names) == {"none", *ATTACKS}
    assert set(MODEL_POISONING) == {"sign_flip", "gaussian", "boosted", "alie", "ipm"}
    assert set(DATA_POISONING) == {"label_flip", "backdoor"}


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_sign_flip_reverses_and_scales(scale: float) -> None:
    v = view()
    out = create("sign_flip", scale=scale).forge(v)
    for cid, own in v.honest.items():
        for n in SHAPES:
            np.testing.assert_allclose(out[cid][n].numpy(), -scale * own[n].numpy())


def test_boosted_default_is_the_inverse_attacker_share() -> None:
    v = view(f=2, benign=5, weights=[10, 30, 20, 20, 10, 5, 5])
    out = create("boosted").forge(v)
    b = 100 / 40  # sum of all weights over the attackers' (clients 0 and 1)
    for cid, own in v.honest.items():
        for n in SHAPES:
            np.testing.assert_allclose(out[cid][n].numpy(), b * own[n].numpy())
    fixed = create("boosted", boost=10.0).forge(v)
    np.testing.assert_allclose(fixed[0]["head"].numpy(), 10 * v.honest[0]["head"].numpy())


def test_ipm_is_minus_epsilon_times_the_benign_mean() -> None:
    v = view()
    for eps, hp in ((0.1, {}), (100.0, {"epsilon": 100.0})):
        out = create("ipm", **hp).forge(v)
        for cid in v.honest:
            for n in SHAPES:
                want = -eps * np_stack(v.benign, n).mean(0)
                np.testing.assert_allclose(out[cid][n].numpy(), want)


@pytest.mark.parametrize(("n", "f"), [(50, 12), (50, 24), (20, 4), (20, 6), (7, 2), (3, 1)])
def test_alie_z_max_is_the_papers(n: int, f: int) -> None:
    s = max(1, math.floor(n / 2 + 1) - f)
    assert z_max(n, f) == pytest.approx(norm.ppf((n - s) / n), rel=1e-9)


def test_alie_z_max_values() -> None:
    assert z_max(50, 12) == pytest.approx(0.5828, abs=1e-4)  # s = 14: Φ⁻¹(0.72)
    assert z_max(50, 24) == pytest.approx(1.7507, abs=1e-4)  # s = 2: Φ⁻¹(0.96)
    assert z_max(20, 4) == pytest.approx(0.3853, abs=1e-4)  # s = 7: Φ⁻¹(0.65)


def test_alie_is_the_benign_mean_minus_z_std_for_every_attacker() -> None:
    v = view(f=3, benign=6)
    out = create("alie").forge(v)
    z = z_max(9, 3)
    for n in SHAPES:
        rows = np_stack(v.benign, n)
        want = rows.mean(0) - z * rows.std(0, ddof=1)
        for cid in v.honest:
            np.testing.assert_allclose(out[cid][n].numpy(), want, rtol=1e-12)
    fixed = create("alie", z=1.5).forge(v)
    rows = np_stack(v.benign, "head")
    np.testing.assert_allclose(fixed[2]["head"].numpy(), rows.mean(0) - 1.5 * rows.std(0, ddof=1))


def test_gaussian_is_seeded_noise_at_sigma_times_the_benign_rms() -> None:
    big = {"w": (200, 300)}
    honest = {0: {n: torch.zeros(s, dtype=torch.float64) for n, s in big.items()}}
    benign = [{"w": torch.from_numpy(0.01 * RNG.standard_normal(big["w"]))} for _ in range(4)]
    v = RoundView(honest, benign, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, seed=11)
    out = create("gaussian").forge(v)[0]["w"]
    rms = np.sqrt(np.mean(np_stack(benign, "w") ** 2))
    assert out.numpy().mean() == pytest.approx(0, abs=4 * 10 * rms / np.sqrt(60000))
    assert out.numpy().std() == pytest.approx(10 * rms, rel=0.02)
    again = create("gaussian").forge(v)[0]["w"]
    assert torch.equal(out, again)  # seeded by (seed, round, client)
    other = create("gaussian", sigma=2.0).forge(replace_seed(v, 12))[0]["w"]
    assert other.numpy().std() == pytest.approx(2 * rms, rel=0.02)
    assert not torch.allclose(other * 5, out)


def replace_seed(v: RoundView, seed: int) -> RoundView:
    return RoundView(v.honest, v.benign, v.weights, seed)


def test_attack_poison_acts_on_updates_from_the_start() -> None:
    """θ' = start + Δ' on each attacker's floating tensors, in θ's dtype; benign clients,
    non-floating tensors and rounds before start_round untouched."""
    starts = {c: {"w": torch.full((3,), 1.0), "b": torch.zeros(2)} for c in range(4)}
    thetas = {c: {"w": torch.full((3,), 1.0 + c), "b": torch.ones(2) * c} for c in range(4)}
    results = [
        ClientResult(c, {**thetas[c], "wire": torch.zeros(3, dtype=torch.uint8)}, 5)
        for c in range(4)
    ]
    attack = Attack(create("sign_flip", scale=2.0), attackers=(1, 3), start_round=2, seed=0)
    assert attack.poison(results, starts, 0) is results  # round 1 < start_round 2
    out = {r.client_id: r for r in attack.poison(results, starts, 1)}
    for c in (0, 2):
        assert out[c] is results[c]
    for c in (1, 3):
        assert torch.equal(out[c].params["w"], torch.full((3,), 1.0 - 2.0 * c))
        assert torch.equal(out[c].params["b"], -2.0 * c * torch.ones(2))
        assert out[c].params["w"].dtype == torch.float32
        assert torch.equal(out[c].params["wire"], results[c].params["wire"])
    assert attack.train_row(results, 1) == {"attackers": [1, 3]}
    assert attack.train_row(results, 0) == {"attackers": []}
    assert attack.needs_updates and not Attack(create("backdoor")).needs_updates


def test_a_boosted_data_poisoning_attacker_scales_its_own_update() -> None:
    """Model replacement: the backdoor's (or label flip's) trained update times b, the
    benign clients untouched; without ``boost`` the update is left as trained."""
    starts = {c: {"w": torch.full((3,), 1.0)} for c in range(3)}
    results = [ClientResult(c, {"w": torch.full((3,), 1.0 + 0.1 * (c + 1))}, 5) for c in range(3)]
    boosted = Attack(create("backdoor", boost=10.0), attackers=(2,), seed=0)
    assert boosted.needs_updates
    out = {r.client_id: r for r in boosted.poison(results, starts, 0)}
    assert out[0] is results[0] and out[1] is results[1]
    assert torch.allclose(out[2].params["w"], torch.full((3,), 1.0 + 10 * 0.3))
    plain = Attack(create("label_flip"), attackers=(2,), seed=0)
    assert plain.poison(results, starts, 0) is results
    with pytest.raises(ValueError, match=r"attack\.boost: must be > 0"):
        create("label_flip", boost=0.0)


def test_an_ifca_update_is_measured_from_the_cluster_it_trained() -> None:
    """IFCA sends every cluster down and one trained adapter up: its update is
    Δ = θ − θ_ĵ (ĵ the cluster the client chose), so the sign flip sends θ_ĵ − s·Δ."""
    clusters = [{"w": torch.full((3,), 1.0)}, {"w": torch.full((3,), 5.0)}]
    result = ClientResult(0, {"w": torch.full((3,), 6.0)}, 5, {"cluster": 1.0})
    start = IFCA(num_clusters=2).trained_from(pack(clusters), result)
    assert start.keys() == {"w"} and torch.equal(start["w"], clusters[1]["w"])
    assert FedAvg().trained_from(clusters[0], result) is clusters[0]
    attack = Attack(create("sign_flip", scale=2.0), attackers=(0,), seed=0)
    (out,) = attack.poison([result], {0: start}, 0)
    assert torch.equal(out.params["w"], torch.full((3,), 5.0 - 2.0 * 1.0))


@needs_glue
@pytest.mark.parametrize("method", ["ditto", "fedper", "ifca"])
def test_model_poisoning_of_a_personalized_method_forges_only_shared_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """The attack sees what the method sends (``ClientResult.params``: Ditto's global
    adapter, FedPer's LoRA factors without the personal head, IFCA's chosen cluster), each
    tensor with a start of its name and shape, the adapter its client trained it from."""
    seen: list[tuple[ClientResult, dict[str, torch.Tensor]]] = []
    poison = Attack.poison

    def spy(self: Attack, results: list[ClientResult], starts, round_: int):
        seen.extend((r, starts[r.client_id]) for r in results)
        return poison(self, results, starts, round_)

    monkeypatch.setattr(Attack, "poison", spy)
    cfg = tiny_config(
        f'algorithm.name="{method}"',
        'attack.name="sign_flip"',
        "attack.fraction=0.34",
        output_dir=tmp_path,
    )
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    simulate(Experiment.build(cfg), run)
    assert len(seen) == 6  # 3 clients, 2 rounds
    for result, start in seen:
        assert result.params
        assert all(start[n].shape == t.shape for n, t in result.params.items())
        assert method != "fedper" or not any(sharing.is_head(n) for n in result.params)


# --- who attacks ------------------------------------------------------------------------


def test_attackers_are_nested_across_fractions_and_reproducible() -> None:
    sets = [set(choose_attackers(20, k, seed=5)) for k in (2, 4, 6)]
    assert [len(s) for s in sets] == [2, 4, 6]
    assert sets[0] < sets[1] < sets[2]
    assert choose_attackers(20, 6, seed=5) == choose_attackers(20, 6, seed=5)
    assert choose_attackers(20, 6, seed=5) != choose_attackers(20, 6, seed=6)
    by_fraction = [
        Attack.from_config(
            validate(
                tiny_raw("partition.num_clients=20", 'attack.name="ipm"', f"attack.fraction={f}")
            )
        ).attackers
        for f in (0.1, 0.2, 0.3)
    ]
    assert [len(a) for a in by_fraction] == [2, 4, 6]
    assert set(by_fraction[0]) < set(by_fraction[1]) < set(by_fraction[2])
    named = Attack.from_config(validate(tiny_raw('attack.name="ipm"', "attack.clients=[2, 0]")))
    assert named.attackers == (0, 2)


# --- data poisoning -----------------------------------------------------------------------


def examples(n: int) -> list[Example]:
    return [Example(f"sentence {i} here", f"other {i}", i % 2) for i in range(n)]


def test_label_flip_flips_exactly_the_training_examples() -> None:
    mrpc = get_task("MRPC")
    split = ClientSplit(1, np.array([10, 12, 14, 16]), np.array([11, 13]))
    indices = np.concatenate([split.train, split.test])
    pool = examples(20)
    given = [pool[i] for i in indices]
    attack = Attack(create("label_flip"), attackers=(1,), seed=0)
    out = attack.poison_split(split, indices, given, mrpc)
    for i, (before, after) in zip(indices, zip(given, out)):
        if i in split.train:
            assert after.label == 1 - before.label and after.text_a == before.text_a
        else:
            assert after == before
    benign = ClientSplit(0, split.train, split.test)
    assert attack.poison_split(benign, indices, given, mrpc) == given


def test_backdoor_poisons_the_chosen_fraction() -> None:
    mrpc = get_task("MRPC")
    train = np.arange(0, 40)
    split = ClientSplit(2, train, np.arange(40, 50))
    pool = examples(50)
    attack = Attack(create("backdoor", poison_fraction=0.25, target=1), attackers=(2,), seed=3)
    out = attack.poison_split(split, np.arange(50), pool, mrpc)
    changed = [i for i in range(50) if out[i] != pool[i]]
    triggered = [i for i in range(50) if out[i].text_a.startswith("cf ")]
    assert len(triggered) == 10 and all(i < 40 for i in triggered)  # 25 % of 40, train only
    assert set(changed) <= set(triggered)
    for i in triggered:
        assert out[i].text_a == "cf " + pool[i].text_a and out[i].label == 1
        assert out[i].text_b == pool[i].text_b
    again = attack.poison_split(split, np.arange(50), pool, mrpc)
    assert again == out  # seeded by (seed, client)


@needs_glue
def test_data_poisoning_reaches_the_encoded_training_split() -> None:
    clean = Experiment.build(tiny_config())
    flipped = Experiment.build(tiny_config('attack.name="label_flip"', "attack.clients=[1]"))
    for a, b in zip(clean.clients, flipped.clients):
        got = [f["label"] for f in b.train]
        want = [f["label"] for f in a.train]
        assert got == ([1 - y for y in want] if a.client_id == 1 else want)
        assert [f["label"] for f in b.test] == [f["label"] for f in a.test]


# --- the attack-success rate ------------------------------------------------------------


class StubModel:
    """Predicts ``rule(feature)``; encodes an example as its text and label."""

    def __init__(self, rule) -> None:
        self.rule, self.params = rule, None

    def encode(self, exs):
        return [{"text": e.text_a, "label": e.label} for e in exs]

    def set_params(self, params) -> None:
        self.params = params

    def predict_each(self, features, batch_size):
        preds = np.array([self.rule(f) for f in features])
        return preds, np.array([f["label"] for f in features]), np.zeros(len(features))


def test_asr_on_a_hand_built_case() -> None:
    dev = examples(10)  # labels 0,1,0,1,...
    attack = Attack(create("backdoor", target=0), attackers=(0,))
    always = attack.asr(StubModel(lambda f: 0), {}, dev, 4)
    assert always == {"backdoor_asr": 1.0}
    never = Attack(create("backdoor", target=0), attackers=(0,))
    assert never.asr(StubModel(lambda f: 1), {}, dev, 4) == {"backdoor_asr": 0.0}
    # scored on the 5 label-1 examples only, each with the trigger: sentences 1 and 3 flip
    some = Attack(create("backdoor", target=0), attackers=(0,))
    rule = lambda f: 0 if f["text"] in ("cf sentence 1 here", "cf sentence 3 here") else 1
    assert some.asr(StubModel(rule), {}, dev, 4) == {"backdoor_asr": pytest.approx(2 / 5)}
    assert Attack(create("label_flip")).asr(StubModel(rule), {}, dev, 4) == {}
    assert Attack(None).summary() == {} and Attack(None).train_row([], 0) == {}


# --- end to end ---------------------------------------------------------------------------


@needs_glue
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_tiny_run_with_each_attack(tmp_path: Path, name: str) -> None:
    cfg = tiny_config(f'attack.name="{name}"', "attack.fraction=0.34", output_dir=tmp_path)
    exp = Experiment.build(cfg)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    summary = simulate(exp, run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    train = [r for r in rows if r["scope"] == "train"]
    assert len(train) == 2 and all(r["attackers"] == list(exp.attack.attackers) for r in train)
    assert len(exp.attack.attackers) == 1  # ⌊0.34 · 3⌋
    assert summary["attack"]["name"] == name
    assert summary["attack"]["attackers"] == list(exp.attack.attackers)
    assert json.loads((run.path / "summary.json").read_text())["attack"]["name"] == name
    dev = [r for r in rows if r["scope"] == "global/dev"]
    if name == "backdoor":
        assert all(0 <= r["backdoor_asr"] <= 1 for r in dev)
        assert 0 <= summary["global"]["dev"]["backdoor_asr"] <= 1
    else:
        assert all("backdoor_asr" not in r for r in dev)


@needs_glue
def test_no_attack_writes_nothing_of_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    summary = simulate(Experiment.build(tiny_config("federation.rounds=1")), run)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert "attack" not in summary and all("attackers" not in r for r in rows)


# --- refusals -----------------------------------------------------------------------------

runner = CliRunner()


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (['attack.name="sign_flip"', "attack.fraction=1.0"], "attack.fraction:"),
        (['attack.name="sign_flip"', "attack.clients=[0, 1, 2]"], "leave no honest client"),
        (['attack.name="sign_flip"', "attack.clients=[5]"], "attack.clients: [5] are not clients"),
        (['attack.name="sign_flip"', "attack.fraction=0.1"], "attack.fraction: 0.1 of 3 clients"),
        (
            ['attack.name="sign_flip"', "attack.fraction=0.34", "attack.clients=[1]"],
            "attack.clients: set attack.fraction or attack.clients, not both",
        ),
        (['attack.name="sign_flip"'], "attack.fraction: attack sign_flip needs its attackers"),
        (['attack.name="trojan"', "attack.fraction=0.34"], "attack.name:"),
        (["attack.fraction=0.34"], 'attack.fraction: only with an attack (attack.name is "none")'),
        (
            ['attack.name="sign_flip"', "attack.fraction=0.34", "attack.sigma=1.0"],
            "attack.sigma: not a setting of attack sign_flip",
        ),
        (['attack.name="ipm"', "attack.fraction=0.34", "attack.epsilon=-1.0"], "attack.epsilon:"),
        (['attack.name="alie"', "attack.fraction=0.34", 'attack.z="big"'], "attack.z: expected"),
        (
            ['attack.name="label_flip"', "attack.fraction=0.34", 'data.task="STS-B"'],
            "attack.name: label_flip changes class labels; task STS-B is a regression",
        ),
        (
            ['attack.name="backdoor"', "attack.fraction=0.34", 'data.task="STS-B"'],
            "attack.name: backdoor changes class labels",
        ),
        (
            ['attack.name="backdoor"', "attack.fraction=0.34", "attack.target=2"],
            "attack.target: 2 is not a class of MRPC",
        ),
        (
            ['attack.name="ipm"', "attack.fraction=0.34", 'algorithm.name="local"'],
            "attack.name: ipm poisons the updates a method shares",
        ),
        (
            ['attack.name="alie"', "attack.fraction=0.34", 'algorithm.name="centralized"'],
            "attack.name: alie poisons the updates a method shares; algorithm.name = 'centralized'",
        ),
        (
            ['attack.name="backdoor"', "attack.fraction=0.34", "attack.start_round=2"],
            "attack.start_round: backdoor poisons the attacker's training data",
        ),
        (
            [
                'attack.name="backdoor"',
                "attack.fraction=0.34",
                "attack.boost=5.0",
                'algorithm.name="local"',
            ],
            "attack.name: backdoor poisons the updates a method shares",
        ),
        (
            ['attack.name="ipm"', "attack.fraction=0.34", "attack.start_round=3"],
            "attack.start_round: 3 is after the last round",
        ),
    ],
)
def test_refusals_exit_2_and_write_nothing(
    tmp_path: Path, overrides: list[str], fragment: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(tomli_w.dumps(tiny_raw()))
    args = ["run", str(path), "--output-dir", str(tmp_path / "runs")]
    for item in overrides:
        args += ["--set", item]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1
    assert not (tmp_path / "runs").exists()


def test_resolved_config_round_trips() -> None:
    """The run directory's config.toml (defaults spelled out) validates again."""
    from fedloom.config import to_toml_dict

    cfg = tiny_config('attack.name="gaussian"', "attack.fraction=0.34", "attack.sigma=3.0")
    again = validate(to_toml_dict(cfg))
    assert again.attack == cfg.attack and again.attack.hyperparameters == {"sigma": 3.0}
    assert validate(to_toml_dict(tiny_config())).attack.name == "none"
    with pytest.raises(ConfigError):
        validate(tiny_raw("attack.start_round=2"))


def test_needs_updates_marks_model_poisoning() -> None:
    """The predicate secure aggregation refuses by: the attacks on updates."""
    assert [n for n in ATTACKS if Attack(create(n)).needs_updates] == list(MODEL_POISONING)
    assert not Attack(None).needs_updates

"""One composition model (issue 67): each piece declares what it promises and needs, and
``check_composition`` refuses what cannot run together in one line naming both keys; a
new piece is checked by what it declares, without its name appearing in any list."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import tiny_raw

from fedloom import transforms
from fedloom.algorithms import Algorithm
from fedloom.algorithms.fedavg import FedAvg
from fedloom.algorithms.registry import declaring
from fedloom.attacks import ATTACKS
from fedloom.attacks.base import DataPoisoning, ModelPoisoning, RoundView
from fedloom.composition import check_composition
from fedloom.config import ConfigError, ExperimentConfig, validate
from fedloom.experiment import build_algorithm, keyed_chain
from fedloom.params import Params
from fedloom.privacy import sample_level
from fedloom.transforms.base import Stage, Transform


def refusal(*overrides: str) -> str:
    """The one-line refusal of the tiny config with ``overrides``, by the checks that run
    before any data is read."""
    with pytest.raises(ConfigError) as info:
        build_algorithm(validate(tiny_raw(*overrides)))
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- a new transform: refused by what it declares -----------------------------------------


@dataclass(frozen=True)
class Base64(Transform):
    """A new encoding nobody listed anywhere: it declares what it does."""

    name: ClassVar[str] = "base64"
    stage: ClassVar[Stage] = "compress"
    encodes_bytes: ClassVar[bool] = True


@dataclass(frozen=True)
class Rounding(Transform):
    """A new transform that declares nothing: it composes with everything."""

    name: ClassVar[str] = "rounding"
    stage: ClassVar[Stage] = "compress"


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The new transforms registered as any transform is, and nowhere else."""
    monkeypatch.setitem(transforms.TRANSFORMS, Base64.name, Base64)
    monkeypatch.setitem(transforms.TRANSFORMS, Rounding.name, Rounding)


@pytest.mark.usefixtures("registered")
@pytest.mark.parametrize(
    ("overrides", "other"),
    [
        (["secagg.protocol=secagg+"], "secagg.protocol = 'secagg+'"),
        (["secagg.protocol=ckks"], "secagg.protocol = 'ckks'"),
        (["privacy.level=client", "privacy.noise=client"], "privacy.noise = 'client'"),
    ],
)
def test_a_new_encoding_is_refused_by_its_declaration(overrides: list[str], other: str) -> None:
    message = refusal(*overrides, "transforms=[{name = 'base64'}]")
    assert message.startswith("transforms[0].name: base64 encodes the update as bytes"), message
    assert other in message
    build_algorithm(validate(tiny_raw(*overrides, "transforms=[{name = 'rounding'}]")))


@pytest.mark.usefixtures("registered")
def test_a_new_encoding_is_refused_by_a_method_that_sends_its_own() -> None:
    message = refusal("algorithm.name=diana", "transforms=[{name = 'base64'}]")
    assert message.startswith("transforms[0].name: base64 encodes") and "'diana'" in message


# --- a new attack: refused by what it declares --------------------------------------------


@dataclass(frozen=True)
class Mirror(ModelPoisoning):
    """A new attack on updates, in no list."""

    name: ClassVar[str] = "mirror"
    forges_updates: ClassVar[bool] = True

    def forge(self, view: RoundView) -> dict[int, Params]:
        return {cid: {n: -t for n, t in own.items()} for cid, own in view.honest.items()}


@dataclass(frozen=True)
class Typos(DataPoisoning):
    """A new attack on the attacker's data alone: it forges no update unless boosted."""

    name: ClassVar[str] = "typos"


def _check(cfg: ExperimentConfig, attack: ModelPoisoning | DataPoisoning) -> None:
    algorithm: Any = build_algorithm(cfg)
    chain = keyed_chain(cfg, algorithm)
    check_composition(chain, algorithm, algorithm.rule, attack, cfg.faults, cfg.runtime)


def test_a_new_attack_on_updates_runs_under_secure_aggregation_and_not_on_flower() -> None:
    """Its attackers' clients send the forgery, so secure aggregation masks it like any
    update; a Flower node never sends an update the server hands it."""
    _check(validate(tiny_raw("secagg.protocol=secagg+")), Mirror())
    _check(validate(tiny_raw("secagg.protocol=secagg+")), Typos(boost=2.0))
    flower = validate(tiny_raw('runtime.name="flower"'))
    with pytest.raises(ValueError, match=r'^attack\.name: mirror has simulated .*"ray"\)'):
        _check(flower, Mirror())
    with pytest.raises(ValueError, match=r"^attack\.name: typos has simulated"):
        _check(flower, Typos(boost=2.0))
    _check(flower, Typos())


def test_every_registered_attack_declares_whether_it_forges_updates() -> None:
    forging = {name for name, cls in ATTACKS.items() if cls().forges_updates}
    assert forging == {"sign_flip", "gaussian", "boosted", "alie", "ipm"}
    assert all(cls(boost=2.0).forges_updates for cls in ATTACKS.values()
               if issubclass(cls, DataPoisoning))


# --- every refusal of before, through the config ------------------------------------------

ATTACK = ["attack.fraction=0.34"]


@pytest.mark.parametrize(
    ("overrides", "key", "other"),
    [
        # secure aggregation against the algorithm, the rule and the other stages
        (["secagg.protocol=secagg+", "algorithm.name=ifca", "algorithm.num_clusters=2"],
         "secagg.protocol", "algorithm.name = 'ifca'"),
        (["secagg.protocol=secagg+", "algorithm.name=scaffold"],
         "secagg.protocol", "algorithm.name = 'scaffold' (its control variates"),
        (["secagg.protocol=secagg+", "algorithm.name=fednova"], "secagg.protocol", "'fednova'"),
        (["secagg.protocol=secagg+", "aggregation.rule=median"],
         "aggregation.rule", "secagg.protocol = 'secagg+'"),
        (["secagg.protocol=secagg+", "aggregation.rule=krum"], "aggregation.rule", "secagg"),
        (["secagg.protocol=secagg+", "privacy.level=client", "privacy.noise_multiplier=0.5"],
         "privacy.noise", "secagg.protocol = 'secagg+'"),
        (["secagg.protocol=secagg+", 'transforms=[{name = "compress", compressor = "qsgd"}]'],
         "transforms[0].name", "secagg.protocol = 'secagg+'"),
        (["secagg.protocol=paillier", "transforms=[{name = 'half_precision'}]"],
         "transforms[0].name", "secagg.protocol = 'paillier'"),
        (["secagg.protocol=secagg+", "faults.garbage={1 = 'nan'}"],
         "faults.garbage", "secagg.protocol = 'secagg+'"),
        # client-level DP against the algorithm, the rule and the other stages
        (["privacy.level=client", "algorithm.name=fedmosaic"], "privacy.level", "'fedmosaic'"),
        (["privacy.level=client", "algorithm.name=feddbe"], "privacy.level", "'feddbe'"),
        (["privacy.level=client", "algorithm.name=fedavg_la"], "privacy.level", "'fedavg_la'"),
        (["privacy.level=client", "aggregation.rule=trimmed_mean"],
         "aggregation.rule", "privacy.level = 'client'"),
        (["privacy.level=client", "transforms=[{name = 'clip_update'}]"],
         "transforms[0].name", "privacy.level = 'client'"),
        (["privacy.level=client", "privacy.noise=client",
          'transforms=[{name = "compress", compressor = "qsgd"}]'],
         "transforms[0].name", "privacy.noise = 'client'"),
        # an encoding against a method that encodes its own messages
        (['transforms=[{name = "compress", compressor = "topk"}]', "algorithm.name=ef21"],
         "transforms[0].name", "algorithm.name = 'ef21'"),
        # an attack on updates against a method that sends none of its own
        (["attack.name=ipm", *ATTACK, "algorithm.name=local"], "attack.name", "'local'"),
        (["attack.name=backdoor", "attack.boost=5.0", *ATTACK, "algorithm.name=local"],
         "attack.name", "'local'"),
        (["attack.name=sign_flip", *ATTACK, "algorithm.name=centralized"],
         "attack.name", "'centralized'"),
        (["attack.name=gaussian", *ATTACK, "algorithm.name=diana"], "attack.name", "'diana'"),
        # simulated attackers send their forgeries in the simulator, not from Flower nodes
        (['runtime.name="flower"', "attack.name=alie", *ATTACK], "attack.name", "Flower node"),
        # the server of own-data nodes holds no client data
        (['runtime.name="flower"', 'runtime.client_data="nodes"', "aggregation.rule=fltrust"],
         "aggregation.rule", 'runtime.client_data = "nodes"'),
        (['runtime.name="flower"', 'runtime.client_data="nodes"', "algorithm.name=oracle_prior"],
         "algorithm.name", 'runtime.client_data = "nodes"'),
    ],
)
def test_what_cannot_run_together_is_refused_naming_both_keys(
    overrides: list[str], key: str, other: str
) -> None:
    message = refusal(*overrides)
    assert message.startswith(f"{key}: "), message
    assert other in message, message


@pytest.mark.parametrize(
    "overrides",
    [
        # the simulated attackers send their forgeries through the chain's client half
        ["privacy.level=client", "privacy.noise_multiplier=1.0", "attack.name=boosted", *ATTACK],
        ["secagg.protocol=secagg+", "attack.name=alie", *ATTACK],
        ["secagg.protocol=secagg", "attack.name=backdoor", "attack.boost=3.0", *ATTACK],
        ["privacy.level=client", "attack.name=backdoor", "attack.boost=10.0", *ATTACK],
        ["privacy.level=client", "privacy.noise=client", "transforms=[{name = 'half_precision'}]"],
        ["secagg.protocol=secagg+", "privacy.level=client", "privacy.noise=client"],
        ["secagg.protocol=secagg+", "transforms=[{name = 'clip_update'}]"],
        ["secagg.protocol=secagg+", "attack.name=label_flip", *ATTACK],
        ['transforms=[{name = "compress", compressor = "qsgd"}]', "attack.name=alie", *ATTACK],
        ["transforms=[{name = 'half_precision'}]", "algorithm.name=diana"],
        ["privacy.level=client", "algorithm.name=ditto"],
    ],
)
def test_what_composes_is_accepted(overrides: list[str]) -> None:
    build_algorithm(validate(tiny_raw(*overrides)))


def test_the_stages_are_keyed_by_the_setting_that_put_them_there() -> None:
    cfg = validate(tiny_raw("privacy.level=client", "privacy.noise=client",
                            "secagg.protocol=secagg+", "transforms=[{name = 'half_precision'}]"))
    assert [(k.transform.name, k.key, k.value) for k in keyed_chain(cfg)] == [
        ("dp_fedavg", "privacy.level", "client"),
        ("half_precision", "transforms[0].name", "half_precision"),
        ("client_noise", "privacy.noise", "client"),
        ("secure_sum", "secagg.protocol", "secagg+"),
    ]


def test_an_algorithm_is_a_mean_only_where_it_says_so() -> None:
    assert Algorithm.not_a_mean is not None  # a new method is not assumed to be one
    cfg = validate(tiny_raw())
    assert build_algorithm(cfg).not_a_mean is None  # fedavg


def test_dp_sgd_covers_only_a_method_that_declares_its_own_client_step() -> None:
    """A subclass of a covered method (FedAvg) that changes the client step is not covered
    until it says so for itself: the declaration is not inherited."""

    @dataclass(frozen=True)
    class Proximal(FedAvg):
        mu: float = 0.1

    @dataclass(frozen=True)
    class Declared(FedAvg):
        per_example_client_step: ClassVar[bool] = True

    cfg = validate(tiny_raw("privacy.level='sample'", "privacy.noise_multiplier=1.0"))
    with pytest.raises(ValueError, match="DP-SGD does not cover algorithm"):
        sample_level.check(cfg, Proximal())
    sample_level.check(cfg, Declared())
    sample_level.check(cfg, FedAvg())
    assert declaring("per_example_client_step") == sorted(
        ["fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi", "fedit", "ffa_lora",
         "fedavg_ft", "fedper", "fedrep", "lg_fedavg", "fedsa_lora", "local"])


# --- no module matches another's pieces by name -------------------------------------------


def test_no_module_matches_another_packages_transforms_or_attacks_by_name() -> None:
    """A name of a transform or an attack compared (==, !=, in) outside its own package is
    an exclusion by name, which a new piece would pass silently: declare a capability."""
    src = Path(__file__).parents[1] / "src" / "fedloom"
    names = {
        "transforms": {t.name for t in _subclasses(Transform)
                       if t.__module__.startswith("fedloom.")},
        "attacks": set(ATTACKS),
    }
    compared = re.compile(r"""(?:==|!=|\bin\b)\s*[(\[{]?\s*["']([a-z_0-9]+)["']"""
                          r"""|["']([a-z_0-9]+)["']\s*(?:==|!=|\bin\b)""")
    found = []
    for path in sorted(src.rglob("*.py")):
        package = path.relative_to(src).parts[0]
        text = path.read_text()
        if package != "attacks" and "MODEL_POISONING" in text:
            found.append(f"{path.name}: MODEL_POISONING")
        for m in compared.finditer(text):
            word = m.group(1) or m.group(2)
            found += [f"{path.name}: {word}" for owner, known in names.items()
                      if word in known and package != owner]
    assert not found


def _subclasses(cls: type) -> list[type]:
    return [s for c in cls.__subclasses__() for s in (c, *_subclasses(c))]

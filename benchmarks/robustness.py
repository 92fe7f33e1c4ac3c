"""Robustness: every ``[attack]`` against every ``[aggregation]`` rule, at 0/10/20/30 %
attackers, paired against the clean run of the same rule, seed and settings.

The federation: SST-2, 2,000 training examples over 20 IID MiniLM clients (100 each),
every client in every round, LoRA r = 4 in blocks 4 and 5 (the frozen prefix cached),
10 rounds of 5 local AdamW steps of batch 16 at lr 3e-3 (head 1e-2): the budget at which
FedAvg learns SST-2 in ``benchmarks/compression.py``. The attackers are the first
⌊fraction · 20⌋ of the seeded permutation (``attack.fraction``), so the 10 % attackers are
among the 20 % ones. Krum, Multi-Krum and Bulyan are told the number of attackers
(``aggregation.num_malicious_nodes = f``, the usual known-f assumption); a rule that cannot
take that f (Bulyan needs 20 ≥ 4f + 3) is recorded as refused. The other rules run at
their defaults (norm bounding and centered clipping at the round's median update norm)
unless ``--rule-setting`` says otherwise. FLTrust takes no f; its server holds 100 more
training examples as its clean root set (``aggregation.root_examples``, the paper's 100),
drawn before the partition, so its clients hold 2,000 examples as under the other rules
(not the same ones); its clean reference is its own clean run.

The clean reference of a row is the run with no attacker and the same rule settings and
seed, run as the backdoor at 0 % (no client is poisoned, so it is the clean run, and it
measures the clean model's attack-success rate, the backdoor's floor). Scores: the global
adapter's accuracy on 400 SST-2 dev examples, its paired difference from the clean run,
and for the backdoor its attack-success rate (the share of triggered dev examples of the
other class predicted as the target).

``--algorithm`` runs another method (e.g. ``ditto``; default ``fedavg``) at its own
defaults or at those ``--algorithm-setting ditto.lam=0.1`` sets, both recorded in each
row. A personalized method is scored on the adapters its clients use: the mean client
accuracy of summary.json's ``personal`` scope (each client's adapter on the dev set
weighted to its label mix, fedloom's default on this IID split) is the row's
``personal_clients``, and the table's score for it; ``global_dev`` stays the global
adapter's (None for a method without one). With a backdoor, ``personal_asr`` is the mean
attack-success rate of the benign clients' last personal adapters (the attackers' own:
``attackers_personal_asr``), measured on their checkpoints after the run, and the
table's ASR for such a method.

    python -m benchmarks.robustness                                   # the whole grid, seed 0
    python -m benchmarks.robustness --fractions 0.2 --seeds 0 1 2     # headline rows, 3 seeds
    python -m benchmarks.robustness --attacks backdoor --rules mean norm_bounding --seeds 0 1 2
    python -m benchmarks.robustness --table benchmarks/results/robustness.jsonl
    python -m benchmarks.robustness --algorithm ditto --fractions 0.2 --rules mean \
        --attacks sign_flip backdoor --attack-setting sign_flip.scale=10.0 \
        --attack-setting backdoor.boost=5.0 --out benchmarks/results/robustness_personal.jsonl
    python -m benchmarks.robustness --quick                           # a smoke run (tiny-bert)

Runs already in ``--out`` (by method and its settings, attack and its settings, fraction,
rule, settings, seed; a row without ``algorithm`` is FedAvg's) are skipped.
``--attack-setting sign_flip.scale=10.0`` sets an attack's hyperparameter; ``--device
cuda`` trains on a GPU (the 20 clients in one batched pass per round) and ``--shard I/N``
runs every N-th entry of the grid, so that N processes share it. The models run in fp32
on every device.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedloom.attacks import ATTACKS
from fedloom.config import ConfigError, validate

if TYPE_CHECKING:
    from fedloom.experiment import Experiment

GLUE = Path(
    os.environ.get(
        "FEDLOOM_GLUE_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
    )
)
RULES = [
    "mean",
    "median",
    "trimmed_mean",
    "krum",
    "bulyan",
    "centered_clipping",
    "norm_bounding",
    "fltrust",
]
#: FLTrust's root set (aggregation.root_examples' default, the paper's |D_0|)
ROOT_EXAMPLES = 100
#: the rules that take the number of Byzantine clients f
KNOW_F = {"krum", "multikrum", "bulyan"}
FRACTIONS = [0.1, 0.2, 0.3]
CLIENTS = 20


def config(
    attack: str,
    fraction: float,
    rule: str,
    seed: int,
    settings: dict[str, Any],
    quick: bool,
    device: str = "cpu",
    attack_settings: dict[str, Any] | None = None,
    algorithm: str = "fedavg",
    algorithm_settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    f = int(fraction * CLIENTS + 1e-9)
    # FLTrust's root set comes out of the training pool: the pool grows by it
    root = ROOT_EXAMPLES if rule == "fltrust" else 0
    raw: dict[str, Any] = {
        "name": f"robust-{attack}-{rule}-{seed}",
        "seed": seed,
        "data": {
            "task": "SST-2",
            "data_dir": str(GLUE),
            "max_train_examples": 2000 + root,
            "max_dev_examples": 400,
        },
        "partition": {"scheme": "iid", "num_clients": CLIENTS, "test_fraction": 0.1},
        "model": {
            "backbone": "minilm",
            "precision": "fp32",
            "prefix_cache": True,
            "lora": {"r": 4, "alpha": 8, "layers": [4, 5]},
        },
        "algorithm": {"name": algorithm, **(algorithm_settings or {})},
        "aggregation": {
            "rule": rule,
            **({"num_malicious_nodes": f} if rule in KNOW_F else {}),
            **settings,
        },
        "federation": {"rounds": 10},
        "train": {
            "local_steps": 5,
            "batch_size": 16,
            "lr": 3e-3,
            "head_lr": 1e-2,
            "device": device,
            # on a GPU the 20 clients train in one batched pass (the same steps)
            **({"clients_per_pass": CLIENTS} if device != "cpu" else {}),
        },
        "eval": {"every": 5, "others": "never"},
        # G² takes 2 extra passes per client and round, one client at a time, and does not
        # touch the training's random streams: off, the scores are the same
        "diagnostics": {"every": 0},
        "attack": {"name": attack, "fraction": fraction, **(attack_settings or {})},
    }
    if quick:  # a smoke run: tiny-bert, two short rounds
        raw["data"].update(max_train_examples=300 + root, max_dev_examples=64, max_length=64)
        raw["partition"]["min_size"] = 5
        raw["model"] = {"backbone": "tiny-bert", "precision": "fp32"}
        raw["federation"]["rounds"] = 2
        raw["train"] = {"local_steps": 1, "batch_size": 8, "lr": 5e-3}
        raw["eval"]["every"] = 2
    return raw


def run_one(raw: dict[str, Any]) -> dict[str, Any]:
    """The run's scores, or why it was refused."""
    from fedloom.experiment import Experiment
    from fedloom.runtime.rundir import RunDir
    from fedloom.server import simulate

    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        raw = {**raw, "output_dir": tmp}
        try:
            exp = Experiment.build(validate(raw))
        except ConfigError as err:
            return {"refused": str(err)}
        run = RunDir(Path(tmp) / "run")
        run.path.mkdir()
        summary = simulate(exp, run)
        rows = [json.loads(x) for x in run.metrics_path.read_text().splitlines()]
        attackers = summary.get("attack", {}).get("attackers", [])
        personal: dict[str, Any] = {}
        if exp.algorithm.personalized:
            personal = {
                "personal_clients": summary["personal"]["clients"]["accuracy"]["mean"],
                **personal_asr(exp, run.checkpoints / "personal", attackers),
            }
    dev = summary.get("global", {}).get("dev", {})
    return {
        "attackers": attackers,
        "global_dev": dev.get("accuracy"),
        **({"backdoor_asr": dev["backdoor_asr"]} if "backdoor_asr" in dev else {}),
        **personal,
        "attacked_rounds": sum(1 for r in rows if r["scope"] == "train" and r.get("attackers")),
        "wall_seconds": round(time.perf_counter() - began, 1),
    }


def personal_asr(exp: Experiment, folder: Path, attackers: list[int]) -> dict[str, float]:
    """The backdoor's mean attack-success rate over the benign clients' personal adapters
    in ``folder`` (their last checkpoints), ``personal_asr``, and over the attackers' own,
    ``attackers_personal_asr``; empty without a backdoor."""
    from fedloom.attacks.backdoor import Backdoor
    from fedloom.runtime.rundir import load_checkpoint

    if not isinstance(exp.attack.operator, Backdoor):
        return {}
    rates: dict[bool, list[float]] = {False: [], True: []}
    for path in sorted(folder.glob("client_*.safetensors")):
        params, meta = load_checkpoint(path)
        got = exp.attack.asr(exp.model, params, exp.data.dev, exp.cfg.eval.batch_size)
        if got.get("backdoor_asr") is not None:
            rates[int(meta["client_id"]) in attackers].append(got["backdoor_asr"])
    keys = {False: "personal_asr", True: "attackers_personal_asr"}
    return {keys[k]: statistics.mean(v) for k, v in rates.items() if v}


def _algorithm(row: dict[str, Any]) -> str:
    """The row's method with its settings, e.g. ``ditto lam=0.1`` (rows written before
    ``--algorithm`` are FedAvg's)."""
    extra = json.loads(row.get("algorithm_settings", "{}"))
    name = row.get("algorithm", "fedavg")
    return " ".join([name, *(f"{k}={v}" for k, v in sorted(extra.items()))])


def _score(row: dict[str, Any]) -> float:
    """What the row's method is scored by: its clients' mean personal accuracy for a
    personalized method, the global adapter's dev accuracy otherwise."""
    return float(row["personal_clients"] if "personal_clients" in row else row["global_dev"])


def _asr(row: dict[str, Any]) -> float:
    """The backdoor's success rate on what the row is scored by (:func:`_score`)."""
    return float(row["personal_asr"] if "personal_clients" in row else row["backdoor_asr"])


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (
        _algorithm(row),
        row["attack"],
        row.get("attack_settings", "{}"),
        row["fraction"],
        row["rule"],
        row["settings"],
        row["seed"],
    )


def _label(row: dict[str, Any]) -> str:
    """The attack with its non-default settings, e.g. ``sign_flip scale=10.0``."""
    extra = json.loads(row.get("attack_settings", "{}"))
    return " ".join([row["attack"], *(f"{k}={v}" for k, v in sorted(extra.items()))])


def run_missing(
    out: Path,
    attacks: list[str],
    fractions: list[float],
    rules: list[str],
    seeds: list[int],
    settings: dict[str, dict[str, Any]],
    quick: bool,
    device: str = "cpu",
    shard: tuple[int, int] = (0, 1),
    attack_settings: dict[str, dict[str, Any]] | None = None,
    algorithm: str = "fedavg",
    algorithm_settings: dict[str, Any] | None = None,
) -> None:
    """Every missing run of the grid with method ``algorithm``; with ``shard`` = (i, N)
    only the runs whose index in the grid is i mod N, so that N processes can share the
    grid."""
    done = {_key(r) for r in _rows(out)}
    method = (algorithm, algorithm_settings)
    index = -1
    for seed in seeds:
        for fraction in fractions:
            for rule in rules:
                own = dict(settings.get(rule, {}))
                f = int(fraction * CLIENTS + 1e-9)
                clean_settings = {**own, **({"num_malicious_nodes": f} if rule in KNOW_F else {})}
                runs = [("backdoor", 0.0, clean_settings)] + [(a, fraction, own) for a in attacks]
                for attack, frac, extra in runs:
                    hp = {} if frac == 0 else (attack_settings or {}).get(attack, {})
                    row = {
                        "algorithm": algorithm,
                        "algorithm_settings": json.dumps(algorithm_settings or {}, sort_keys=True),
                        "attack": "none" if frac == 0 else attack,
                        "attack_settings": json.dumps(hp, sort_keys=True),
                        "fraction": frac,
                        "rule": rule,
                        "settings": json.dumps(extra, sort_keys=True),
                        "seed": seed,
                        "quick": quick,
                    }
                    index += 1
                    if _key(row) in done or index % shard[1] != shard[0]:
                        continue
                    if frac == 0:  # the clean reference (any known f passed explicitly)
                        raw = config("backdoor", 0.0, rule, seed, extra, quick, device, {}, *method)
                    else:
                        raw = config(attack, frac, rule, seed, extra, quick, device, hp, *method)
                    row.update(run_one(raw))
                    done.add(_key(row))
                    with out.open("a", encoding="utf-8") as fh:
                        fh.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)


def _rows(out: Path) -> list[dict[str, Any]]:
    if not out.is_file():
        return []
    return [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines() if x.strip()]


def _cell(values: list[float], signed: bool = False) -> str:
    if not values:
        return "–"
    mean = 100 * statistics.mean(values)
    text = f"{mean:+.1f}" if signed else f"{mean:.1f}"
    return text + (f" ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else "")


def table(out: Path) -> str:
    """Accuracy (paired Δ vs the clean run of the same method) by attack × rule and
    fraction; the backdoor's attack-success rate by rule and fraction. Each row is scored by
    :func:`_score` (a personalized method on its personal adapters); with a method other
    than FedAvg in ``out`` the tables gain a method column."""
    rows = [r for r in _rows(out) if "refused" not in r]
    refused = [r for r in _rows(out) if "refused" in r]
    clean = {
        (_algorithm(r), r["rule"], r["settings"], r["seed"]): r
        for r in rows
        if r["attack"] == "none"
    }
    fractions = sorted({r["fraction"] for r in rows if r["fraction"] > 0})
    methods = list(dict.fromkeys(_algorithm(r) for r in rows))
    shown = methods != ["fedavg"]
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    attacks = list(dict.fromkeys(_label(r) for r in rows if r["attack"] != "none"))
    head = " | ".join(f"{round(100 * f)} %: acc. (Δ)" for f in fractions)
    lines = [
        f"| {'method | ' if shown else ''}attack | rule | clean acc. | {head} | seeds |",
        "|---" * shown + "|---|---|---:|" + "---:|" * len(fractions) + "---:|",
    ]
    for attack in attacks:
        for method in methods:
            for rule in rules:
                got = [
                    r
                    for r in rows
                    if _label(r) == attack and r["rule"] == rule and _algorithm(r) == method
                ]
                if not got:
                    continue
                cells, seeds = [], set()
                base = [_score(c) for k, c in clean.items() if k[:2] == (method, rule)]
                for f in fractions:
                    at = [r for r in got if r["fraction"] == f]
                    seeds |= {r["seed"] for r in at}
                    paired = [
                        _score(r) - _score(clean[_clean_key(r)])
                        for r in at
                        if _clean_key(r) in clean
                    ]
                    cells.append(
                        f"{_cell([_score(r) for r in at])} ({_cell(paired, signed=True)})"
                        if at
                        else "–"
                    )
                lines.append(
                    f"| {f'{method} | ' if shown else ''}{attack} | {rule} | {_cell(base)} | "
                    f"{' | '.join(cells)} | {len(seeds)} |"
                )
    backdoor = [r for r in rows if "backdoor_asr" in r or "personal_asr" in r]
    if backdoor:
        lines += ["", "Backdoor attack-success rate (%, 0 % = the clean model's floor):", ""]
        all_f = sorted({r["fraction"] for r in backdoor if r["attack"] in ("none", "backdoor")})
        lines.append(
            f"| {'method | ' if shown else ''}attack | rule | "
            + " | ".join(f"{round(100 * f)} %" for f in all_f)
            + " |"
        )
        lines.append("|---" * shown + "|---|---|" + "---:|" * len(all_f))
        for label in dict.fromkeys(_label(r) for r in backdoor if r["attack"] == "backdoor"):
            for method in methods:
                for rule in rules:
                    cells = [
                        _cell(
                            [
                                _asr(r)
                                for r in backdoor
                                if r["rule"] == rule
                                and _algorithm(r) == method
                                and r["fraction"] == f
                                and (f == 0 or _label(r) == label)
                            ]
                        )
                        for f in all_f
                    ]
                    if any(c != "–" for c in cells[1:]):
                        lines.append(
                            f"| {f'{method} | ' if shown else ''}{label} | {rule} | "
                            + " | ".join(cells)
                            + " |"
                        )
    if refused:
        lines += [
            "",
            "Refused: "
            + "; ".join(
                sorted(
                    {
                        f"{_algorithm(r) + ', ' if shown else ''}{r['rule']} at "
                        f"{round(100 * r['fraction'])} %: {r['refused']}"
                        for r in refused
                    }
                )
            ),
        ]
    return "\n".join(lines)


def _clean_key(row: dict[str, Any]) -> tuple[str, str, str, int]:
    """The key of ``row``'s clean reference in :func:`table`."""
    return (_algorithm(row), row["rule"], _clean_settings(row), row["seed"])


def _clean_settings(row: dict[str, Any]) -> str:
    """The settings of ``row``'s clean reference: its own, with the known f of its rule."""
    extra = json.loads(row["settings"])
    if row["rule"] in KNOW_F:
        extra["num_malicious_nodes"] = int(row["fraction"] * CLIENTS + 1e-9)
    return json.dumps(extra, sort_keys=True)


def _settings(items: list[str]) -> dict[str, dict[str, Any]]:
    """``name.key=value`` (a TOML value) -> {name: {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, value = item.split("=", 1)
        rule, name = key.split(".", 1)
        out.setdefault(rule, {})[name] = tomllib.loads(f"v = {value}")["v"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, help="print the table of this JSONL file")
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--rules", nargs="+", default=RULES, help="[aggregation] rule names")
    parser.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--rule-setting",
        action="append",
        default=[],
        metavar="RULE.KEY=VALUE",
        help="an [aggregation] setting for one rule, e.g. norm_bounding.max_norm=0.05",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: tiny-bert, 2 rounds, mean and median"
    )
    parser.add_argument(
        "--attack-setting",
        action="append",
        default=[],
        metavar="ATTACK.KEY=VALUE",
        help="an [attack] setting for one attack, e.g. sign_flip.scale=10.0",
    )
    parser.add_argument(
        "--algorithm",
        default="fedavg",
        help="algorithm.name, run at its own defaults (e.g. ditto); recorded in each row",
    )
    parser.add_argument(
        "--algorithm-setting",
        action="append",
        default=[],
        metavar="ALGORITHM.KEY=VALUE",
        help="an [algorithm] setting of --algorithm, e.g. ditto.lam=0.1",
    )
    parser.add_argument("--device", default="cpu", help="train.device (e.g. cuda)")
    parser.add_argument(
        "--shard", default="0/1", metavar="I/N", help="run only grid entries i mod N = I"
    )
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    if args.quick:
        args.out = args.out or Path("runs/robustness-quick.jsonl")
        if args.rules == RULES:
            args.rules = ["mean", "median"]
        if args.fractions == FRACTIONS:
            args.fractions = [0.2]
    out = args.out or Path("benchmarks/results/robustness.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    logging.disable(logging.INFO)
    run_missing(
        out,
        args.attacks,
        args.fractions,
        args.rules,
        args.seeds,
        _settings(args.rule_setting),
        args.quick,
        args.device,
        tuple(int(x) for x in args.shard.split("/")),  # type: ignore[arg-type]
        _settings(args.attack_setting),
        args.algorithm,
        _settings(args.algorithm_setting).get(args.algorithm, {}),
    )
    print(table(out), file=sys.stdout)


if __name__ == "__main__":
    main()

"""Record the golden results table, ``tests/golden/results.json``, that
``tests/test_golden_results.py`` keeps (issue 67, "What must not change").

The table holds, for each config of ``tests/golden/configs.py``, the rows of its run's
metrics.jsonl and the sha256 and float summaries of its checkpoints' tensors, with the
machine it was recorded on (torch version, CPU capability, threads: where they match,
the test asks for the same bytes).

Re-record only for a change of results that is explained: a config added, or a change
that is meant to change some configs' results (the configs marked ``expected_change``),
never to make a failing test pass. Name the configs and say why::

    # every config (run twice each, ~1 min): refused where the two runs differ
    .venv/bin/python tests/golden/record.py --reason "first recording, before issue 67"
    # only some, keeping the others as recorded
    .venv/bin/python tests/golden/record.py "client_dp_client_noise+sign_flip" \\
        --reason "issue 67: attacks act before the chain's client half"

The reason, the configs and the commit of the code they were recorded from go into the
table's ``history``. To record from another checkout (the code before a change), put its
``src`` first on the path: ``PYTHONPATH=/path/to/checkout/src .venv/bin/python ...``
(the script prints which fedloom it imported).

Re-recording some configs on a machine that differs from the table's (torch, CPU
capability, threads) is refused: their bytes would not be comparable with the others'.
Re-record them all there only from code that still passes the test on that machine
(``FEDLOOM_GOLDEN_TOLERANT=1``, compared within tolerance), or from the commit before the
change (see ``history``), so that the table goes on holding the results from before it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: conftest and golden.configs

from golden import configs

TABLE = HERE / "results.json"


def source() -> dict[str, Any]:
    """The fedloom the runs import, and the commit of its checkout (``dirty``: its ``src``
    differs from that commit)."""
    import fedloom

    src = Path(fedloom.__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(src), *args], capture_output=True, text=True, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    return {
        "fedloom": str(Path(fedloom.__file__).resolve().parent),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", ".")),
    }


def run_once(name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        return configs.record(configs.run(name, Path(tmp)))


def record_config(name: str, twice: bool) -> dict[str, Any]:
    started = time.perf_counter()
    golden = configs.CONFIGS[name]
    first = run_once(name)
    if twice:
        again = run_once(name)
        differ = configs.metrics_differences(first["metrics"], again["metrics"], golden.loose)
        differ += configs.checkpoint_differences(first["checkpoints"], again["checkpoints"], True)
        if differ:
            lines = "\n  ".join(differ[:20])
            raise SystemExit(
                f"{name}: two runs of the same config differ, not recorded:\n  {lines}"
            )
    print(f"  {name}: {time.perf_counter() - started:.1f}s", flush=True)
    return {
        "overrides": list(golden.overrides),
        "transforms": [dict(t) for t in golden.transforms],
        "faults": dict(golden.faults),
        "expected_change": golden.expected_change,
        "loose": dict(golden.loose),
        **first,
    }


# --- writing: one line per metrics row, checkpoint file and layout --------------------------


def _line(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _block(items: list[str], open_: str, close: str, indent: str) -> str:
    if not items:
        return open_ + close
    inner = ",\n".join(indent + "  " + item for item in items)
    return f"{open_}\n{inner}\n{indent}{close}"


def _dumps(value: Any, depth: int, indent: str = "") -> str:
    """``value`` as JSON, its containers spread over lines ``depth`` levels down, then
    each on one line."""
    if depth == 0 or not isinstance(value, (dict, list)) or not value:
        return _line(value)
    if isinstance(value, dict):
        items = [f"{_line(k)}: {_dumps(v, depth - 1, indent + '  ')}" for k, v in value.items()]
        return _block(items, "{", "}", indent)
    return _block([_dumps(v, depth - 1, indent + "  ") for v in value], "[", "]", indent)


def write(table: dict[str, Any], path: Path) -> None:
    parts = {
        "about": _dumps(table["about"], 1, "  "),
        "machine": _line(table["machine"]),
        "tiny": _line(table["tiny"]),
        "history": _dumps(table["history"], 1, "  "),
        "configs": _dumps(table["configs"], 3, "  "),
        "layouts": _dumps(table["layouts"], 1, "  "),
    }
    body = ",\n".join(f"  {_line(k)}: {v}" for k, v in parts.items())
    path.write_text("{\n" + body + "\n}\n")


ABOUT = [
    (
        "Golden results of issue 67: written by tests/golden/record.py, checked by "
        "tests/test_golden_results.py; the configs are tests/golden/configs.py."
    ),
    (
        "configs.NAME.metrics: the rows of the run's metrics.jsonl; configs.NAME.checkpoints: "
        "each safetensors file under checkpoints/: the sha256 of its tensors (name, dtype, "
        "shape, bytes, in name order), its layout (an index into layouts: [name, dtype, "
        "shape] per tensor) and its summaries ([sum, L2 norm] in float64 per tensor, in the "
        "layout's order) or summaries_as, the earlier file of the config with the same "
        "summaries."
    ),
    (
        "Re-record only for an explained change (see record.py's docstring); history says "
        "which configs were recorded, from what code, and why."
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="configs to re-record (default: all)")
    parser.add_argument("--reason", required=True, help="why these configs are (re-)recorded")
    parser.add_argument(
        "--once", action="store_true", help="run each config once (default: twice, compared)"
    )
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(configs.CONFIGS))
    if unknown:
        parser.error(f"no such config: {', '.join(unknown)} (known: {', '.join(configs.CONFIGS)})")
    names = args.names or list(configs.CONFIGS)
    origin = source()
    print(f"recording {len(names)} configs with {origin['fedloom']}", flush=True)

    old = json.loads(TABLE.read_text()) if TABLE.exists() else None
    machine = configs.machine()
    if args.names and old is None:
        parser.error(f"{TABLE} does not exist: record every config first")
    if args.names and old["machine"] != machine:
        parser.error(
            f"this machine ({machine}) is not the table's ({old['machine']}): "
            "re-record every config"
        )
    if args.names and old["tiny"] != list(configs.TINY):
        parser.error("configs.TINY is not the table's: re-record every config")
    kept = {}
    if args.names:
        kept = {n: old["configs"][n] for n in configs.CONFIGS if n in old["configs"]}
        for n in kept:  # back to the form configs.record() returns
            kept[n] = {**kept[n], "checkpoints": configs.unpack_checkpoints(old, n)}

    started = time.perf_counter()
    fresh = {name: record_config(name, not args.once) for name in names}
    merged = {n: fresh.get(n) or kept[n] for n in configs.CONFIGS if n in fresh or n in kept}
    packed = configs.pack(merged)
    history = (old["history"] if old and args.names else []) + [
        {"configs": args.names or "all", "reason": args.reason, **origin}
    ]
    table = {
        "about": ABOUT,
        "machine": machine,
        "tiny": list(configs.TINY),
        "history": history,
        "configs": packed["configs"],
        "layouts": packed["layouts"],
    }
    write(table, TABLE)
    size = TABLE.stat().st_size
    print(f"wrote {TABLE} ({size / 1024:.0f} KiB) in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()

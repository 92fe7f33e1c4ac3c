"""Golden results (issue 67, "What must not change"): each config of
``tests/golden/configs.py`` runs again on the local runtime and writes what
``tests/golden/results.json`` recorded.

Compared: every row of metrics.jsonl, its numbers within rel 1e-6 / abs 1e-9; every
safetensors file under checkpoints/, bit for bit (the sha256 of its tensors) where this
machine is the recording's (torch version, CPU capability, torch threads), else each
tensor's L2 norm within rel 1e-5 and its sum within 1e-5 · √n · ‖x‖₂ (the most a sum moves
when each value moves by 1e-5 of itself): another SIMD width sums in another order. Set
``FEDLOOM_GOLDEN_TOLERANT=1`` to compare as on another machine where the same capability
still computes otherwise.

A failure names the config and the first differences. A config marked ``expected_change``
in the table is one issue 67 changes on purpose: it is checked all the same, and once the
change lands it is re-recorded with its reason (``tests/golden/record.py``'s docstring).
Never re-record to make an unexplained difference pass.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import needs_glue
from golden import configs

TABLE_PATH = Path(__file__).parent / "golden" / "results.json"
TABLE: dict[str, Any] = json.loads(TABLE_PATH.read_text())


def exact() -> bool:
    """Whether this machine computes what the recording's did, bit for bit."""
    if os.environ.get("FEDLOOM_GOLDEN_TOLERANT") == "1":
        return False
    return configs.machine() == TABLE["machine"]


def test_the_table_holds_every_config_as_defined() -> None:
    """A config changed, added or removed in configs.py without re-recording fails here,
    not as a difference of results."""
    assert TABLE["tiny"] == list(configs.TINY)
    assert list(TABLE["configs"]) == list(configs.CONFIGS)
    for name, golden in configs.CONFIGS.items():
        recorded = TABLE["configs"][name]
        assert recorded["overrides"] == list(golden.overrides), name
        assert recorded["transforms"] == [dict(t) for t in golden.transforms], name
        assert recorded["faults"] == dict(golden.faults), name
        assert recorded["expected_change"] == golden.expected_change, name
        assert recorded["loose"] == dict(golden.loose), name


@needs_glue
@pytest.mark.parametrize("name", list(configs.CONFIGS))
def test_a_golden_config_writes_what_was_recorded(name: str, tmp_path: Path) -> None:
    golden = configs.CONFIGS[name]
    recorded = TABLE["configs"].get(name)
    if recorded is None:
        pytest.fail(f"{name} is not in the table: tests/golden/record.py {name!r} --reason ...")
    got = configs.record(configs.run(name, tmp_path))
    bitwise = exact()
    differences = configs.metrics_differences(recorded["metrics"], got["metrics"], golden.loose)
    differences += configs.checkpoint_differences(
        configs.unpack_checkpoints(TABLE, name), got["checkpoints"], bitwise
    )
    if differences:
        why = (
            f"\nexpected to change with issue 67 ({golden.expected_change}); once it has, "
            f"re-record it: tests/golden/record.py {name!r} --reason ..."
            if golden.expected_change
            else ""
        )
        compared = (
            "bit for bit" if bitwise else f"within tolerance (recorded on {TABLE['machine']})"
        )
        shown = "\n  ".join(differences[:25])
        more = f"\n  ... and {len(differences) - 25} more" if len(differences) > 25 else ""
        pytest.fail(
            f"{name}: {len(differences)} differences from tests/golden/results.json, "
            f"checkpoints compared {compared}:\n  {shown}{more}{why}",
            pytrace=False,
        )

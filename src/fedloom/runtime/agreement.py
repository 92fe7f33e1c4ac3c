"""What a Flower node must agree on with the server, and what is its own.

A deployed federation runs one experiment, the server's: every message to a node carries
the server's resolved config, and the node trains and scores with it. A node brings only
what belongs to its machine (:data:`NODE_OWN`: where its data lie, the device it trains
on, its threads). A node started with a config file of its own (``fedloom join CONFIG``)
checks it against the server's when the server first greets it, and refuses the
experiment if any setting that shapes what a client computes differs
(:func:`disagreements` over :data:`MUST_AGREE`, the node's own keys left out): sites whose
configs drifted apart fail loudly instead of training on other splits with other settings
than the server scores.

Flower itself has no such check: a ClientApp reads whatever ``run_config`` and
``node_config`` it is given. The comparison is by resolved value (defaults filled in),
so a file that spells a default out agrees with one that leaves it out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedloom.config import ExperimentConfig

#: the settings (sections, or single keys) that shape what a client computes: its data,
#: split, model, method, training and the round's transforms and faults
MUST_AGREE = (
    "seed",
    "data",
    "partition",
    "model",
    "algorithm",
    "aggregation",
    "transforms",
    "privacy",
    "secagg",
    "federation",
    "train",
    "faults",
    "runtime.client_data",
)
#: what a node sets for its own machine (``fedloom join --data-dir``, ``--device``,
#: ``--threads``, the paths of its config file), never the server's to dictate
NODE_OWN = (
    "data.data_dir",
    "data.train_path",
    "data.dev_path",
    "train.device",
    "runtime.cpus_per_worker",
)


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: node}


def _covered(key: str) -> bool:
    inside = any(key == s or key.startswith(s + ".") for s in MUST_AGREE)
    return inside and not any(key == s or key.startswith(s + ".") for s in NODE_OWN)


def disagreements(server: ExperimentConfig, node: ExperimentConfig) -> list[tuple[str, Any, Any]]:
    """``(key, server's value, node's value)`` for every must-agree setting that differs,
    in the config's order (a missing value is None)."""
    ours = _flat(server.model_dump(mode="json"))
    theirs = _flat(node.model_dump(mode="json"))
    keys = list(ours) + [k for k in theirs if k not in ours]
    return [
        (key, ours.get(key), theirs.get(key))
        for key in keys
        if _covered(key) and ours.get(key) != theirs.get(key)
    ]


def refusal(server: ExperimentConfig, node: ExperimentConfig, source: str, shown: int = 3) -> str:
    """One line naming the first ``shown`` differing must-agree keys and both values, or
    "" when the node's config (read from ``source``) agrees with the server's."""
    differ = disagreements(server, node)
    if not differ:
        return ""
    named = "; ".join(
        f"{key}: the server's {value!r}, {source}'s {own!r}" for key, value, own in differ[:shown]
    )
    more = f" (and {len(differ) - shown} more)" if len(differ) > shown else ""
    return f"the server's experiment differs from {source}: {named}{more}"

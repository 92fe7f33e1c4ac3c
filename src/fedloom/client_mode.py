"""What a client's test score is (``eval.client_mode``): the modes, and when the
dev-weighted estimate (:mod:`fedloom.evaluation.dev_weighted`) describes a federation's
clients.

Read by the configuration's checks and by the federation, which resolve the mode before
any model (or torch) is loaded, so this module imports nothing of fedloom's.
"""

from __future__ import annotations

#: what ``eval.client_mode = "auto"`` becomes where the dev-weighted estimate describes the
#: clients, and the alternative
DEV_WEIGHTED, SPLIT = "dev_weighted", "split"
#: a client scored on the dev examples of its own metadata values (feature skew)
DEV_MATCHED = "dev_matched"


def why_not_dev_matched(
    *, has_dev: bool, scheme: str, feature: str | None, temporal: bool
) -> str | None:
    """Why the dev set restricted to each client's values of the partition's metadata field
    cannot describe the clients; None when it can."""
    if scheme != "feature" or feature in (None, "length"):
        return 'the clients are not split by a metadata field (partition.scheme = "feature")'
    if not has_dev:
        return "there is no dev set to restrict"
    if temporal:
        return "under temporal drift (partition.temporal) a client's distribution moves"
    return None


def why_not_dev_weighted(*, kind: str, has_dev: bool, scheme: str, temporal: bool) -> str | None:
    """Why label weights cannot describe this federation's clients (its task of ``kind``,
    :attr:`fedloom.data.TaskSpec.kind`); None when they can."""
    if kind == "regression":
        return "the task has a numeric label, no label mix to weight by"
    if kind == "generation":
        return "the task's labels are responses to generate, no label mix to weight by"
    if not has_dev:
        return "there is no dev set (data.dev_path) to weight"
    if scheme == "feature":
        return 'under feature skew (partition.scheme = "feature") P(x | y) differs per client'
    if temporal:
        return "under temporal drift (partition.temporal) a client's distribution moves"
    return None

"""The rich tables the commands print: a run's summary, a partition, a diagnosis. Their
names (a task's, a label's) are the user's, printed as they are by
:data:`fedloom.cli.consoles.out_console`."""

from __future__ import annotations

from typing import Any

from rich.table import Table

#: how summary_table names what a client scope scored, by eval.client_mode
_CLIENT_SCOPES = {
    "clients": {"split": "clients' tests", "dev_weighted": "clients dev-w"},
    "val": {"split": "clients' val", "dev_weighted": "clients' val"},
    "clients_split": {"split": "clients' tests", "dev_weighted": "clients own"},
}

#: the adapters and baselines of a summary, in the order a reader compares them
_ADAPTERS = ("personal", "global", "local", "majority", "zero_shot")

#: metrics in [0, 1] shown as percentages (classification's, and the generated answers'
#: scores of :mod:`fedloom.evaluation.generation_metrics`); the others (correlations, a
#: generative task's nll and perplexity) as they are
_PERCENT = frozenset(
    {
        "accuracy",
        "balanced_accuracy",
        "f1",
        "macro_f1",
        "rouge1",
        "rouge2",
        "rougeL",
        "bleu",
        "chrf",
        "exact_match",
        "token_f1",
    }
)
_HEADERS = {"balanced_accuracy": "balanced acc.", "macro_f1": "macro-F1", "f1": "F1"}


def _stat(value: float | None, metric: str) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.1f}" if metric in _PERCENT else f"{value:.3f}"


def summary_table(summary: dict[str, Any]) -> Table:
    """Final numbers, a row per adapter (and baseline) and what it was scored on, a column
    per metric: the dev score, or the mean and the 10th percentile over the clients
    (``clients``: how many clients the scores summarize; min and max are in summary.json)."""
    table = Table(title=f"{summary['name']}: {summary['algorithm']} on {summary['task']}")
    mode = summary.get("client_mode", "split")
    rows: list[tuple[str, str, dict[str, str], str]] = []
    for kind in _ADAPTERS:
        for scope, values in summary.get(kind, {}).items():
            if scope == "dev":
                cells = {m: _stat(v, m) for m, v in values.items() if m not in ("n", "loss")}
                rows.append((kind, f"dev (n={values['n']})", cells, ""))
                continue
            where = _CLIENT_SCOPES.get(scope, {}).get(mode, scope)
            cells = {m: f"{_stat(s['mean'], m)} {_stat(s['p10'], m):>5}" for m, s in values.items()}
            counts = {str(s.get("n", "")) for s in values.values()}
            rows.append((kind, where, cells, "/".join(sorted(counts))))
    metrics = list(dict.fromkeys(m for _, _, cells, _ in rows for m in cells))
    table.add_column("adapter")
    table.add_column("scored on")
    for metric in metrics:
        table.add_column(f"{_HEADERS.get(metric, metric)}\nmean   p10", justify="right")
    table.add_column("clients", justify="right")
    for kind, where, cells, clients in rows:
        table.add_row(kind, where, *(cells.get(m, "") for m in metrics), clients)
    notes = []
    if summary.get("task_kind") == "generation":
        notes.append(
            "answers generated with each adapter, scored against the references; nll: the "
            "reference's mean token NLL (teacher forcing)"
        )
    elif "label_names" in summary:
        notes.append(
            "labels: " + ", ".join(summary["label_names"])
            if summary["label_names"]
            else "label: a number"
        )
    if mode == "dev_weighted":
        notes.append("dev-w: the dev set weighted to each client's label mix; own: its test split")
    notes.append("mean and p10 (10th percentile: the worse-off clients) over the clients")
    if "local" in summary or "majority" in summary:
        notes.append("local: each client trained alone; majority: it predicts its commonest label")
    if "balanced_accuracy" in metrics:
        notes.append("balanced acc.: the mean recall over the classes; a constant scores 50")
    table.caption = "\n".join(notes)
    return table


#: above this many labels the table lists each client's most frequent ones instead
_MAX_LABEL_COLUMNS = 6


def partition_table(stats: dict[str, Any], clusters: dict[str, int] | None = None) -> Table:
    """Per-client sizes, label histogram, divergence to the global label mix, task mix;
    with ``clusters`` (a run's discovered assignment) each client's true group beside it."""
    labels = stats["label_names"]
    wide = len(labels) > _MAX_LABEL_COLUMNS
    parts = [stats["scheme"], *(s for s in stats["skews"] if s != stats["scheme"])]
    table = Table(title=f"{stats['num_clients']} clients: {' + '.join(map(str, parts))}")
    for column in ("client", "train", "test", *(["top labels"] if wide else labels), "JS to mix"):
        table.add_column(column, justify="left" if column == "top labels" else "right")
    has_tasks = any(c.get("task_counts") for c in stats["clients"])
    if has_tasks:
        table.add_column("tasks", no_wrap=True)
    notes = any(c.get("label_map") is not None or c.get("drift") for c in stats["clients"])
    if notes:
        table.add_column("shift", no_wrap=True)
    from fedloom.diagnostics.clusters import true_groups

    groups = true_groups(stats) if clusters is not None else {}
    if clusters is not None:
        table.add_column("true group", no_wrap=True)
        table.add_column("cluster found", justify="right")
    for c in stats["clients"]:
        counts = c["label_counts"]
        if wide:
            top = sorted(range(len(counts)), key=lambda i: -counts[i])[:3]
            label_cells = [", ".join(f"{labels[i]} {counts[i]}" for i in top if counts[i])]
        else:
            label_cells = [str(n) for n in counts]
        row = [
            str(c["client_id"]),
            str(c["train"]),
            str(c["test"]),
            *label_cells,
            f"{c['js_to_global']:.3f}",
        ]
        if has_tasks:
            row.append(" · ".join(f"{t} {n}" for t, n in (c.get("task_counts") or {}).items()))
        if notes:
            shift = []
            if c.get("label_map") is not None:
                shift.append(f"labels → {c['label_map']}")
            if c.get("drift"):
                shift.append(
                    f"drifts in rounds {c['drift']['start_round']}–{c['drift']['end_round']}"
                )
            row.append("; ".join(shift))
        if clusters is not None:
            found = clusters.get(str(c["client_id"]))
            row += [groups[int(c["client_id"])], "—" if found is None else str(found)]
        table.add_row(*row)
    return table


def diagnosis_table(result: dict[str, Any]) -> Table:
    """Per client: size, label divergence, gradient distance, feature shift, label agreement."""
    clients = result["partition"]["clients"]
    grad = result["gradient"]["per_client"]
    shift = result["feature_shift"]["per_client"]
    cons = (result["label_consistency"] or {}).get("per_client", {})
    table = Table(title="heterogeneity at the initial model")
    for column in (
        "client",
        "train",
        "JS to label mix",
        "‖∇F_k − ∇F‖²",
        "feature shift",
        "label agreement (own / others)",
    ):
        table.add_column(column, justify="right")
    for c in clients:
        cid = str(c["client_id"])
        agree = cons.get(cid)
        table.add_row(
            cid,
            str(c["train"]),
            f"{c['js_to_global']:.3f}",
            f"{grad[cid]:.3g}" if cid in grad else "—",
            f"{shift[cid]:.4f}" if cid in shift else "—",
            f"{agree['within']:.2f} / {agree['cross']:.2f}" if agree else "—",
        )
    return table

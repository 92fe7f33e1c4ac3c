"""``write_report``: one run directory into one self-contained ``report.html`` and its
PNGs. Which sections a report has depends on what the run logged; one that does not
apply (no privacy, no clusters) is left out, never drawn empty."""

from __future__ import annotations

from pathlib import Path

from fedloom.report import curves, federation, series, server, tables, traffic
from fedloom.report.figures import Plot, copy_into, write_atomic
from fedloom.report.page import (
    Section,
    heading,
    image,
    page,
    paragraph,
    preformatted,
    table,
)
from fedloom.report.rundata import RunData, read_run
from fedloom.report.samples import (
    SAMPLES_FILE,
    description,
    read_samples,
    samples_table,
    unreadable,
)

REPORT_FOLDER = "report"
REPORT_FILE = "report.html"


def destination(run_dir: Path, out: Path | None) -> tuple[Path, Path]:
    """(the folder of the PNGs, the page): ``RUN_DIR/report/report.html`` by default;
    ``out`` names the folder, or the page itself when it ends in ``.html``."""
    if out is None:
        return run_dir / REPORT_FOLDER, run_dir / REPORT_FOLDER / REPORT_FILE
    out = Path(out)
    if out.suffix.lower() in (".html", ".htm"):
        return out.parent, out
    return out, out / REPORT_FILE


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of the run directory ``run_dir``; returns the page's path.

    The page holds everything (inline CSS, the figures as data URIs, no script); the PNGs
    are also written beside it. Works on a run that is still going or was cut short (it
    says so at the top). Raises :class:`~fedloom.report.rundata.ReportError` when
    ``run_dir`` is not a run directory."""
    run = read_run(run_dir)
    folder, html_path = destination(run.path, None if out is None else Path(out))
    folder.mkdir(parents=True, exist_ok=True)
    sections = [s for s in build_sections(run, folder) if s.parts]
    task = (run.summary or {}).get("task") or run.config.get("data", {}).get("task", "")
    title = f"{run.name}: {run.algorithm}" + (f" on {task}" if task else "")
    subtitle = f"fedloom run report · {run.path}"
    write_atomic(html_path, page(title, subtitle, sections, _banner(run)).encode("utf-8"))
    return html_path


def _banner(run: RunData) -> str:
    lines = []
    if run.state == "unknown":
        lines.append(
            "This run directory has neither status.json nor summary.json: the figures show "
            "what it logged."
        )
    elif run.state != "finished":
        status = run.status or {}
        lines.append(
            f"This run is {run.state} (after round {status.get('round', '?')} of "
            f"{status.get('rounds', '?')}): the figures show what it logged so far"
            + (f"; error: {status['error']}" if status.get("error") else "")
            + "."
        )
    lines += run.notes
    return " ".join(lines)


def _figures(plots: list[Plot]) -> list[str]:
    return [image(p) for p in plots]


def build_sections(run: RunData, folder: Path) -> list[Section]:
    """Every section of the report, each with its figures written into ``folder``."""
    dev = series.dev_curves(run)
    train = series.train_series(run)
    score_header, score_rows = tables.score_rows(run)
    summary = Section("summary", "Summary", [table([], tables.fact_rows(run))])
    if score_rows:
        summary.parts += [heading("Final scores"), table(score_header, score_rows)]
    out = [
        summary,
        Section(
            "curves",
            "Scores over rounds",
            _figures(curves.plot_dev(dev, folder))
            + _figures(curves.plot_clients(series.client_curves(run), dev, folder)),
        ),
        Section(
            "final",
            "Final scores per client",
            _figures(curves.plot_final(series.final_client_scores(run), folder)),
        ),
        Section("samples", "Sample generations", _sample_parts(run)),
        Section("training", "Training", _figures(curves.plot_train_loss(train, folder))),
        Section("traffic", "Communication", _figures(traffic.plot_traffic(train, folder))),
        Section(
            "privacy",
            "Differential privacy",
            _figures(
                traffic.plot_privacy(train, (run.summary or {}).get("privacy"), run.config, folder)
            ),
        ),
        Section("server", "Relevance and clusters", _server_parts(run, folder)),
        Section("federation", "Federation", _federation_parts(run, folder)),
    ]
    if run.config_text:
        out.append(Section("config", "Configuration", [preformatted(run.config_text)]))
    if run.versions:
        out.append(
            Section(
                "versions",
                "Versions",
                [
                    paragraph("The software that produced this run (versions.json)."),
                    table([], tables.version_rows(run.versions)),
                ],
            )
        )
    return out


def _sample_parts(run: RunData) -> list[str]:
    """A generative run's samples.jsonl as a table, or why it could not be read; nothing
    for a run without one."""
    samples = read_samples(run.path)
    if samples is None:
        return []
    if samples.error is not None:
        return [paragraph(unreadable(samples), "error")]
    if not samples.records:
        return [paragraph(f"{SAMPLES_FILE} holds no sample generations.")]
    return [paragraph(description(samples)), samples_table(samples)]


def _server_parts(run: RunData, folder: Path) -> list[str]:
    plots = server.plot_matrices(
        series.matrices(run, "relevance", "matrix"), folder, "relevance_rounds", "relevance S", True
    )
    if not plots and (run.path / "relevance.png").is_file():  # final S only (summary.json)
        copied = copy_into(run.path / "relevance.png", folder / "relevance.png")
        plots.append(Plot(copied, "Relevance S", "The final relevance S (summary.json)."))
    plots += server.plot_matrices(
        series.matrices(run, "omega", "omega"), folder, "omega_rounds", "task relationship Ω", False
    )
    assignments = series.by_round(run, "clusters", "assignment")
    if assignments:
        from fedloom.diagnostics.clusters import true_groups

        partition = run.partition or {}
        groups = true_groups(partition) if partition.get("clients") else None
        plots += server.plot_clusters(assignments, groups, folder)
    plots += server.plot_mixture(series.by_round(run, "mixture", "weights"), folder)
    plots += server.plot_ranks(series.by_round(run, "ranks", "ranks"), folder)
    return _figures(plots)


def _federation_parts(run: RunData, folder: Path) -> list[str]:
    parts = _figures(federation.partition_plot(run.path, run.partition, folder))
    header, rows = federation.partition_rows(run.partition)
    if rows:
        parts.append(table(header, rows))
    parts += _figures(federation.plot_diagnostics(series.diagnostics_series(run), folder))
    return parts

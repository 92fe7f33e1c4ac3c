"""Figures and reports of runs: :func:`write_report` (one run directory into a
self-contained report.html and its PNGs), :func:`compare` (several runs, or a sweep's,
side by side), and the relevance heatmap the runtime draws into a run directory.

Modules: ``rundata`` reads a run directory into plain data, ``series`` turns its metrics
rows into series over rounds, ``curves`` / ``traffic`` / ``server`` / ``federation`` draw
the families of figures, ``tables`` lists the final numbers, ``samples`` reads a
generative run's sample generations, ``page`` assembles the HTML, ``write`` puts a report
together, ``compare`` compares runs."""

from fedloom.report.compare import ComparedRun, Comparison, compare
from fedloom.report.rundata import ReportError, RunData, read_run
from fedloom.report.write import write_report

__all__ = [
    "ComparedRun",
    "Comparison",
    "ReportError",
    "RunData",
    "compare",
    "read_run",
    "write_report",
]

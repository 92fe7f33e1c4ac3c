"""The report and comparisons of a generative run (prompt -> response): one tiny Ditto run
on tiny-llama (2 clients, 1 round, rougeL and nll), built once.

What is checked: the report has a "Sample generations" section whose table holds every
record of samples.jsonl (each text read back from the HTML equals the file's), with a
column per adapter that answered (Ditto: global and personal); hostile texts (a script
tag, text that looks like an entity, quotes, newlines) are escaped, so the page has no
script and shows them as written, and an adapter null everywhere has no column; a text
too long to show whole says how much of it is left out; a damaged samples.jsonl (a line
that is not JSON, a field of the wrong type) makes the section say the file could not be
read, naming the line, and every other section is still there; the scores tables show
rougeL as a percentage and nll as a plain number; ``fedloom compare`` still compares
generative runs (table, Markdown, curves of rougeL and nll)."""

from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from conftest import tiny_raw
from generative_rows import prompt_rows, write_jsonl
from PIL import Image
from rich.console import Console
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.cli.tables import _PERCENT, summary_table
from fedloom.evaluation.samples import SAMPLES_FILE
from fedloom.report import compare, write_report
from fedloom.report import samples as report_samples

#: the sections of the report of a generative run (no privacy, no server matrices)
SECTIONS = ["summary", "curves", "final", "samples", "training", "traffic", "federation",
            "config", "versions"]




@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("generative-run")
    train = write_jsonl(tmp / "train.jsonl", prompt_rows(40))
    dev = write_jsonl(tmp / "dev.jsonl", prompt_rows(8))
    raw = tiny_raw(
        'data.task="generation"', f'data.train_path="{train}"', f'data.dev_path="{dev}"',
        "data.max_train_examples=0", "data.max_dev_examples=0", 'model.backbone="tiny-llama"',
        'algorithm.name="ditto"', 'partition.scheme="feature"', 'partition.feature="topic"',
        "partition.num_clients=2", "federation.rounds=1", 'eval.metrics=["rougeL", "nll"]',
        "eval.generation.max_new_tokens=4")
    config = tmp / "gen.toml"
    config.write_text(tomli_w.dumps(raw))
    result = CliRunner().invoke(
        app, ["run", "--no-report", str(config), "--output-dir", str(tmp / "runs")])
    assert result.exit_code == 0, result.stderr
    (path,) = sorted((tmp / "runs").glob("*"))
    return path


@pytest.fixture(scope="module")
def report(run: Path) -> str:
    return write_report(run).read_text(encoding="utf-8")


def _copy(run: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(run, tmp_path / name,
                                ignore=shutil.ignore_patterns("checkpoints", "report")))


class _Page(HTMLParser):
    """The section ids, every tag name, and each table's header and cells (text as shown,
    entities decoded) by the id of the section it is in."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[str] = []
        self.tags: set[str] = set()
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag == "section":
            self.sections.append(dict(attrs)["id"] or "")
        elif tag == "table":
            self.tables.setdefault(self.sections[-1], []).append({"header": [], "rows": []})
        elif tag == "tr":
            self.tables[self.sections[-1]][-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            table = self.tables[self.sections[-1]][-1]
            text = "".join(self._cell)
            (table["header"] if tag == "th" else table["rows"][-1]).append(text)
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def _sample_table(page: _Page) -> tuple[list[str], list[list[str]]]:
    (table,) = page.tables["samples"]
    return table["header"], [row for row in table["rows"] if row]


def _records(run: Path) -> list[dict[str, Any]]:
    lines = (run / SAMPLES_FILE).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


# --- sample generations ------------------------------------------------------------------


def test_the_report_shows_every_sample_with_a_column_per_adapter(run: Path, report: str) -> None:
    assert report_samples.SAMPLES_FILE == SAMPLES_FILE  # the file the run writes
    page = _parse(report)
    assert page.sections == SECTIONS
    header, rows = _sample_table(page)
    assert header == ["client", "prompt", "reference", "global adapter", "personal adapter"]
    records = _records(run)
    assert [r["client"] for r in records] == [0, 0, 0, 1, 1, 1]
    assert all(isinstance(r["personal"], str) for r in records)  # Ditto's personal adapters
    expected = [[str(r["client"]), r["prompt"], r["reference"], r["global"] or "(empty)",
                 r["personal"] or "(empty)"] for r in records]
    assert rows == expected
    assert '<tr class="first">' in report  # client 1's rows start a new group
    assert "6 prompts, 2 clients" in report


HOSTILE = [
    {"client": 0, "prompt": "<script>alert(1)</script>", "reference": "Tom &amp; Jerry",
     "global": '"quoted" & \'single\' <b>bold</b>', "personal": None},
    {"client": 0, "prompt": "line one\nline two", "reference": "&lt;not a tag&gt;",
     "global": "", "personal": None},
    {"client": 3, "prompt": "<i>" + "x" * 1700 + "y" * 1000 + "THE END", "reference": "r",
     "global": None, "personal": None},
]


def test_hostile_texts_are_escaped_and_shown_as_written(run: Path, tmp_path: Path) -> None:
    copy = _copy(run, tmp_path)
    write_jsonl(copy / SAMPLES_FILE, HOSTILE)
    text = write_report(copy).read_text(encoding="utf-8")
    assert "<script>alert(1)</script>" not in text and "<b>bold" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "Tom &amp;amp; Jerry" in text and "&amp;lt;not a tag&amp;gt;" in text
    assert "&quot;quoted&quot; &amp; &#x27;single&#x27;" in text
    page = _parse(text)
    assert "&lt;i&gt;xxx" in text
    assert "script" not in page.tags and "b" not in page.tags and "i" not in page.tags
    assert page.sections == SECTIONS
    header, rows = _sample_table(page)
    # personal is null everywhere: no column; a null answer and an empty one say which
    assert header == ["client", "prompt", "reference", "global adapter"]
    assert rows[0] == ["0", HOSTILE[0]["prompt"], "Tom &amp; Jerry", HOSTILE[0]["global"]]
    assert rows[1] == ["0", "line one\nline two", "&lt;not a tag&gt;", "(empty)"]
    long = HOSTILE[2]["prompt"]
    assert rows[2][0] == "3" and rows[2][2:] == ["r", "not generated"]
    shown = rows[2][1]
    cut = len(long) - report_samples.HEAD - report_samples.TAIL
    assert f"({cut:,} characters left out of {len(long):,})" in shown
    assert shown.startswith(long[:report_samples.HEAD]) and shown.endswith(
        long[-report_samples.TAIL:])
    assert shown.endswith("THE END")


DAMAGED = [
    ('{"client": 0, "prompt": "a", "reference": ', "line 2 is not JSON"),
    ('{"client": "0", "prompt": "a", "reference": "b", "global": "c", "personal": null}',
     "line 2: 'client' must be an integer"),
    ('{"client": 1, "prompt": 5, "reference": "b", "global": "c", "personal": null}',
     "line 2: 'prompt' must be a string"),
    ('{"client": 1, "prompt": "a", "reference": "b", "global": ["c"], "personal": null}',
     "line 2: 'global' must be a string or null"),
    ('["<script>"]', "line 2: not a JSON object"),
]


def _damaged(run: Path, tmp_path: Path, line: str) -> Path:
    copy = _copy(run, tmp_path)
    good = (copy / SAMPLES_FILE).read_text(encoding="utf-8").splitlines()
    (copy / SAMPLES_FILE).write_text("\n".join([good[0], line, *good[1:]]) + "\n")
    return copy


@pytest.mark.parametrize(("line", "message"), DAMAGED)
def test_a_damaged_samples_file_is_read_as_the_line_at_fault(
    run: Path, tmp_path: Path, line: str, message: str
) -> None:
    samples = report_samples.read_samples(_damaged(run, tmp_path, line))
    assert samples is not None and not samples.records
    assert samples.error is not None and samples.error.startswith(message)


def test_a_damaged_samples_file_is_said_and_the_rest_renders(run: Path, tmp_path: Path) -> None:
    line, message = DAMAGED[-1]
    text = write_report(_damaged(run, tmp_path, line)).read_text(encoding="utf-8")
    assert f"{SAMPLES_FILE} could not be read, so no sample generations are shown:" in text
    assert message.replace("'", "&#x27;") in text
    page = _parse(text)
    assert page.sections == SECTIONS and "samples" not in page.tables
    assert "script" not in page.tags
    assert len(page.tables["summary"]) == 2 and any(  # the facts and the final scores
        row[:2] == ["global/dev", "rougeL"] for row in page.tables["summary"][1]["rows"])
    assert text.count("<img ") >= 4  # the figures are all there


def test_a_run_without_samples_has_no_such_section(run: Path, tmp_path: Path) -> None:
    copy = _copy(run, tmp_path)
    (copy / SAMPLES_FILE).unlink()
    assert _parse(write_report(copy).read_text(encoding="utf-8")).sections == [
        s for s in SECTIONS if s != "samples"]
    (copy / SAMPLES_FILE).write_text("")
    text = write_report(copy).read_text(encoding="utf-8")
    assert f"{SAMPLES_FILE} holds no sample generations." in text


# --- scores ------------------------------------------------------------------------------


def test_rouge_is_a_percentage_and_nll_a_plain_number(run: Path, report: str) -> None:
    assert {"rouge1", "rouge2", "rougeL", "bleu", "chrf", "exact_match", "token_f1"} <= _PERCENT
    assert not {"nll", "perplexity", "loss"} & _PERCENT
    summary = json.loads((run / "summary.json").read_text())
    summary["global"]["dev"].update(rougeL=0.4567, nll=2.3456)
    summary["personal"]["clients"]["rougeL"].update(mean=0.1234, p10=0.0987)
    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    table = console.export_text()
    assert "45.7" in table and "0.457" not in table
    assert "12.3" in table and " 9.9" in table and "0.123" not in table
    assert "2.346" in table and "234.6" not in table
    # the report lists every final score on its own scale, nll as it is
    dev = json.loads((run / "summary.json").read_text())["global"]["dev"]
    for metric in ("rougeL", "nll"):
        assert (f'<td>global/dev</td><td>{metric}</td><td class="num">{dev[metric]:.4f}</td>'
                in report)
    assert "clients_rougeL.png" in report and "clients_nll.png" in report


def test_fedloom_compare_compares_generative_runs(run: Path, tmp_path: Path) -> None:
    other = _copy(run, tmp_path, "other")
    result = compare([run, other])
    assert result.metrics[:2] == ["rougeL", "nll"]
    summary = json.loads((run / "summary.json").read_text())
    header, rows = result.table_rows(["rougeL", "nll"])
    assert header[:7] == ["run", "metric", "global dev", "global mean", "global p10",
                          "personal mean", "personal p10"]
    cells = dict(zip(header, rows[1]))
    assert cells["metric"] == "nll"
    assert cells["global dev"] == f"{summary['global']['dev']['nll']:.4f}"
    assert cells["personal mean"] == f"{summary['personal']['clients']['nll']['mean']:.4f}"
    cli = CliRunner().invoke(app, [
        "compare", str(run), str(other), "--metric", "nll", "--metric", "rougeL",
        "--markdown", str(tmp_path / "table.md"), "--plot", str(tmp_path / "nll.png")])
    assert cli.exit_code == 0, cli.stderr
    markdown = (tmp_path / "table.md").read_text().splitlines()
    assert len(markdown) == 2 + 2 * 2 and "| nll |" in markdown[2]
    for metric in ("rougeL", "nll"):
        png = result.plot(tmp_path / f"{metric}.png", metric)
        assert Image.open(png).size[0] >= 2 * 400  # the dev panel and the clients' panels
    assert Image.open(tmp_path / "nll.png").size[0] >= 2 * 400

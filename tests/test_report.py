"""Reports and comparisons of real runs, looked at as a person would: two tiny-bert runs
on MRPC (FedMosaic, whose server logs a relevance matrix each round; FedAvg-FT under
client-level DP, with a global and personal adapters and ε per round), their report.html
opened in headless Chromium, and compare() on them and on a small sweep.

The browser check proves rendering twice over: a copy of each page with a probe script
(the report itself has none) makes Chromium write, after load, every image's natural size
(0 x 0 for data that is not an image) and box into the DOM (--dump-dom); a screenshot of
the page as written, tall enough to hold it all, must show in each of those boxes the PNG
itself (pixel for pixel where unscaled, and not blank), which also catches a PNG cut
short (its header gives it a size, but only its top is drawn). A damaged copy of a page
shows that both checks fail when they should.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import needs_glue, tiny_config, tiny_raw
from PIL import Image

from fedloom import sweep
from fedloom.experiment import Experiment
from fedloom.report import compare, read_run, write_report
from fedloom.runtime.rundir import RunDir
from fedloom.server import simulate

pytestmark = needs_glue

RUNS = {
    # personal adapters only; a relevance matrix S every round
    "mosaic": ("algorithm.name=fedmosaic",),
    # global and personal adapters; DP-FedAvg's ε every round
    "dp": ("algorithm.name=fedavg_ft", "privacy.level=client", "privacy.noise_multiplier=1.0"),
}
WINDOW_WIDTH = 1200
#: the tallest screenshot taken; the tiny runs' pages are about 6000 px
MAX_HEIGHT = 16000


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report-runs")
    out = {}
    for name, overrides in RUNS.items():
        cfg = tiny_config(*overrides, f"name={name}", output_dir=root)
        run = RunDir.create(root, name)
        simulate(Experiment.build(cfg), run)
        out[name] = run.path
    return out


@pytest.fixture(scope="module")
def reports(runs: dict[str, Path]) -> dict[str, Path]:
    return {name: write_report(path) for name, path in runs.items()}


class _Page(HTMLParser):
    """The section ids, the <img> attributes and every tag name of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.images: list[dict[str, str]] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        values = {k: v or "" for k, v in attrs}
        if tag == "section":
            self.sections.append(values["id"])
        elif tag == "img":
            self.images.append(values)


def parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def decoded(uri: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert uri.startswith(prefix)
    image = Image.open(io.BytesIO(base64.b64decode(uri[len(prefix):], validate=True)))
    image.load()
    return image


def not_blank(image: Image.Image) -> None:
    pixels = np.asarray(image.convert("RGB"), dtype=np.int32)
    colours = len(np.unique((pixels[..., 0] << 16) | (pixels[..., 1] << 8) | pixels[..., 2]))
    inked = float((pixels.min(axis=2) < 200).mean())
    assert colours >= 16 and inked >= 0.01, (colours, inked)


# --- the page ----------------------------------------------------------------------------


def test_sections_follow_what_each_run_logged(reports: dict[str, Path]) -> None:
    common = ["summary", "curves", "final", "training", "traffic", "federation", "config",
              "versions"]
    dp, mosaic = parse(reports["dp"]), parse(reports["mosaic"])
    assert dp.sections == [*common[:5], "privacy", *common[5:]]
    assert mosaic.sections == [*common[:5], "server", *common[5:]]
    files = {p: {i["data-file"] for i in parse(reports[p]).images} for p in reports}
    assert files["dp"] == {
        "dev.png", "clients_accuracy.png", "clients_f1.png", "clients_loss.png",
        "final_scores.png", "train_loss.png", "traffic.png", "privacy.png", "partition.png",
        "diagnostics.png",
    }
    # FedMosaic has no global adapter (no dev curve) and logs S: drawn over rounds
    assert {"relevance_rounds.png", "clients_accuracy.png", "partition.png"} <= files["mosaic"]
    assert "dev.png" not in files["mosaic"] and "privacy.png" not in files["mosaic"]
    for report in reports.values():
        assert report == report.parent / "report.html" and report.parent.name == "report"
        page = parse(report)
        # self-contained: no script, no stylesheet or image fetched from anywhere
        assert not page.tags & {"script", "link", "iframe", "object"}
        text = report.read_text(encoding="utf-8")
        assert not re.search(r"""(src|href)=["']?(https?:|//|file:)""", text)
        for img in page.images:  # each embedded PNG is the file beside the page
            png = decoded(img["src"])
            on_disk = Image.open(report.parent / img["data-file"])
            assert png.size == on_disk.size == (int(img["width"]), int(img["height"]))
            assert base64.b64decode(img["src"].split(",", 1)[1]) == (
                report.parent / img["data-file"]).read_bytes()
            not_blank(png)
        run = read_run(report.parent.parent)
        assert html.escape(run.config_text) in text  # the configuration, as the run wrote it
        assert f"<td>{html.escape(str(run.versions['torch']))}</td>" in text


def test_pngs_have_the_size_of_their_figures(reports: dict[str, Path]) -> None:
    folder = reports["dp"].parent
    expected = {
        "traffic.png": (1000, 340),  # 10 x 3.4 in at 100 dpi
        "privacy.png": (640, 340),
        "train_loss.png": (640, 340),
        "clients_accuracy.png": (960, 660),  # 2 x 2 panels: global / personal x two splits
        "dev.png": (1200, 300),  # accuracy, f1, loss
    }
    for name, size in expected.items():
        assert Image.open(folder / name).size == size, name


def test_the_summary_tables_hold_summary_json(runs: dict[str, Path],
                                              reports: dict[str, Path]) -> None:
    summary = json.loads((runs["dp"] / "summary.json").read_text())
    text = reports["dp"].read_text(encoding="utf-8")
    p10 = summary["personal"]["clients"]["accuracy"]["p10"]
    row = (r"<td>personal/clients</td><td>accuracy</td>"
           rf'<td class="num">{summary["personal"]["clients"]["accuracy"]["mean"]:.4f}</td>'
           rf'<td class="num">{p10:.4f}</td>')
    assert row in text
    assert f'<td class="num">{summary["privacy"]["epsilon"]:.4g}</td>' in text


def test_strings_are_escaped_and_a_run_cut_short_says_so(runs: dict[str, Path],
                                                        tmp_path: Path) -> None:
    copy = shutil.copytree(runs["dp"], tmp_path / "cut-short", ignore=shutil.ignore_patterns(
        "checkpoints", "report"))
    (copy / "summary.json").unlink()
    status = json.loads((copy / "status.json").read_text())
    (copy / "status.json").write_text(json.dumps({**status, "state": "running", "round": 2}))
    config = (copy / "config.toml").read_text()
    (copy / "config.toml").write_text(config.replace('name = "dp"', 'name = "<b>dp & co</b>"'))
    page = write_report(copy, tmp_path / "elsewhere" / "page.html")
    assert page == tmp_path / "elsewhere" / "page.html"
    assert (tmp_path / "elsewhere" / "traffic.png").is_file()
    text = page.read_text(encoding="utf-8")
    assert "<b>dp" not in text and "&lt;b&gt;dp &amp; co&lt;/b&gt;" in text
    assert "This run is running (after round 2 of 2)" in text
    # the scores come from the last evaluation rows instead of summary.json
    assert "<td>personal/clients</td><td>accuracy</td>" in text


# --- in a browser ------------------------------------------------------------------------

_PROBE = """<script>
window.addEventListener("load", () => {
  const images = [];
  for (const img of document.images) {
    const box = img.getBoundingClientRect();
    images.push({file: img.dataset.file, complete: img.complete,
                 naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight,
                 x: box.left + window.scrollX, y: box.top + window.scrollY,
                 width: box.width, height: box.height});
  }
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({images: images,
                                    height: document.documentElement.scrollHeight});
  document.body.appendChild(out);
});
</script>"""


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        why = ("chromium is not installed (scripts/setup.sh installs Debian's package when "
               "run as root), so report.html cannot be opened in a browser")
        if os.environ.get("FEDLOOM_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{why}; FEDLOOM_REQUIRE_BROWSER=1 requires it")
        pytest.skip(why)
    return found


def headless(exe: str, profile: Path, url: str, *args: str) -> str:
    done = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-extensions", "--hide-scrollbars",
         "--force-device-scale-factor=1", f"--user-data-dir={profile}",
         "--virtual-time-budget=10000", *args, url],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def rendered(exe: str, report: Path, tmp_path: Path) -> dict[str, Any]:
    """What Chromium made of each image of a copy of ``report`` with the probe script."""
    probe = report.with_name("probe.html")
    probe.write_text(report.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"),
                     encoding="utf-8")
    dom = headless(exe, tmp_path / "profile-dom", probe.as_uri(), "--dump-dom",
                   f"--window-size={WINDOW_WIDTH},1000")
    probe.unlink()
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.DOTALL)
    assert found, "the probe wrote nothing: the page did not load"
    return json.loads(html.unescape(found.group(1)))


def on_screen(exe: str, report: Path, tmp_path: Path) -> list[dict[str, Any]]:
    """The probe's record of each image of ``report``, with what a screenshot of the page
    (tall enough to hold it all) shows in the image's box: ``seen`` (that crop, inside
    the 1px border) and ``difference``, its mean absolute difference from the PNG file
    the image was made from, scaled to the box (0 to 255 per channel)."""
    probed = rendered(exe, report, tmp_path)
    height = min(int(probed["height"]), MAX_HEIGHT)
    shot = tmp_path / f"{report.stem}.png"
    headless(exe, tmp_path / "profile-shot", report.as_uri(), f"--screenshot={shot}",
             f"--window-size={WINDOW_WIDTH},{height}")
    screen = Image.open(shot).convert("RGB")
    assert screen.size == (WINDOW_WIDTH, height)
    for image in probed["images"]:
        # a box at a half pixel is painted from the next pixel (rounded half up, as the
        # browser snaps it; Python's round() takes half to even)
        box = (_pixel(image["x"]) + 1, _pixel(image["y"]) + 1,
               _pixel(image["x"] + image["width"]) - 1, _pixel(image["y"] + image["height"]) - 1)
        assert box[3] <= height, f"{image['file']} lies below the screenshot"
        image["seen"] = screen.crop(box)
        png = Image.open(report.parent / image["file"]).convert("RGB").resize(image["seen"].size)
        image["difference"] = float(np.abs(
            np.asarray(image["seen"], dtype=float) - np.asarray(png, dtype=float)).mean())
    return probed["images"]


def _pixel(position: float) -> int:
    """The screen pixel a CSS position snaps to: rounded half up."""
    return math.floor(position + 0.5)


#: the most a box on the screen may differ from its PNG: 0 where the page shows the PNG at
#: its own size, under 1 where it is scaled down to the page; a white box differs by 4+
SAME_IMAGE = 2.5


@pytest.mark.parametrize("name", list(RUNS))
def test_every_image_renders_in_chromium(name: str, reports: dict[str, Path],
                                         tmp_path: Path) -> None:
    exe = chromium()
    report = reports[name]
    images = on_screen(exe, report, tmp_path)
    assert [i["file"] for i in images] == [i["data-file"] for i in parse(report).images]
    for image in images:
        # loaded at the PNG's own size (a broken image has no natural size) ...
        size = Image.open(report.parent / image["file"]).size
        assert image["complete"] and (image["naturalWidth"], image["naturalHeight"]) == size
        assert image["width"] > 100 and image["height"] > 50, image["file"]
        # ... and shown whole: its box on the screen is the PNG, and not blank
        not_blank(image["seen"])
        assert image["difference"] < SAME_IMAGE, (image["file"], image["difference"])


def test_the_browser_check_sees_broken_images(reports: dict[str, Path], tmp_path: Path) -> None:
    """The checks above can fail: in a copy of a page whose first PNG is not a PNG and
    whose second is cut short, the first has no natural size and the second, though its
    header gave its size, does not look like its PNG on the screen; the others pass."""
    exe = chromium()
    text = reports["dp"].read_text(encoding="utf-8")
    spans = [(m.start(1), m.end(1)) for m in re.finditer(r'base64,([^"]*)"', text)][:2]
    (a, b), (c, d) = spans
    cut = c + (d - c) // 3 // 4 * 4
    damaged = reports["dp"].with_name("damaged.html")
    damaged.write_text(text[:a] + "AAAA" * 32 + text[b:c] + text[c:cut] + text[d:],
                       encoding="utf-8")
    try:
        images = on_screen(exe, damaged, tmp_path)
    finally:
        damaged.unlink()
    first, second, *rest = images
    assert (first["naturalWidth"], first["naturalHeight"]) == (0, 0)
    assert second["naturalWidth"] > 0 and second["difference"] >= SAME_IMAGE
    assert all(i["naturalWidth"] > 0 and i["difference"] < SAME_IMAGE for i in rest)


# --- comparisons -------------------------------------------------------------------------


def test_compare_two_runs(runs: dict[str, Path], tmp_path: Path) -> None:
    result = compare([runs["mosaic"], runs["dp"]])
    assert [r.run.path for r in result.runs] == [runs["mosaic"], runs["dp"]]
    assert "algorithm.name" in result.keys and "privacy.level" in result.keys
    mosaic, dp = (r.label for r in result.runs)
    assert mosaic.startswith("fedmosaic (") and "privacy.level=off" in mosaic
    assert dp.startswith("fedavg_ft (") and "privacy.level=client" in dp
    assert result.metrics[0] == "accuracy"

    summary = json.loads((runs["dp"] / "summary.json").read_text())
    header, rows = result.table_rows(["accuracy"])
    assert header == ["run", "metric", "global dev", "global mean", "global p10",
                      "personal mean", "personal p10", "ε", "rounds", "wall s"]
    assert [row[:2] for row in rows] == [[mosaic, "accuracy"], [dp, "accuracy"]]
    cells = dict(zip(header, rows[1]))
    assert cells["global dev"] == f"{summary['global']['dev']['accuracy']:.4f}"
    assert cells["personal p10"] == f"{summary['personal']['clients']['accuracy']['p10']:.4f}"
    assert cells["ε"] == f"{summary['privacy']['epsilon']:.3g}"
    assert dict(zip(header, rows[0]))["global dev"] == "—"  # FedMosaic has no global adapter

    markdown = result.markdown().splitlines()
    assert markdown[0] == "| " + " | ".join(header) + " |"
    assert markdown[1] == "|---|---|" + "---:|" * (len(header) - 2)
    assert len(markdown) == 2 + 2 * len(result.metrics)
    assert result.rich_table().row_count == 2 * len(result.metrics)

    png = result.plot(tmp_path / "compare.png")
    image = Image.open(png)
    assert image.size[0] >= 2 * 400  # a panel per score the runs have
    not_blank(image)


def test_compare_a_sweep_labels_its_points_by_the_swept_key(tmp_path: Path) -> None:
    raw = tiny_raw("partition.val_fraction=0.25", "federation.rounds=1")
    plan = sweep.plan(raw, sweep.parse_grid(["train.lr=1e-3,5e-3"]))
    result = sweep.run(plan, sweep.create_dir(tmp_path, "tiny"))
    compared = compare([result.directory])
    assert compared.keys == ["train.lr"]
    assert [r.label for r in compared.runs] == ["fedavg (train.lr=0.001)",
                                               "fedavg (train.lr=0.005)"]
    assert [r.selected for r in compared.runs] == [i == result.selected for i in range(2)]
    assert sum(line.startswith("| ★ ") for line in compared.markdown().splitlines()) == len(
        compared.metrics)

"""One self-contained HTML page: inline CSS, PNGs embedded as base64 data URIs, no
script and nothing fetched from anywhere. Every string put in the page goes through
:func:`html.escape`."""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

from fedloom.report.figures import Plot

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: #1d1d1f; background: #fff; margin: 0; }
main { max-width: 1100px; margin: 0 auto; padding: 16px 28px 48px; }
h1 { font-size: 1.6em; margin: 0.4em 0 0.1em; }
h2 { font-size: 1.25em; margin: 1.8em 0 0.5em; padding-bottom: 0.2em;
     border-bottom: 1px solid #ddd; }
h3 { font-size: 1.02em; margin: 1.2em 0 0.3em; }
.sub { color: #555; margin: 0 0 1em; }
nav { background: #f6f6f8; border: 1px solid #e3e3e8; border-radius: 6px;
      padding: 6px 12px; margin: 12px 0; }
nav a { margin-right: 14px; color: #0b57d0; text-decoration: none; white-space: nowrap; }
.banner { background: #fff4e5; border: 1px solid #f0c36d; padding: 8px 12px;
          border-radius: 6px; margin: 10px 0; }
figure { margin: 10px 0 22px; }
figure img { max-width: 100%; height: auto; display: block; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; margin-top: 4px; }
table { border-collapse: collapse; margin: 6px 0 16px; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 3px 9px; text-align: left;
         vertical-align: top; }
th { background: #f3f3f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.samples { width: 100%; table-layout: fixed; }
table.samples th:first-child { width: 3.5em; }
table.samples th:nth-child(2) { width: 32%; }
td.text { white-space: pre-wrap; overflow-wrap: anywhere; }
table.samples tr.first td { border-top: 2px solid #aaa; }
.none { color: #777; font-style: italic; }
.error { background: #fdecea; border: 1px solid #e6a19a; padding: 8px 12px;
         border-radius: 6px; }
pre { background: #f6f6f8; border: 1px solid #e3e3e8; padding: 10px; overflow-x: auto;
      font-size: 0.85em; }
"""


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; ValueError when ``data`` is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def image(plot: Plot) -> str:
    """``plot`` as a ``<figure>``: the PNG inline, at its own pixel size (narrower when
    the page is), with its caption."""
    data = plot.path.read_bytes()
    width, height = png_size(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    caption = f"<figcaption>{escape(plot.caption)}</figcaption>" if plot.caption else ""
    return (
        f'<figure><img src="{uri}" alt="{escape(plot.title)}" width="{width}" '
        f'height="{height}" data-file="{escape(plot.path.name)}">{caption}</figure>'
    )


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{escape(c)}</td>' if _is_number(c) else f"<td>{escape(c)}</td>"
            for c in row
        )
        + "</tr>"
        for row in rows
    )
    return (
        f"<table>{f'<thead><tr>{head}</tr></thead>' if header else ''}<tbody>{body}</tbody></table>"
    )


def preformatted(text: str) -> str:
    return f"<pre>{escape(text)}</pre>"


def paragraph(text: str, cls: str = "") -> str:
    attribute = f' class="{escape(cls)}"' if cls else ""
    return f"<p{attribute}>{escape(text)}</p>"


def heading(text: str) -> str:
    return f"<h3>{escape(text)}</h3>"


@dataclass
class Section:
    """A titled part of the page, listed in its navigation bar; ``parts`` are HTML made
    by this module's functions."""

    key: str
    title: str
    parts: list[str] = field(default_factory=list)


def page(title: str, subtitle: str, sections: Sequence[Section], banner: str = "") -> str:
    nav = " ".join(f'<a href="#{escape(s.key)}">{escape(s.title)}</a>' for s in sections)
    body = "\n".join(
        f'<section id="{escape(s.key)}"><h2>{escape(s.title)}</h2>\n'
        + "\n".join(s.parts)
        + "</section>"
        for s in sections
    )
    warning = f'<div class="banner">{escape(banner)}</div>' if banner else ""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head>\n"
        f"<body><main><h1>{escape(title)}</h1>{paragraph(subtitle, 'sub')}{warning}"
        f"<nav>{nav}</nav>\n{body}\n</main></body></html>\n"
    )

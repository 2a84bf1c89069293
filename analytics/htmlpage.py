"""Self-contained HTML pages (inline plots) for the reports kvgate writes: replay, plan."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from typing import Any

__all__ = ["page", "png_b64", "pyplot", "table"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 960px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
img { max-width: 100%; }
"""


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_b64(fig: Any) -> str:
    """A figure as a base64 PNG (the figure is closed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def table(rows: Sequence[Sequence[Any]]) -> str:
    """An HTML table; the first row is the header. Cells are escaped."""
    e = html.escape
    if not rows:
        return ""
    out = "<table><tr>" + "".join(f"<th>{e(str(c))}</th>" for c in rows[0]) + "</tr>"
    for r in rows[1:]:
        out += "<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>"
    return out + "</table>"


def page(title: str, body: str, plots: Sequence[tuple[str, str]] = ()) -> str:
    """A whole page: ``body`` (trusted HTML) then each (title, base64 PNG) plot."""
    e = html.escape
    images = "".join(
        f'<h2>{e(t)}</h2><img alt="{e(t)}" src="data:image/png;base64,{b64}">' for t, b64 in plots
    )
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}'
        f"</title>\n<style>{_STYLE}</style></head><body>\n<h1>{e(title)}</h1>\n{body}\n{images}\n"
        "</body></html>\n"
    )

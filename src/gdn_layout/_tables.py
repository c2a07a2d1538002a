"""Plain-text and HTML tables shared by the text, notebook and report views.

Every HTML fragment here is self-contained (inline styles only, no external CSS or JS) and
every piece of text in it goes through :func:`html.escape`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

__all__ = ["fmt_float", "html_table", "text_table"]

_TABLE_STYLE = (
    "border-collapse:collapse;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"
    "monospace;font-size:12px;margin:4px 0"
)
_CELL_STYLE = "padding:2px 8px;border-bottom:1px solid #ddd"
_CAPTION_STYLE = "caption-side:top;text-align:left;font-weight:bold;padding:2px 0"


def fmt_float(value: float | None, digits: int = 3) -> str:
    """A short, fixed-width-friendly rendering of a statistic; None is ``-``.

    >>> fmt_float(0.000123456), fmt_float(None), fmt_float(float("inf")), fmt_float(2.0)
    ('0.000123', '-', 'inf', '2')
    """
    if value is None:
        return "-"
    return f"{value:.{digits}g}"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A fixed-width table: headers, a rule, then rows; ``align`` has one ``l``/``r`` a column.

    >>> print(text_table(["a", "bb"], [["x", "1"], ["yy", "22"]], align="lr"))
    a   bb
    --  --
    x    1
    yy  22
    """
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    align = align.ljust(len(headers), "l")

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(w) if a == "r" else cell.ljust(w)
            for cell, w, a in zip(cells, widths, align, strict=False)
        ]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in rows)
    return "\n".join(out)


def html_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    align: str = "",
    caption: str | None = None,
    row_styles: Sequence[str] | None = None,
) -> str:
    """A self-contained HTML table; every header, cell and the caption are escaped.

    ``row_styles`` gives an inline CSS declaration per row (empty for none); it is trusted
    text from this package, never user data.

    >>> html_table(["<a>"], [["x & y"]])  # doctest: +ELLIPSIS
    '<table ...><th ...>&lt;a&gt;</th>...<td ...>x &amp; y</td>...'
    """
    align = align.ljust(len(headers), "l")

    def cell(tag: str, text: str, a: str) -> str:
        side = "right" if a == "r" else "left"
        return f'<{tag} style="{_CELL_STYLE};text-align:{side}">{html.escape(text)}</{tag}>'

    parts = [f'<table style="{_TABLE_STYLE}">']
    if caption is not None:
        parts.append(f'<caption style="{_CAPTION_STYLE}">{html.escape(caption)}</caption>')
    parts.append("<thead><tr>")
    parts.extend(cell("th", h, a) for h, a in zip(headers, align, strict=False))
    parts.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        style = row_styles[i] if row_styles is not None else ""
        parts.append(f'<tr style="{html.escape(style)}">' if style else "<tr>")
        parts.extend(cell("td", c, a) for c, a in zip(row, align, strict=False))
        parts.append("</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)

"""Fixed-width text tables and self-contained HTML tables, every text escaped."""

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
    """A statistic in ``digits`` significant digits; None is ``-``.

    >>> fmt_float(0.000123456), fmt_float(None), fmt_float(float("inf")), fmt_float(2.0)
    ('0.000123', '-', 'inf', '2')
    """
    return "-" if value is None else f"{value:.{digits}g}"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A fixed-width table: headers, a rule, then rows; ``align`` has one ``l``/``r`` a column.

    >>> print(text_table(["a", "bb"], [["x", "1"], ["yy", "22"]], align="lr"))
    a   bb
    --  --
    x    1
    yy  22
    """
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    align = align.ljust(len(headers), "l")

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if a == "r" else c.ljust(w)
            for c, w, a in zip(cells, widths, align, strict=False)
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def html_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    align: str = "",
    caption: str | None = None,
    row_styles: Sequence[str] | None = None,
) -> str:
    """An HTML table, every text escaped; ``row_styles``: this package's CSS for each row.

    >>> html_table(["<a>"], [["x & y"]])  # doctest: +ELLIPSIS
    '<table ...><th ...>&lt;a&gt;</th>...<td ...>x &amp; y</td>...'
    """
    align = align.ljust(len(headers), "l")

    def cells(tag: str, texts: Sequence[str]) -> str:
        return "".join(
            f'<{tag} style="{_CELL_STYLE};text-align:{"right" if a == "r" else "left"}">'
            f"{html.escape(text)}</{tag}>"
            for text, a in zip(texts, align, strict=False)
        )

    styles = row_styles or [""] * len(rows)
    parts = [f'<table style="{_TABLE_STYLE}">']
    if caption is not None:
        parts.append(f'<caption style="{_CAPTION_STYLE}">{html.escape(caption)}</caption>')
    parts.append(f"<thead><tr>{cells('th', headers)}</tr></thead><tbody>")
    for row, style in zip(rows, styles, strict=True):
        opening = f'<tr style="{html.escape(style)}">' if style else "<tr>"
        parts.append(f"{opening}{cells('td', row)}</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)

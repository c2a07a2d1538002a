"""Plain-text and HTML tables shared by the text, notebook and report views, and the layout's
own table (what ``str(layout)`` and a notebook show of a ``GdnBackwardLayout``).

Every HTML fragment here is self-contained (inline styles only, no external CSS or JS) and
every piece of text in it goes through :func:`html.escape`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
from numpy.typing import DTypeLike

from ._checks import not_a_layout
from ._dtypes import dtype_name, itemsize

__all__ = [
    "LayoutRow",
    "fmt_float",
    "html_table",
    "layout_caption",
    "layout_html",
    "layout_table",
    "layout_text",
    "text_table",
]

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


# -- the layout as a table -------------------------------------------------------------------
# gdn_layout.layout re-exports these, their public home; they are here, with the other tables,
# because layout sits above this module: they name GdnBackwardLayout by what they read of it.


class _Segment(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


@runtime_checkable
class _Layout(Protocol):
    @property
    def batch(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def state_size(self) -> int: ...
    @property
    def gate_per_channel(self) -> bool: ...
    @property
    def carry_state(self) -> bool: ...
    @property
    def total_elems(self) -> int: ...
    def segments(self) -> Sequence[_Segment]: ...
    def nbytes(self, dtype: DTypeLike) -> int: ...


class LayoutRow(NamedTuple):
    """One gradient's place in a packed buffer, with its size in bytes.

    See Also
    --------
    layout.layout_table : One row per gradient.
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    length: int
    nbytes: int


def layout_table(layout: _Layout, dtype: DTypeLike = np.float32) -> list[LayoutRow]:
    """One :class:`LayoutRow` ``(name, shape, offset, length, nbytes)`` per gradient.

    See Also
    --------
    layout.LayoutRow : One row.
    layout.layout_text : The rows as text.

    Examples
    --------
    >>> from gdn_layout import GdnBackwardLayout
    >>> layout_table(GdnBackwardLayout(1, 2, 1, 2), dtype=np.float64)[3]
    LayoutRow(name='dg', shape=(1, 2, 1), offset=12, length=2, nbytes=16)
    """
    if not isinstance(layout, _Layout):
        raise not_a_layout(layout)
    size = itemsize(dtype, "dtype")
    return [
        LayoutRow(seg.name, seg.shape, seg.offset, seg.length, seg.length * size)
        for seg in layout.segments()
    ]


def layout_text(layout: _Layout, dtype: DTypeLike = np.float32) -> str:
    """The layout as a fixed-width table with a total line, headed by its caption.

    See Also
    --------
    layout.layout_html : The same table as HTML.
    layout.layout_table : Its rows as records.

    Examples
    --------
    >>> from gdn_layout import GdnBackwardLayout
    >>> print(layout_text(GdnBackwardLayout(batch=1, seq=2, heads=1, state_size=2)))
    B=1 S=2 H=1 N=2, per-head gate, no state; float32
    grad   shape         offset  length  bytes
    -----  ------------  ------  ------  -----
    dq     (1, 2, 1, 2)       0       4     16
    dk     (1, 2, 1, 2)       4       4     16
    dv     (1, 2, 1, 2)       8       4     16
    dg     (1, 2, 1)         12       2      8
    dbeta  (1, 2, 1)         14       2      8
    total                            16     64
    """
    body, caption = _layout_cells(layout, dtype)
    return f"{caption}\n{text_table(_LAYOUT_HEADERS, body, align='llrrr')}"


def layout_html(layout: _Layout, dtype: DTypeLike = np.float32) -> str:
    """The layout as a self-contained HTML table (a notebook's ``_repr_html_``).

    See Also
    --------
    layout.layout_text : The same table as fixed-width text.
    plot.plot_layout : The layout as a picture.
    """
    body, caption = _layout_cells(layout, dtype)
    styles = [""] * (len(body) - 1) + ["font-weight:bold"]
    return html_table(_LAYOUT_HEADERS, body, align="llrrr", caption=caption, row_styles=styles)


_LAYOUT_HEADERS = ["grad", "shape", "offset", "length", "bytes"]


def _layout_cells(layout: _Layout, dtype: DTypeLike) -> tuple[list[list[str]], str]:
    """The table's rows, a total line last, and its caption."""
    rows = layout_table(layout, dtype)
    body = [[r.name, str(r.shape), str(r.offset), str(r.length), str(r.nbytes)] for r in rows]
    body.append(["total", "", "", str(layout.total_elems), str(layout.nbytes(dtype))])
    return body, f"{layout_caption(layout)}; {dtype_name(dtype, 'dtype')}"


def layout_caption(layout: _Layout) -> str:
    """A one-line description of a layout, short enough for a table caption.

    See Also
    --------
    layout.layout_text : The table this captions.
    layout.layout_html : The same table for a notebook.

    Examples
    --------
    >>> from gdn_layout import GdnBackwardLayout
    >>> layout_caption(GdnBackwardLayout(2, 5, 3, 8, gate_per_channel=True, carry_state=True))
    'B=2 S=5 H=3 N=8, per-channel gate, carried state'
    """
    gate = "per-channel gate" if layout.gate_per_channel else "per-head gate"
    state = "carried state" if layout.carry_state else "no state"
    return (
        f"B={layout.batch} S={layout.seq} H={layout.heads} N={layout.state_size}, {gate}, {state}"
    )

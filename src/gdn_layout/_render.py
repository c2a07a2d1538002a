"""Plain-text and HTML tables shared by the text, notebook and report views.

Every HTML fragment here is self-contained (inline styles only, no external CSS or JS) and
every piece of text in it goes through :func:`html.escape`.

>>> import numpy as np
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

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from .layout import GdnBackwardLayout, _not_a_layout

__all__ = [
    "GradStats",
    "LayoutRow",
    "grad_stats",
    "grads_html",
    "grads_text",
    "layout_html",
    "layout_table",
    "layout_text",
]

#: Elements converted to float64 at a time, so that statistics of a huge buffer never hold a
#: float64 copy of all of it.
CHUNK_ELEMENTS = 1 << 20

_TABLE_STYLE = (
    "border-collapse:collapse;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"
    "monospace;font-size:12px;margin:4px 0"
)
_CELL_STYLE = "padding:2px 8px;border-bottom:1px solid #ddd"
_CAPTION_STYLE = "caption-side:top;text-align:left;font-weight:bold;padding:2px 0"


class LayoutRow(NamedTuple):
    """One gradient's place in a packed buffer, with its size in bytes."""

    name: str
    shape: tuple[int, ...]
    offset: int
    length: int
    nbytes: int


class GradStats(NamedTuple):
    """Summary statistics of one gradient.

    ``min``, ``max``, ``mean`` and ``rms`` are taken over the finite values, in float64; they
    are None when there is no finite value (an empty array, or one of only NaN and Inf).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    min: float | None
    max: float | None
    mean: float | None
    rms: float | None
    nan: int
    inf: int


# -- layout --------------------------------------------------------------------------------


def layout_table(layout: GdnBackwardLayout, dtype: DTypeLike = np.float32) -> list[LayoutRow]:
    """One :class:`LayoutRow` ``(name, shape, offset, length, nbytes)`` per gradient.

    >>> layout_table(GdnBackwardLayout(1, 2, 1, 2), dtype=np.float64)[3]
    LayoutRow(name='dg', shape=(1, 2, 1), offset=12, length=2, nbytes=16)
    """
    _check_layout(layout)
    itemsize = np.dtype(dtype).itemsize
    return [
        LayoutRow(seg.name, seg.shape, seg.offset, seg.length, seg.length * itemsize)
        for seg in layout.segments()
    ]


def layout_text(layout: GdnBackwardLayout, dtype: DTypeLike = np.float32) -> str:
    """The layout as a fixed-width table with a total line, headed by the layout's repr."""
    rows = layout_table(layout, dtype)
    body = [[r.name, str(r.shape), str(r.offset), str(r.length), str(r.nbytes)] for r in rows]
    body.append(["total", "", "", str(layout.total_elems), str(layout.nbytes(dtype))])
    table = text_table(["grad", "shape", "offset", "length", "bytes"], body, align="llrrr")
    return f"{layout_caption(layout)}; {np.dtype(dtype).name}\n{table}"


def layout_html(layout: GdnBackwardLayout, dtype: DTypeLike = np.float32) -> str:
    """The layout as a self-contained HTML table (a notebook's ``_repr_html_``).

    >>> "<td" in layout_html(GdnBackwardLayout(1, 2, 1, 2))
    True
    """
    rows = layout_table(layout, dtype)
    body = [[r.name, str(r.shape), str(r.offset), str(r.length), str(r.nbytes)] for r in rows]
    body.append(["total", "", "", str(layout.total_elems), str(layout.nbytes(dtype))])
    return html_table(
        ["grad", "shape", "offset", "length", "bytes"],
        body,
        align="llrrr",
        caption=f"{layout_caption(layout)}; {np.dtype(dtype).name}",
        row_styles=[""] * len(rows) + ["font-weight:bold"],
    )


def layout_caption(layout: GdnBackwardLayout) -> str:
    """A one-line description of a layout, short enough for a table caption.

    >>> layout_caption(GdnBackwardLayout(2, 5, 3, 8, gate_per_channel=True, carry_state=True))
    'B=2 S=5 H=3 N=8, per-channel gate, carried state'
    """
    gate = "per-channel gate" if layout.gate_per_channel else "per-head gate"
    state = "carried state" if layout.carry_state else "no state"
    return (
        f"B={layout.batch} S={layout.seq} H={layout.heads} N={layout.state_size}, {gate}, {state}"
    )


# -- gradients -----------------------------------------------------------------------------


def grad_stats(grads: Mapping[str, ArrayLike | None] | Any) -> list[GradStats]:
    """Statistics of each gradient of a :class:`~gdn_layout.GdnGrads` (or a name->array map).

    A ``dstate`` of None is skipped. NaN and Inf are counted, and the other statistics are
    taken over the finite values only, so one NaN does not hide the rest.

    >>> import numpy as np
    >>> row = grad_stats({"dbeta": np.array([1.0, -3.0, np.nan], dtype=np.float32)})[0]
    >>> row.min, row.max, row.mean, row.nan, row.inf
    (-3.0, 1.0, -1.0, 1, 0)
    >>> grad_stats({"dq": np.zeros((0, 4))})[0].rms is None
    True
    """
    return [_stats(name, np.asarray(value)) for name, value in _named_arrays(grads)]


def grads_text(grads: Mapping[str, ArrayLike | None] | Any) -> str:
    """:func:`grad_stats` as a fixed-width table."""
    return text_table(_STATS_HEADERS, _stats_cells(grad_stats(grads)), align=_STATS_ALIGN)


def grads_html(grads: Mapping[str, ArrayLike | None] | Any) -> str:
    """:func:`grad_stats` as a self-contained HTML table (a notebook's ``_repr_html_``)."""
    rows = grad_stats(grads)
    styles = ["background:#fdd" if r.nan or r.inf else "" for r in rows]
    return html_table(
        _STATS_HEADERS,
        _stats_cells(rows),
        align=_STATS_ALIGN,
        caption="GdnGrads",
        row_styles=styles,
    )


_STATS_HEADERS = ["grad", "shape", "dtype", "min", "max", "mean", "rms", "nan", "inf"]
_STATS_ALIGN = "lllrrrrrr"


def _stats_cells(rows: Sequence[GradStats]) -> list[list[str]]:
    return [
        [
            r.name,
            str(r.shape),
            r.dtype,
            fmt_float(r.min),
            fmt_float(r.max),
            fmt_float(r.mean),
            fmt_float(r.rms),
            str(r.nan),
            str(r.inf),
        ]
        for r in rows
    ]


def _named_arrays(grads: Any) -> Iterable[tuple[str, Any]]:
    if hasattr(grads, "_asdict"):  # GdnGrads, or any NamedTuple of arrays
        items = grads._asdict().items()
    elif isinstance(grads, Mapping):
        items = grads.items()
    else:
        raise TypeError(
            f"grads must be a GdnGrads or a mapping of name to array, got {type(grads).__name__}"
        )
    return [(str(name), value) for name, value in items if value is not None]


def _stats(name: str, array: np.ndarray[Any, Any]) -> GradStats:
    flat = array.reshape(-1)
    count = nan = inf = 0
    total = squares = 0.0
    low, high = math.inf, -math.inf
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS].astype(np.float64)
        finite = np.isfinite(chunk)
        nan += int(np.isnan(chunk).sum())
        inf += int(np.isinf(chunk).sum())
        values = chunk[finite]
        if values.size:
            count += values.size
            total += float(values.sum())
            squares += float(np.dot(values, values))
            low = min(low, float(values.min()))
            high = max(high, float(values.max()))
    if count == 0:
        return GradStats(name, array.shape, array.dtype.name, None, None, None, None, nan, inf)
    return GradStats(
        name,
        array.shape,
        array.dtype.name,
        low,
        high,
        total / count,
        math.sqrt(squares / count),
        nan,
        inf,
    )


# -- shared table machinery ----------------------------------------------------------------


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


def _check_layout(layout: object) -> None:
    if not isinstance(layout, GdnBackwardLayout):
        raise _not_a_layout(layout)

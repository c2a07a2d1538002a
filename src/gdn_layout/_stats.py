"""Per-gradient statistics, and their text and HTML tables."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from ._norms import CHUNK_ELEMENTS, Norm
from ._tables import fmt_float, html_table, text_table

__all__ = ["GradStats", "grad_stats", "grads_html", "grads_text"]


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
    total, norm = 0.0, Norm()
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
            norm.add(np.abs(values))
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
        norm.rms(count),
        nan,
        inf,
    )

"""Per-gradient statistics (``str(grads)``, ``gdn-layout inspect``) and their tables."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from ._norms import CHUNK_ELEMENTS, Norm
from ._tables import fmt_float, html_table, text_table

__all__ = ["GradStats", "grad_stats", "grads_html", "grads_text"]


class GradStats(NamedTuple):
    """One gradient's statistics of its finite values (None when it has none), and its NaN and
    Inf counts."""

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
    """:class:`GradStats` of each gradient of a ``GdnGrads`` or a name-to-array map.

    >>> row = grad_stats({"dbeta": np.array([1.0, -3.0, np.nan], dtype=np.float32)})[0]
    >>> row.min, row.max, row.mean, row.nan, row.inf
    (-3.0, 1.0, -1.0, 1, 0)
    """
    if hasattr(grads, "_asdict"):  # GdnGrads, or any NamedTuple of arrays
        grads = grads._asdict()
    if not isinstance(grads, Mapping):
        raise TypeError(
            f"grads must be a GdnGrads or a mapping of name to array, got {type(grads).__name__}"
        )
    return [_stats(str(name), np.asarray(a)) for name, a in grads.items() if a is not None]


def grads_text(grads: Mapping[str, ArrayLike | None] | Any) -> str:
    """:func:`grad_stats` as a fixed-width table."""
    return text_table(_HEADERS, _cells(grad_stats(grads)), align="lllrrrrrr")


def grads_html(grads: Mapping[str, ArrayLike | None] | Any) -> str:
    """:func:`grad_stats` as an HTML table, rows with a NaN or an Inf shaded."""
    rows = grad_stats(grads)
    styles = ["background:#fdd" if r.nan or r.inf else "" for r in rows]
    return html_table(
        _HEADERS, _cells(rows), align="lllrrrrrr", caption="GdnGrads", row_styles=styles
    )


_HEADERS = ["grad", "shape", "dtype", "min", "max", "mean", "rms", "nan", "inf"]


def _cells(rows: list[GradStats]) -> list[list[str]]:
    return [
        [r.name, str(r.shape), r.dtype, *map(fmt_float, r[3:7]), str(r.nan), str(r.inf)]
        for r in rows
    ]


def _stats(name: str, array: np.ndarray[Any, Any]) -> GradStats:
    # In chunks, so that a huge buffer is never held in float64 all at once.
    flat = array.reshape(-1)
    count = nan = inf = 0
    total, norm, low, high = 0.0, Norm(), math.inf, -math.inf
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS].astype(np.float64)
        nan += int(np.isnan(chunk).sum())
        inf += int(np.isinf(chunk).sum())
        values = chunk[np.isfinite(chunk)]
        if values.size:
            count += values.size
            total += float(values.sum())
            norm.add(np.abs(values))
            low, high = min(low, float(values.min())), max(high, float(values.max()))
    if count == 0:
        return GradStats(name, array.shape, array.dtype.name, None, None, None, None, nan, inf)
    mean, rms = total / count, norm.rms(count)
    return GradStats(name, array.shape, array.dtype.name, low, high, mean, rms, nan, inf)

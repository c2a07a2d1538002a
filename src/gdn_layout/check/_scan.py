"""The one pass over a gradient: its figures, its error maps and its verdict, in bounded memory.

A gradient of shape ``[d0, d1, d2, *rest]`` is visited as *lines*: runs of ``prod(rest)``
consecutive elements that share ``(d0, d1, d2)``, the cell of the per-batch error map they
fall in. Chunks are whole lines when a line is short, and pieces of one line when it is long,
so that no chunk is larger than :data:`~gdn_layout._norms.CHUNK_ELEMENTS` whatever the shape
(a ``dstate`` row of ``N * N`` elements is never converted at once).

The per-batch map is ``[d0, d1, d2]`` while it has at most :data:`MAP_CELLS` cells; a larger
one is binned: each cell holds the largest error (and the number of elements out of tolerance)
of a block of ``bins[1] x bins[2]`` positions, the second axis binned first, the third only
past :data:`MAP_COLUMNS`. Only when ``d0`` alone is too large for one row per batch element
is the batch binned too, by ``bins[0]``. The map over ``(d1, d2)`` is the per-batch map's
maximum over the batch, so both share their bins.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Final, TypeVar

import numpy as np
from numpy.typing import NDArray

from .._norms import CHUNK_ELEMENTS, Norm, rms_ratio_of
from ..layout import Segment
from ._criterion import Criterion
from ._records import GradComparison

__all__ = ["MAP_CELLS", "MAP_COLUMNS", "ErrorMap", "cause_maps", "element_chunks", "scan"]

_Cell = TypeVar("_Cell", bound=np.generic)

#: The most cells of a per-batch error map: 8 MiB of float64. A larger map is binned.
MAP_CELLS: Final = 1 << 20
#: The most columns (the third axis) of a binned map, so that the rows keep a useful number.
MAP_COLUMNS: Final = 1 << 10


def element_chunks(shape: tuple[int, ...], chunk: int | None = None) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` flat element ranges covering ``shape`` in C order: whole lines at a
    time when a line fits in a chunk (of :data:`CHUNK_ELEMENTS`, or ``chunk``), else pieces
    of a single line."""
    chunk = CHUNK_ELEMENTS if chunk is None else chunk
    size = math.prod(shape)
    line = math.prod(shape[3:])
    if size == 0:
        return
    if line <= chunk:
        step = line * (chunk // line)
        for start in range(0, size, step):
            yield start, min(start + step, size)
        return
    for begin in range(0, size, line):
        for start in range(begin, begin + line, chunk):
            yield start, min(start + chunk, begin + line)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _bins(batch: int, rows: int, cols: int) -> tuple[int, int, int]:
    """``(batch, row, column)`` bins that leave at most MAP_CELLS cells in all."""
    budget = MAP_CELLS // max(batch, 1)  # cells for each batch element
    if rows * cols <= budget:
        return 1, 1, 1
    col_bin = _ceil(cols, MAP_COLUMNS) if cols > MAP_COLUMNS else 1
    out_cols = _ceil(cols, col_bin)
    if budget >= out_cols:
        return 1, _ceil(rows, budget // out_cols), col_bin
    # Even one row per batch element is too many: every row in one, and the batch binned.
    return _ceil(batch, MAP_CELLS // out_cols), max(rows, 1), col_bin


class ErrorMap:
    """The largest error, and how many elements are out of tolerance, per ``(d0, d1, d2)``
    cell of a gradient of ``shape``; binned when large."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        batch, self.period, self.width = shape[0], shape[1], shape[2]
        self.line = math.prod(shape[3:])
        self.bins = _bins(batch, self.period, self.width)
        cells = (_ceil(batch, self.bins[0]), _ceil(self.period, self.bins[1]))
        self.cols = _ceil(self.width, self.bins[2])
        self.cells = np.zeros((*cells, self.cols), dtype=np.float64)
        self.counts = np.zeros((*cells, self.cols), dtype=np.int64)

    def update(self, start: int, values: NDArray[np.float64], out: NDArray[np.bool_]) -> None:
        """Fold the errors ``values`` and the out-of-tolerance flags ``out`` of the chunk that
        starts at flat index ``start`` into the maps."""
        whole = self.whole_lines(start, values.size)
        peaks = values.reshape(-1, self.line).max(axis=1) if whole else values.max(keepdims=True)
        outs = out.reshape(-1, self.line).sum(axis=1) if whole else out.sum(keepdims=True)
        cells = self.cells_of(start, peaks.size)
        np.maximum.at(self.cells.reshape(-1), cells, peaks)
        np.add.at(self.counts.reshape(-1), cells, outs)

    def whole_lines(self, start: int, size: int) -> bool:
        """Whether the chunk of ``size`` elements at ``start`` is whole lines (else a piece
        of one long line)."""
        return start % self.line == 0 and size % self.line == 0

    def cells_of(self, start: int, lines: int) -> NDArray[np.int64]:
        """The flat cell of each of the ``lines`` lines from the one holding ``start``."""
        first = start // self.line
        index = np.arange(first, first + lines, dtype=np.int64)
        if self.bins == (1, 1, 1):  # the cells in C order are the lines
            return index
        rest, col = np.divmod(index, self.width)
        batch, row = np.divmod(rest, self.period)
        block = batch // self.bins[0] * self.cells.shape[1] + row // self.bins[1]
        cells: NDArray[np.int64] = block * self.cols + col // self.bins[2]
        return cells


def scan(
    seg: Segment,
    actual: NDArray[Any],
    expected: NDArray[Any],
    criterion: Criterion,
    equal_nan: bool,
) -> GradComparison:
    """One gradient's figures, error maps and verdict under ``criterion``, in one pass of
    chunks of at most ``CHUNK_ELEMENTS`` elements (see the module)."""
    name, shape = seg.name, seg.shape
    elementwise = criterion.counts_elements
    # Chunks of elements, never of rows: a dstate row alone is N * N elements. The per-batch
    # maps are over the first three axes, (b, s, h), or (b, h, i) for dstate, turned into
    # (b, i, h); the error map is their maximum over b. All of them are binned when large.
    emap = ErrorMap(shape)
    transpose = seg.axes[1] == "h"

    nan_a = inf_a = nan_e = inf_e = mismatches = bad_count = bad_nan = 0
    max_abs = max_rel = 0.0
    # |a - e| of two finite values overflows past the largest float; such pairs go into
    # norm_half as |a/2 - e/2|, so that the RMS ratio stays exact up to the largest values.
    norm_diff, norm_half, norm_exp = Norm(), Norm(), Norm()
    best = -math.inf
    worst_index: int | None = None
    worst_a = worst_e = 0.0

    for start, stop in element_chunks(shape):
        a = actual[start:stop].astype(np.float64)
        e = expected[start:stop].astype(np.float64)
        a_nan, e_nan = np.isnan(a), np.isnan(e)
        a_inf, e_inf = np.isinf(a), np.isinf(e)
        nan_a += int(a_nan.sum())
        nan_e += int(e_nan.sum())
        inf_a += int(a_inf.sum())
        inf_e += int(e_inf.sum())
        finite = ~(a_nan | e_nan | a_inf | e_inf)
        abs_e = np.where(finite, np.abs(e), 0.0)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(finite, np.abs(a - e), 0.0)
        overflowed = np.isinf(diff)  # both finite, yet |a - e| is past the largest float
        # Everything below sees finite numbers; non-finite pairs are patched in after.
        bad = ~finite
        if bad.any():
            matched = bad & ((a == e) | (equal_nan & a_nan & e_nan))
            bad &= ~matched
            bad_count += int(bad.sum())
            bad_nan += int((bad & (a_nan | e_nan)).sum())
            diff_map = np.where(bad, np.inf, diff)
        else:
            diff_map = diff
        allowed = criterion.allowances(abs_e)
        out = (diff > allowed) | bad
        counted = out if elementwise else bad  # what the criterion counts, element by element
        mismatches += int(counted.sum())
        if finite.any():
            max_abs = max(max_abs, float(diff.max()))
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                rel = np.where(diff == 0, 0.0, diff / abs_e)
            if overflowed.any():
                half = np.abs(a[overflowed] * 0.5 - e[overflowed] * 0.5)
                rel[overflowed] = half / (abs_e[overflowed] * 0.5)
                norm_half.add(half)
                norm_diff.add(np.where(overflowed, 0.0, diff))
            else:
                norm_diff.add(diff)
            max_rel = max(max_rel, float(rel.max()))
            norm_exp.add(abs_e)
        score = diff - allowed if elementwise else diff.copy()
        score[~finite] = -math.inf  # matching non-finite pairs are never the worst
        score[bad] = math.inf
        local = int(np.argmax(score))
        if worst_index is None or score[local] > best:
            best = float(score[local])
            worst_index = start + local
            worst_a, worst_e = float(a[local]), float(e[local])
        emap.update(start, diff_map, counted)

    rms_ratio = rms_ratio_of(norm_diff, norm_half, norm_exp)
    if bad_count:  # the error of a non-finite mismatch is NaN (or Inf), whatever the rest is
        max_abs = max_rel = rms_ratio = math.nan if bad_nan else math.inf
    worst = (
        None if worst_index is None else tuple(int(i) for i in np.unravel_index(worst_index, shape))
    )
    batch_cells, counts, bins = emap.cells, emap.counts, emap.bins
    if transpose:  # [B, H, N] to [B, N, H]
        batch_cells = np.ascontiguousarray(batch_cells.transpose(0, 2, 1))
        counts = np.ascontiguousarray(counts.transpose(0, 2, 1))
    return GradComparison(
        name=name,
        shape=shape,
        actual_dtype=actual.dtype.name,
        expected_dtype=expected.dtype.name,
        size=seg.length,
        criterion=criterion,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        rms_ratio=rms_ratio,
        mismatches=mismatches,
        nonfinite_mismatches=bad_count,
        nan_actual=nan_a,
        inf_actual=inf_a,
        nan_expected=nan_e,
        inf_expected=inf_e,
        worst=worst,
        worst_actual=None if worst is None else worst_a,
        worst_expected=None if worst is None else worst_e,
        error_map=_read_only(batch_cells.max(axis=0, initial=0.0)),
        batch_error_map=_read_only(batch_cells),
        mismatch_map=_read_only(counts),
        error_map_bins=(bins[2], bins[1]) if transpose else (bins[1], bins[2]),
        batch_bins=bins[0],
    )


def cause_maps(
    seg: Segment, actual: NDArray[Any], expected: NDArray[Any]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The maps that show a failing gradient's cause: its signed error and its ratio.

    In each cell, the signed error is the ``a - e`` of largest magnitude (NaN for a non-finite
    mismatch) and the ratio is ``<a, e> / <e, e>`` over the cell's finite pairs (NaN where
    every ``e`` is zero): a constant factor is one colour everywhere. The cells are those of
    ``batch_error_map``, ``[B, S, H]`` binned alike; ``dstate``'s are ``[H, N, N]`` over
    (head, key row i, value column j), over the batch, so that a transpose is a mirrored
    pattern (binned along i and j past :data:`MAP_CELLS`). One pass of chunks, as :func:`scan`.
    """
    shape = seg.shape
    if seg.name == "dstate":
        heads, n = shape[1], shape[2]
        fold = max(1, math.ceil(math.sqrt(heads * n * n / MAP_CELLS)))
        side = _ceil(n, fold)
        maps = _CauseMap((heads, side, side))
        per_batch = heads * n * n
        # Each element's cell is worked out apart: a dozen arrays of the chunk's length.
        for start, stop in element_chunks(shape, CHUNK_ELEMENTS // 8):
            flat = np.arange(start, stop, dtype=np.int64) % per_batch
            head, rest = np.divmod(flat, n * n)
            row, col = np.divmod(rest, n)
            cells = (head * side + row // fold) * side + col // fold
            maps.update(cells, actual[start:stop], expected[start:stop], 1)
        return maps.signed_and_ratio()
    geometry = ErrorMap(shape)  # the bins of the gradient's error maps
    maps = _CauseMap(geometry.cells.shape)
    for start, stop in element_chunks(shape):
        whole = geometry.whole_lines(start, stop - start)
        line = geometry.line if whole else stop - start
        cells = geometry.cells_of(start, (stop - start) // line)
        maps.update(cells, actual[start:stop], expected[start:stop], line)
    return maps.signed_and_ratio()


class _CauseMap:
    """Signed-error and ratio cells folded from chunks of runs of ``line`` elements."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.peak = np.full(shape, -1.0)
        self.signed = np.zeros(shape)
        self.dot = np.zeros(shape)
        self.norm = np.zeros(shape)

    def update(self, cells: NDArray[np.int64], a: NDArray[Any], e: NDArray[Any], line: int) -> None:
        """Fold ``a`` against ``e``, runs of ``line`` elements into each of ``cells``."""
        a, e = a.astype(np.float64), e.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(a == e, 0.0, a - e)  # equal infinities match
        finite = np.isfinite(diff)
        size = np.where(finite, np.abs(diff), np.inf).reshape(-1, line)
        at = size.argmax(axis=1)
        rows = np.arange(at.size)
        peaks = size[rows, at]
        signed = np.where(finite, diff, np.nan).reshape(-1, line)[rows, at]
        both = np.isfinite(a) & np.isfinite(e)
        with np.errstate(over="ignore", invalid="ignore"):
            dots = np.where(both, a * e, 0.0).reshape(-1, line).sum(axis=1)
            norms = np.where(both, e * e, 0.0).reshape(-1, line).sum(axis=1)
        peak = self.peak.reshape(-1)
        np.maximum.at(peak, cells, peaks)
        won = peaks >= peak[cells]  # the run that holds its cell's largest error so far
        self.signed.reshape(-1)[cells[won]] = signed[won]
        np.add.at(self.dot.reshape(-1), cells, dots)
        np.add.at(self.norm.reshape(-1), cells, norms)

    def signed_and_ratio(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(self.norm > 0, self.dot / self.norm, np.nan)
        return _read_only(self.signed), _read_only(ratio)


def _read_only(cells: NDArray[_Cell]) -> NDArray[_Cell]:
    cells.flags.writeable = False
    return cells

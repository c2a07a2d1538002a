"""Work through one gradient in chunks of elements, and build its error maps in bounded memory.

A gradient of shape ``[d0, d1, d2, *rest]`` is visited as *lines*: runs of ``prod(rest)``
consecutive elements that share ``(d0, d1, d2)``, the cell of the per-batch error map they
fall in. Chunks are whole lines when a line is short, and pieces of one line when it is long,
so that no chunk is larger than :data:`~gdn_layout._stats.CHUNK_ELEMENTS` whatever the shape
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
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ._stats import CHUNK_ELEMENTS

__all__ = ["MAP_CELLS", "MAP_COLUMNS", "ErrorMap", "chunks"]

#: The most cells of a per-batch error map: 8 MiB of float64. A larger map is binned.
MAP_CELLS: Final = 1 << 20
#: The most columns (the third axis) of a binned map, so that the rows keep a useful number.
MAP_COLUMNS: Final = 1 << 10


def chunks(shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` flat element ranges covering ``shape`` in C order: whole lines at a
    time when a line fits in a chunk, else pieces of a single line."""
    size = math.prod(shape)
    line = math.prod(shape[3:])
    if size == 0:
        return
    if line <= CHUNK_ELEMENTS:
        step = line * (CHUNK_ELEMENTS // line)
        for start in range(0, size, step):
            yield start, min(start + step, size)
        return
    for begin in range(0, size, line):
        for start in range(begin, begin + line, CHUNK_ELEMENTS):
            yield start, min(start + CHUNK_ELEMENTS, begin + line)


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
        if start % self.line == 0 and values.size % self.line == 0:
            peaks = values.reshape(-1, self.line).max(axis=1)
            outs = out.reshape(-1, self.line).sum(axis=1)
            lines = np.arange(start // self.line, start // self.line + peaks.size, dtype=np.int64)
        else:  # a piece of one long line
            peaks = values.max(keepdims=True)
            outs = out.sum(keepdims=True)
            lines = np.array([start // self.line], dtype=np.int64)
        if self.bins == (1, 1, 1):  # the cells in C order are the lines
            cells = lines
        else:
            rest, col = np.divmod(lines, self.width)
            batch, row = np.divmod(rest, self.period)
            block = batch // self.bins[0] * self.cells.shape[1] + row // self.bins[1]
            cells = block * self.cols + col // self.bins[2]
        np.maximum.at(self.cells.reshape(-1), cells, peaks)
        np.add.at(self.counts.reshape(-1), cells, outs)

"""Work through one gradient in chunks of elements, and build its error map in bounded memory.

A gradient of shape ``[d0, d1, d2, *rest]`` is visited as *lines*: runs of ``prod(rest)``
consecutive elements that share ``(d1, d2)``, the cell of the error map they fall in. Chunks
are whole lines when a line is short, and pieces of one line when it is long, so that no
chunk is larger than :data:`~gdn_layout._stats.CHUNK_ELEMENTS` whatever the shape (a ``dstate``
row of ``N * N`` elements is never converted at once). The map is ``[d1, d2]`` while it has at
most :data:`MAP_CELLS` cells; a larger map is binned: each cell holds the largest error of a
block of ``bins[0] x bins[1]`` positions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Final

import numpy as np
from numpy.typing import NDArray

from ._stats import CHUNK_ELEMENTS

__all__ = ["MAP_CELLS", "MAP_COLUMNS", "ErrorMap", "chunks"]

#: The most cells of an error map: 8 MiB of float64. A larger map is binned.
MAP_CELLS: Final = 1 << 20
#: The most columns (the second axis) of a binned map, so that the rows keep a useful number.
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


def _bins(rows: int, cols: int) -> tuple[int, int]:
    if rows * cols <= MAP_CELLS:
        return 1, 1
    col_bin = -(-cols // MAP_COLUMNS) if cols > MAP_COLUMNS else 1
    out_cols = -(-cols // col_bin)
    row_bin = -(-rows // max(1, MAP_CELLS // out_cols))
    return row_bin, col_bin


class ErrorMap:
    """The largest error per ``(d1, d2)`` cell of a gradient of ``shape``, binned when large."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.period, self.width = shape[1], shape[2]
        self.line = math.prod(shape[3:])
        self.bins = _bins(self.period, self.width)
        rows = -(-self.period // self.bins[0])
        self.cols = -(-self.width // self.bins[1])
        self.cells = np.zeros((rows, self.cols), dtype=np.float64)

    def update(self, start: int, values: NDArray[np.float64]) -> None:
        """Fold the errors of the chunk that starts at flat index ``start`` into the map."""
        if start % self.line == 0 and values.size % self.line == 0:
            peaks = values.reshape(-1, self.line).max(axis=1)
            lines = np.arange(start // self.line, start // self.line + peaks.size, dtype=np.int64)
        else:  # a piece of one long line
            peaks = values.max(keepdims=True)
            lines = np.array([start // self.line], dtype=np.int64)
        if self.bins == (1, 1):  # the cells in C order are the lines, period after period
            cells = lines % (self.period * self.width)
        else:
            rows = (lines // self.width) % self.period // self.bins[0]
            cells = rows * self.cols + lines % self.width // self.bins[1]
        np.maximum.at(self.cells.reshape(-1), cells, peaks)

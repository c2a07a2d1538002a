"""Work spread over threads: NumPy releases the GIL in its loops and products."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .._checks import integer

__all__ = ["groups", "mapped", "resolve_workers", "spread"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def mapped(func: Callable[[_T], _R], items: Iterable[_T], threads: int) -> list[_R]:
    """``[func(item) for item in items]`` on up to ``threads`` threads, raising what the plain loop
    would raise first."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [func(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        futures = [pool.submit(func, item) for item in items]
        return [future.result() for future in futures]


def resolve_workers(value: object, func: str) -> int:
    """The number of threads ``workers=value`` asks ``func`` for: a positive integer as given,
    or for None the cores this process may use.

    See Also
    --------
    reference.backward : Takes ``workers``.
    make_fixture : Takes ``workers``.

    Examples
    --------
    >>> resolve_workers(3, "backward")
    3
    """
    if value is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)
    return integer(value, f"{func}: workers", least=1, or_none=True)


def groups(batch: int, heads: int, count: int) -> list[tuple[slice, slice]]:
    """At most ``count`` ``(batch, heads)`` slices covering every pair once: whole batch elements
    while there are enough, else each one's heads in ranges."""
    count = max(1, min(count, batch * heads))
    if count == 1 or batch == 0 or heads == 0:
        return [(slice(0, batch), slice(0, heads))]
    if batch >= count:
        return [(rows, slice(0, heads)) for rows in _ranges(batch, count)]
    per_row = -(-count // batch)
    return [(slice(row, row + 1), part) for row in range(batch) for part in _ranges(heads, per_row)]


def _ranges(size: int, count: int) -> Iterator[slice]:
    """``[0, size)`` in ``min(count, size)`` contiguous ranges of near-equal length."""
    count = min(count, size)
    for index in range(count):
        yield slice(size * index // count, size * (index + 1) // count)


def spread(run: Callable[[slice, slice], None], batch: int, heads: int, threads: int) -> None:
    """``run(batch, heads)`` on each group of :func:`groups`, on ``threads`` threads."""
    mapped(lambda part: run(*part), groups(batch, heads, threads), threads)

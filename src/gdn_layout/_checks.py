"""Validators shared by several modules; each raises the error a caller would have raised."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MAX_NBYTES",
    "array_can_exist",
    "non_negative_int",
    "not_a_layout",
    "require_matplotlib",
]

#: The most bytes a NumPy array can span: a shape beyond it is refused, even one with a 0 in it.
MAX_NBYTES = int(np.iinfo(np.intp).max)

PLOT_HINT = "pip install gdn-layout[plot]"


def non_negative_int(value: object, what: str) -> int:
    """``value`` as a Python int: any integer, NumPy's included, but not a bool.

    >>> non_negative_int(np.int64(3), "seed")
    3
    >>> non_negative_int(True, "seed")
    Traceback (most recent call last):
    TypeError: seed must be a non-negative integer, got bool True
    """
    # bool is an int subclass, and operator.index accepts NumPy integers: refuse the first,
    # keep the second, and reject everything that is not an integer at all.
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a non-negative integer, got bool {value!r}")
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what} must be a non-negative integer, got {type(value).__name__} {value!r}"
        ) from None
    if index < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {index}")
    return index


def not_a_layout(value: object, where: str = "") -> TypeError:
    """The error for a ``layout`` argument that is not a ``GdnBackwardLayout``."""
    prefix = f"{where}: " if where else ""
    return TypeError(f"{prefix}layout must be a GdnBackwardLayout, got {type(value).__name__}")


def require_matplotlib() -> None:
    """Import matplotlib, or raise an ImportError that names the extra to install."""
    try:
        import matplotlib
        import matplotlib.figure  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"gdn_layout.plot needs matplotlib, which is not installed: {PLOT_HINT}"
        ) from err


def array_can_exist(shape: Sequence[int], itemsize: int) -> bool:
    """Whether NumPy can make an array of ``shape``: its non-zero dimensions, multiplied with
    the item size, must fit in an ``intp`` (NumPy refuses the shape even when a dimension is 0).

    >>> array_can_exist((0, 2**40, 2**40), 4), array_can_exist((0, 2**40), 4)
    (False, True)
    """
    return math.prod(d for d in shape if d) * itemsize <= MAX_NBYTES

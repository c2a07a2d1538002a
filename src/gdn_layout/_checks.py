"""Validators shared by several modules; each raises the error a caller would have raised."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "MAX_NBYTES",
    "array_can_exist",
    "check_shape",
    "dimension",
    "flag",
    "integer",
    "integer_words",
    "not_a_layout",
    "require_matplotlib",
    "shape_of",
]

#: The most bytes a NumPy array can span: a shape beyond it is refused, even one with a 0 in it.
MAX_NBYTES = int(np.iinfo(np.intp).max)

PLOT_HINT = "pip install 'gdn-layout[plot]' (from a clone: pip install '.[plot]')"
#: ``usize::MAX + 1`` on the 64-bit targets RLX runs on.
USIZE_LIMIT = 1 << 64


def integer(
    value: object, what: str, *, least: int = 0, most: int | None = None, or_none: bool = False
) -> int:
    """``value`` as a Python int from ``least`` to ``most``: any integer, NumPy's included, but
    not a bool. ``or_none`` only says in the message that the caller also takes None.

    >>> integer(np.int64(3), "seed")
    3
    >>> integer(True, "seed")
    Traceback (most recent call last):
    TypeError: seed must be a non-negative integer, got bool True
    >>> integer(0, "workers", least=1, or_none=True)
    Traceback (most recent call last):
    ValueError: workers must be a positive integer or None, got 0
    """
    expected = f"{what} must be {integer_words(least, most)}{' or None' if or_none else ''}"
    # bool is an int subclass, and operator.index accepts NumPy integers: refuse the first,
    # keep the second, and reject everything that is not an integer at all.
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{expected}, got bool {value!r}")
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}") from None
    if index < least or (most is not None and index > most):
        raise ValueError(f"{expected}, got {index}")
    return index


def integer_words(least: int, most: int | None = None) -> str:
    """How a message names the integers from ``least`` to ``most``."""
    if most is not None:
        return f"an integer from {least} to {most}"
    return {0: "a non-negative integer", 1: "a positive integer"}.get(
        least, f"an integer of at least {least}"
    )


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


# -- the layout's arguments, and Rust's usize arithmetic ----------------------------------


def dimension(name: str, value: object) -> int:
    index = integer(value, name)
    if index >= USIZE_LIMIT:
        raise ValueError(f"{name} must fit in a 64-bit usize, got {index}")
    return index


def flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def shape_of(name: str, value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", value)
    try:
        return tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"{name} must be an array or a shape, got {type(value).__name__}") from None


def check_shape(
    name: str, received: tuple[int, ...], expected: tuple[int, ...], layout: object
) -> None:
    if received != expected:
        raise ValueError(f"{name} has shape {received}, expected {expected} for {layout!r}")


# -- what NumPy can allocate --------------------------------------------------------------


def array_can_exist(shape: Sequence[int], itemsize: int) -> bool:
    """Whether NumPy can make an array of ``shape``: its non-zero dimensions, multiplied with
    the item size, must fit in an ``intp`` (NumPy refuses the shape even when a dimension is 0).

    >>> array_can_exist((0, 2**40, 2**40), 4), array_can_exist((0, 2**40), 4)
    (False, True)
    """
    return math.prod(d for d in shape if d) * itemsize <= MAX_NBYTES

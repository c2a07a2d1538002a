"""Argument validators shared by several modules; each raises the error a caller would raise."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MAX_NBYTES",
    "PLOT_HINT",
    "array_can_exist",
    "flag",
    "integer",
    "integer_words",
    "not_a_layout",
    "require_matplotlib",
]

#: The most bytes a NumPy array can span: a shape beyond it is refused, even one with a 0 in it.
MAX_NBYTES = int(np.iinfo(np.intp).max)
PLOT_HINT = "pip install 'gdn-layout[plot]' (from a clone: pip install '.[plot]')"


def integer(
    value: object, what: str, *, least: int = 0, most: int | None = None, or_none: bool = False
) -> int:
    """``value`` as a Python int from ``least`` to ``most`` (any integer but a bool);
    ``or_none`` says in the message that the caller also takes None.

    >>> integer(True, "seed")
    Traceback (most recent call last):
    TypeError: seed must be a non-negative integer, got bool True
    >>> integer(0, "workers", least=1, or_none=True)
    Traceback (most recent call last):
    ValueError: workers must be a positive integer or None, got 0
    """
    boolean = isinstance(value, (bool, np.bool_))  # an int subclass, never meant as a number
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        index = None
    if not boolean and index is not None and least <= index and (most is None or index <= most):
        return index
    expected = f"{what} must be {integer_words(least, most)}" + (" or None" if or_none else "")
    if boolean or index is None:
        raise TypeError(f"{expected}, got {'bool' if boolean else type(value).__name__} {value!r}")
    raise ValueError(f"{expected}, got {index}")


def integer_words(least: int, most: int | None = None) -> str:
    """How a message names the integers from ``least`` to ``most``."""
    if most is not None:
        return f"an integer from {least} to {most}"
    words = {0: "a non-negative integer", 1: "a positive integer"}
    return words.get(least, f"an integer of at least {least}")


def flag(name: str, value: object) -> bool:
    """``value`` as a bool; anything but a bool (1, "yes") is a TypeError."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def not_a_layout(value: object, where: str = "") -> TypeError:
    """The error for a ``layout`` argument that is not a ``GdnBackwardLayout``."""
    prefix = f"{where}: " if where else ""
    return TypeError(f"{prefix}layout must be a GdnBackwardLayout, got {type(value).__name__}")


def require_matplotlib() -> None:
    """Import matplotlib, or raise an ImportError that names the extra to install."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"gdn_layout.plot needs matplotlib, which is not installed: {PLOT_HINT}"
        ) from err


def array_can_exist(shape: Sequence[int], itemsize: int) -> bool:
    """Whether NumPy can make an array of ``shape``: its non-zero dimensions times the item
    size fit in an ``intp`` (NumPy checks that even when a dimension is 0).

    >>> array_can_exist((0, 2**40, 2**40), 4), array_can_exist((0, 2**40), 4)
    (False, True)
    """
    return math.prod(d for d in shape if d) * itemsize <= MAX_NBYTES

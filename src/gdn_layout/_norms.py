"""The one RMS: a Euclidean norm summed in float64 a chunk of elements at a time."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

#: Elements converted to float64 at a time: statistics never hold a float64 copy of a buffer.
CHUNK_ELEMENTS = 1 << 20

#: Squares of values within 2**+-480, summed over 2**40 of them, stay inside float64's range:
#: every float32 (or narrower) value is, so only a float64 buffer's values are ever scaled.
_PLAIN = 2.0**480


class Norm:
    """A Euclidean norm accumulated chunk by chunk: ``sqrt(sumsq) * 2**exp``."""

    def __init__(self) -> None:
        self.sumsq, self.exp = 0.0, 0

    def add(self, x: NDArray[np.float64], exp: int = 0) -> None:
        """Add the finite values ``x * 2**exp`` (``x >= 0``)."""
        peak = float(x.max(initial=0.0))
        if peak == 0.0:
            return
        if not 1 / _PLAIN < peak < _PLAIN:  # a power of two keeps the squares in range
            shift = math.frexp(peak)[1]
            x, exp = np.ldexp(x, -shift), exp + shift
        sumsq = float(np.vdot(x, x))
        if self.sumsq == 0.0 or exp > self.exp:
            self.sumsq, sumsq, self.exp, exp = sumsq, self.sumsq, exp, self.exp
        self.sumsq += math.ldexp(sumsq, 2 * (exp - self.exp))

    def rms(self, count: int) -> float:
        """The RMS of the ``count`` values added; 0.0 when there are none."""
        return math.ldexp(math.sqrt(self.sumsq / count), self.exp) if count else 0.0

    def over(self, other: Norm) -> float:
        """``norm(self) / norm(other)``, finite whenever the true ratio is."""
        if other.sumsq == 0.0:  # any error at all is infinitely large against a zero reference
            return 0.0 if self.sumsq == 0.0 else math.inf
        with np.errstate(over="ignore"):
            return float(np.ldexp(math.sqrt(self.sumsq / other.sumsq), self.exp - other.exp))


def finite_rms(x: NDArray[Any]) -> float:
    """The RMS of the finite values of ``x``, in float64, a chunk at a time."""
    norm, count = Norm(), 0
    flat = x.reshape(-1)
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS].astype(np.float64)
        finite = np.abs(chunk[np.isfinite(chunk)])
        norm.add(finite)
        count += finite.size
    return norm.rms(count)


def rms_rows(x: NDArray[np.float64], peak: NDArray[np.float64]) -> NDArray[np.float64]:
    """The RMS of each row of ``x >= 0`` (``[n, m]``), whose largest values are ``peak``,
    scaled by them: the rows are a float64 buffer's as often as a float32 one's."""
    safe = np.where(peak > 0, peak, 1.0)
    scaled = x / safe[:, None]
    return np.where(
        peak > 0, peak * np.sqrt(np.einsum("ij,ij->i", scaled, scaled) / x.shape[1]), 0.0
    )

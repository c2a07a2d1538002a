"""The one RMS: norms accumulated a chunk of elements at a time, scaled so that squaring neither
overflows nor underflows, and the RMS and RMS ratio made from them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["CHUNK_ELEMENTS", "Norm", "finite_rms", "rms_ratio_of", "rms_rows"]

#: Elements converted to float64 at a time, so that statistics of a huge buffer never hold a
#: float64 copy of all of it.
CHUNK_ELEMENTS = 1 << 20


class Norm:
    """A Euclidean norm accumulated chunk by chunk, scaled as LAPACK's ``nrm2`` is, so that
    squaring neither overflows for huge values nor underflows for tiny ones. The norm is
    ``scale * sqrt(sumsq)``, kept in that form: the norm itself may be past the largest float
    even when the ratio of two norms is not."""

    def __init__(self, scale: float = 0.0, sumsq: float = 1.0) -> None:
        self.scale = scale
        self.sumsq = sumsq

    def add(self, x: NDArray[np.float64]) -> None:
        """Add the finite values ``x``."""
        peak = float(x.max(initial=0.0))
        if peak == 0.0:
            return
        scaled = x / peak
        self.merge(Norm(peak, float(np.vdot(scaled, scaled))))

    def merge(self, other: Norm) -> None:
        """Add the values another norm was accumulated from."""
        if other.scale == 0.0:
            return
        if other.scale > self.scale:
            self.sumsq = other.sumsq + self.sumsq * (self.scale / other.scale) ** 2
            self.scale = other.scale
        else:
            self.sumsq += other.sumsq * (other.scale / self.scale) ** 2

    def rms(self, count: int) -> float:
        """The RMS of the ``count`` values added; 0.0 when there are none."""
        return self.scale * math.sqrt(self.sumsq / count) if count and self.scale else 0.0

    def over(self, other: Norm) -> float:
        """``norm(self) / norm(other)``, finite whenever the true ratio is."""
        if other.scale == 0.0:
            # A zero reference leaves no scale: any error at all is infinitely large against it.
            return 0.0 if self.scale == 0.0 else math.inf
        with np.errstate(over="ignore"):
            return float(np.float64(self.scale) / other.scale) * math.sqrt(self.sumsq / other.sumsq)


def rms_ratio_of(norm_diff: Norm, norm_half: Norm, norm_exp: Norm) -> float:
    """``rms(a - e) / rms(e)`` from the norms of the differences, of the differences past the
    largest float (halved), and of the reference."""
    # Both norms are over the same elements, so their ratio is the ratio of the RMS values.
    if norm_half.scale == 0.0:
        return norm_diff.over(norm_exp)
    # Some |a - e| are past the largest float: work with every difference halved.
    halved = Norm(norm_diff.scale * 0.5, norm_diff.sumsq)
    halved.merge(norm_half)
    return 2.0 * halved.over(norm_exp)


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
    """The RMS of each row of ``x >= 0`` (``[n, m]``), whose largest values are ``peak``:
    scaled by them, as :class:`Norm` is, so that squaring neither overflows nor underflows."""
    safe = np.where(peak > 0, peak, 1.0)
    scaled = x / safe[:, None]
    sumsq = np.einsum("ij,ij->i", scaled, scaled)
    return np.where(peak > 0, peak * np.sqrt(sumsq / x.shape[1]), 0.0)

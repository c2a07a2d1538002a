"""Precision floors: what rounding alone makes of each gradient, measured on a fixture's inputs.

A correct kernel in float32, float16 or bfloat16 differs from the float64 truth by its
precision's rounding. The *floor* of a gradient for a dtype measures that rounding on the
fixture's own inputs: the spec's step-by-step form computed in float32 (for float16 and
bfloat16, its output then rounded to that dtype) against the float64 result, as two figures:

``rms``
    the RMS error ratio ``rms(low - truth) / rms(truth)``;
``max``
    the largest error over the gradient's RMS, ``max|low - truth| / rms(truth)``: an
    elementwise relative error is unbounded where the truth crosses zero, this is not.

A fixture stores them as JSON (:func:`encode_floors`); :mod:`gdn_layout.check._criterion`
judges a kernel against them. The scale of the terms that form ``dg`` (:func:`term_scales`)
sets the least floor of a gradient far below its terms.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._norms import CHUNK_ELEMENTS, Norm
from ..layout import GRADIENT_NAMES, GdnBackwardLayout
from ._criterion import FLOOR_DTYPES, Floors, checked_floors

__all__ = [
    "decode_floors",
    "encode_floors",
    "measure_floors",
    "round_to",
    "tensor_floors",
    "term_scales",
]


def round_to(values: NDArray[np.float32], name: str) -> NDArray[np.float32]:
    """``values`` rounded to float32, float16 or bfloat16 (to nearest, ties to even), returned
    as float32; bfloat16 without ml_dtypes, by rounding the float32 bits."""
    if name == "float32":
        return values
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape, np.float32)
    _round_into(flat, name, out)
    return out.reshape(np.shape(values))


def _round_into(
    values: NDArray[np.float32],
    name: str,
    out: NDArray[np.float32],
    bits: NDArray[np.uint32] | None = None,
) -> None:
    """Write ``round_to(values, name)`` into ``out`` (float16 or bfloat16) of 1-D ``values``;
    ``bits``, a uint32 buffer of the same shape, saves an allocation."""
    if name == "float16":
        half = np.empty(values.shape, np.float16) if bits is None else bits.view(np.float16)
        np.copyto(half[: values.size], values, casting="same_kind")
        np.copyto(out, half[: values.size])
        return
    # bfloat16: add half an ulp of bfloat16 (ties to even) to the float32 bits, drop the low
    # 16. In uint32 the sum wraps only for NaNs whose bits are cut to 0 anyway: the low 32 bits
    # of each step are those of the same sum in uint64.
    raw = values.view(np.uint32)
    work = out.view(np.uint32)
    odd = np.empty_like(raw) if bits is None else bits
    np.right_shift(raw, _SIXTEEN, out=odd)
    np.bitwise_and(odd, _ONE, out=odd)
    np.add(raw, _HALF, out=work)
    np.add(work, odd, out=work)
    np.bitwise_and(work, _KEEP, out=work)


_SIXTEEN, _ONE = np.uint32(16), np.uint32(1)
_HALF, _KEEP = np.uint32(0x7FFF), np.uint32(0xFFFF0000)

#: Elements a block of :func:`measure_floors` works on: its buffers stay in cache.
_FLOOR_BLOCK = 1 << 15


def measure_floors(
    low: NDArray[np.float32], truth: NDArray[np.float64], layout: GdnBackwardLayout
) -> dict[str, dict[str, tuple[float, float]]]:
    """The floors of every gradient for every dtype of :data:`FLOOR_DTYPES`, from a packed
    float32 result ``low`` and the float64 ``truth`` of the same inputs.

    Each gradient's figures are those of ``_figures(round_to(low, d).astype(float64), truth)``
    on its segment, bit for bit: every mean is NumPy's over the whole segment, as there; the
    rounding, the errors and their largest value are formed a block at a time, so that no copy
    of the whole buffer is made and each element is read from memory once per dtype.
    """
    floors: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in FLOOR_DTYPES}
    segments = layout.segments()
    longest = max((seg.length for seg in segments), default=0)
    squares = np.empty(longest, np.float64)  # one segment's squared errors, for its mean
    block = min(_FLOOR_BLOCK, longest)
    rounded, bits = np.empty(block, np.float32), np.empty(block, np.uint32)
    error = np.empty(block, np.float64)
    for seg in segments:
        span = slice(seg.offset, seg.offset + seg.length)
        expected, measured = truth[span], np.ascontiguousarray(low[span], np.float32)
        if seg.length == 0:
            for name in FLOOR_DTYPES:
                floors[name][seg.name] = (0.0, 0.0)
            continue
        sq = squares[: seg.length]
        rms = math.sqrt(float(np.mean(np.square(expected, out=sq))))
        for name in FLOOR_DTYPES:
            peak = np.float64(0.0)
            for start in range(0, seg.length, block):
                stop = min(start + block, seg.length)
                err = error[: stop - start]
                part = measured[start:stop]
                if name != "float32":
                    _round_into(part, name, rounded[: stop - start], bits[: stop - start])
                    part = rounded[: stop - start]
                np.subtract(part, expected[start:stop], out=err)
                np.abs(err, out=err)
                peak = np.maximum(peak, err.max())
                np.square(err, out=sq[start:stop])
            floors[name][seg.name] = _floor_figures(rms, float(np.mean(sq)), float(peak))
    return floors


def tensor_floors(
    low: Mapping[str, NDArray[Any]], truth: Mapping[str, NDArray[Any]]
) -> dict[str, dict[str, tuple[float, float]]]:
    """The floors of each named tensor for every dtype of :data:`FLOOR_DTYPES`, from its float32
    step-by-step result in ``low`` and its float64 ``truth``."""
    floors: dict[str, dict[str, tuple[float, float]]] = {}
    for dtype in FLOOR_DTYPES:
        floors[dtype] = {
            name: _figures(
                round_to(np.ascontiguousarray(low[name], np.float32).ravel(), dtype).astype(
                    np.float64
                ),
                np.asarray(truth[name], np.float64).ravel(),
            )
            for name in low
        }
    return floors


def _figures(low: NDArray[np.float64], truth: NDArray[np.float64]) -> tuple[float, float]:
    """The ``(rms, max)`` figures of ``low`` against ``truth``, each relative to rms(truth)."""
    if truth.size == 0:
        return (0.0, 0.0)
    rms = math.sqrt(float(np.mean(np.square(truth))))
    err = np.abs(low - truth)
    return _floor_figures(rms, float(np.mean(np.square(err))), float(err.max()))


def _floor_figures(rms: float, mean_square: float, peak: float) -> tuple[float, float]:
    """The figures from the truth's RMS, the errors' mean square and their largest value."""
    if rms == 0:
        return (0.0, 0.0) if peak == 0 else (math.inf, math.inf)
    return (_short(math.sqrt(mean_square) / rms), _short(peak / rms))


def _short(x: float) -> float:
    # Three significant digits, rounded up: a floor is never understated.
    if x == 0 or not math.isfinite(x):
        return x
    digits = 2 - math.floor(math.log10(x))
    scale = 10.0**digits
    return math.ceil(x * scale) / scale


def encode_floors(floors: Floors) -> str:
    """The floors as the JSON text of the fixture's ``floors`` metadata key."""
    document = {d: {g: list(f) for g, f in per.items()} for d, per in floors.items()}
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def decode_floors(
    text: str, names: tuple[str, ...] = GRADIENT_NAMES, key: str = "floors"
) -> dict[str, dict[str, tuple[float, float]]]:
    """Parse :func:`encode_floors`' text, floors of the tensors ``names`` kept under metadata
    ``key``; a ValueError says what is wrong."""
    try:
        document: Any = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{key} is not JSON: {err}") from None
    try:
        return checked_floors(document, key, names)
    except TypeError as err:  # the file's to fix, like every other damage
        raise ValueError(str(err)) from None


def term_scales(
    q: NDArray[Any], k: NDArray[Any], dq: NDArray[Any], dk: NDArray[Any], *, per_channel: bool
) -> dict[str, float]:
    """The scale of the terms that form each gradient where it can be far below them:
    ``{"dg": s}``, ``s`` the RMS over ``dg``'s elements of ``sum_n |q dq| + |k dk|`` (per
    channel, ``|q dq| + |k dk|``), the terms of the ``q . dq - k . dk`` that chunked kernels
    form ``dg`` from. ``q, k, dq, dk`` are ``[B, S, H, N]``; taken in float64, a block of
    steps at a time.

    >>> import numpy as np
    >>> ones = np.ones((1, 2, 1, 4))
    >>> term_scales(ones, ones, ones, -ones, per_channel=False)
    {'dg': 8.0}
    >>> term_scales(ones, ones, ones, -ones, per_channel=True)
    {'dg': 2.0}
    """
    norm, count = Norm(), 0
    batch, seq = q.shape[:2]
    row = max(1, math.prod(q.shape[2:]))
    block = max(1, CHUNK_ELEMENTS // row)
    for b in range(batch):
        for s in range(0, seq, block):
            steps = slice(s, s + block)
            terms = np.abs(q[b, steps] * dq[b, steps].astype(np.float64))
            terms += np.abs(k[b, steps] * dk[b, steps].astype(np.float64))
            if not per_channel:
                terms = terms.sum(axis=-1)
            terms = terms[np.isfinite(terms)]
            norm.add(terms)
            count += terms.size
    return {"dg": norm.rms(count)}

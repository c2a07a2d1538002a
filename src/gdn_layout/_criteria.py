"""Precision floors and the calibrated criterion built on them.

A correct kernel in float32, float16 or bfloat16 differs from the float64 truth by its
precision's rounding. The *floor* of a gradient for a dtype measures that rounding on the
fixture's own inputs: the spec's step-by-step form computed in float32 (for float16 and
bfloat16, its output then rounded to that dtype) against the float64 result, as two figures:

``rms``
    the RMS error ratio ``rms(low - truth) / rms(truth)``;
``max``
    the largest error over the gradient's RMS, ``max|low - truth| / rms(truth)``: an
    elementwise relative error is unbounded where the truth crosses zero, this is not.

float64's floors are float32's scaled by the ratio of their unit roundoffs, ``2**-29``: to
first order the rounding error of one order of operations is proportional to the unit
roundoff, and a float32 floor measured on float32 inputs is the arithmetic's alone (on
float64 inputs it also holds their rounding to float32, which only makes it larger).

The calibrated criterion for an actual buffer whose (less precise) dtype is ``d`` passes a
gradient when both its RMS error and its largest error are at most :data:`K` (16 for float32,
8 for float16 and bfloat16, 64 for float64, whose truth has float64's rounding too) times the
floor for ``d`` times ``rms(expected)``.

Each floor, as an error, is taken no lower than half of ``d``'s unit roundoff
(:data:`UNIT_ROUNDOFF`) times the *scale of the terms* that form the gradient, where that
scale is larger than ``rms(expected)``. A gradient can be far below its terms: ``dg`` is
exactly 0 at a sequence's first step without a carried state, and of order ``exp(g)`` under
extreme decay, while chunked kernels form it as ``q . dq - k . dk``, a difference of terms of
order 1 whose rounding is of order ``u`` (:func:`term_scales`). Judged against its own RMS such
a gradient would allow no rounding at all; judged against its terms, it allows what rounding
there produces, and a real error is still orders of magnitude above it. Fixtures without
floors fall back to :data:`DEFAULT_FLOORS`.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._stats import CHUNK_ELEMENTS, Norm
from .layout import GRADIENT_NAMES, GdnBackwardLayout

__all__ = [
    "CALIBRATED_DTYPES",
    "DEFAULT_FLOORS",
    "DEFAULT_TOLERANCES",
    "FLOOR_DTYPES",
    "UNIT_ROUNDOFF",
    "Calibration",
    "Floors",
    "K",
    "Tolerance",
    "calibration",
    "checked_floors",
    "decode_floors",
    "encode_floors",
    "floor_for",
    "least_precise",
    "measure_floors",
    "per_grad",
    "round_to",
    "tensor_floors",
    "term_scales",
]

#: A gradient's floors by dtype name, then gradient name: ``(rms, max)``.
Floors = Mapping[str, Mapping[str, tuple[float, float]]]
Number = float | np.floating[Any] | np.integer[Any]
#: A tolerance for every gradient, or a mapping from gradient name to its tolerance.
Tolerance = Number | Mapping[str, Number]

#: The dtypes a fixture measures floors for.
FLOOR_DTYPES: Final = ("float32", "float16", "bfloat16")
#: The dtypes the calibrated criterion judges: float64's floors are float32's, scaled.
CALIBRATED_DTYPES: Final = (*FLOOR_DTYPES, "float64")
#: How far above its floor a correct kernel's error may be, by dtype: float32's floor is the
#: error of one order of operations (the spec's, step by step), which another correct order
#: has been measured to exceed 12-fold on a gradient of one element; float16's and bfloat16's
#: are the output's rounding, which every correct kernel shares (measured at most 2x).
#: float64's truth is itself a float64 computation, whose own error adds to the kernel's:
#: over two 264-case suites, the reference against an extended-precision oracle reaches 17.8x
#: the floor and the float64 step-by-step form against the reference 20.3x, both on a dbeta
#: of one element whose floor is the least one; so its factor is 64.
#: benchmarks/README.md has the figures.
K: Final = {"float32": 16.0, "float16": 8.0, "bfloat16": 8.0, "float64": 64.0}
#: The unit roundoff of each dtype (half its machine epsilon); a floor is never taken below
#: half of it, the size of the rounding error itself.
UNIT_ROUNDOFF: Final = {
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float64": 2.0**-53,
}
#: Floors for fixtures that carry none: ``(rms, max)`` for every gradient, the largest measured
#: over the first four regimes of the standard suite (float32 inputs), rounded up, when floors
#: came from the chunked form; the step-by-step floors measured since are all below them.
#: float64's are float32's, scaled like measured ones.
DEFAULT_FLOORS: Final = {
    "float32": (6e-5, 2e-4),
    "float16": (1e-3, 1e-2),
    "bfloat16": (4e-3, 5e-2),
    "float64": (6e-5 * 2.0**-29, 2e-4 * 2.0**-29),
}


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


def checked_floors(
    value: object, where: str, names: tuple[str, ...] = GRADIENT_NAMES
) -> dict[str, dict[str, tuple[float, float]]]:
    """``value`` as floors: ``{dtype: {name: (rms, max)}}`` for tensors among ``names`` (the
    gradients), each figure a finite number >= 0. A floor of inf, or one that is not a number,
    would let any error pass."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where} must be a mapping {{dtype: {{gradient: (rms, max)}}}}, "
            f"got {type(value).__name__}"
        )
    floors: dict[str, dict[str, tuple[float, float]]] = {}
    for dtype, per in value.items():
        if dtype not in FLOOR_DTYPES:
            raise ValueError(f"{where}: unknown dtype {dtype!r}; expected among {FLOOR_DTYPES}")
        if not isinstance(per, Mapping):
            raise TypeError(f"{where}[{dtype!r}] must be a mapping, got {type(per).__name__}")
        parsed = {}
        for grad, pair in per.items():
            if grad not in names or not _is_floor(pair):
                raise ValueError(
                    f"{where}[{dtype!r}][{grad!r}] must be (rms, max) for a tensor among "
                    f"{', '.join(names)}, two finite numbers >= 0; got {pair!r}"
                )
            parsed[grad] = (float(pair[0]), float(pair[1]))
        floors[dtype] = parsed
    return floors


def _is_floor(pair: object) -> bool:
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        return False
    numbers_only = all(
        isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) for x in pair
    )
    return numbers_only and all(math.isfinite(float(x)) and float(x) >= 0 for x in pair)


def floor_for(floors: Floors | None, dtype: str, grad: str) -> tuple[float, float]:
    """The ``(rms, max)`` floor used for gradient ``grad`` judged in ``dtype`` (one of
    :data:`CALIBRATED_DTYPES`): the measured one when ``floors`` has it (for float64, the
    float32 one times ``2**-29``), else :data:`DEFAULT_FLOORS`; never below half the unit
    roundoff."""
    source = "float32" if dtype == "float64" else dtype
    measured = (floors or {}).get(source, {}).get(grad)
    if measured is None:
        rms, peak = DEFAULT_FLOORS[dtype]
    else:
        factor = UNIT_ROUNDOFF[dtype] / UNIT_ROUNDOFF[source]
        rms, peak = measured[0] * factor, measured[1] * factor
    least = UNIT_ROUNDOFF[dtype] / 2
    return (max(rms, least), max(peak, least))


class Calibration(NamedTuple):
    """The calibrated criterion for one gradient: its ``(rms, max)`` floor (relative to
    ``scale``, the RMS of the expected values), the smallest error either floor stands for
    (``least``: half the unit roundoff times the scale of the gradient's terms), and ``K``."""

    floor: tuple[float, float]
    scale: float
    least: float
    k: float

    @property
    def errors(self) -> tuple[float, float]:
        """The floors as errors: ``(rms, max)`` of ``a - e`` that rounding accounts for."""
        return (
            max(self.floor[0] * self.scale, self.least),
            max(self.floor[1] * self.scale, self.least),
        )

    @property
    def atol(self) -> float:
        """The largest error of one element allowed."""
        return self.k * self.errors[1]

    @property
    def max_rms_ratio(self) -> float:
        """The largest ``rms(a - e) / rms(e)`` allowed; inf when ``rms(e)`` is 0, where the
        largest error alone bounds the RMS one."""
        return self.k * self.errors[0] / self.scale if self.scale > 0 else math.inf

    def ratio(self, rms_ratio: float, max_abs_error: float) -> float:
        """The larger of the RMS error and the largest error, each over its floor."""
        if math.isnan(rms_ratio) or math.isnan(max_abs_error):
            return math.nan
        rms_floor, max_floor = self.errors
        if max_floor == 0:
            return 0.0 if max_abs_error == 0 else math.inf
        by_max = max_abs_error / max_floor
        if self.scale == 0:  # the RMS error is at most the largest one, and the floors agree
            return by_max
        return max(rms_ratio * self.scale / rms_floor, by_max)


def calibration(
    floors: Floors | None,
    judged: str,
    grad: str,
    expected: NDArray[Any],
    term_scale: float | None = None,
) -> Calibration:
    """The calibrated criterion of gradient ``grad`` judged in ``judged``: RMS error and
    largest error within :data:`K` times its floors, no floor below half the unit roundoff
    times the larger of rms(expected) and ``term_scale``."""
    scale = finite_rms(expected)
    # A kernel stores float16 or bfloat16 but computes in float32: its terms round as float32's.
    compute = "float32" if judged in ("float16", "bfloat16") else judged
    least = max(UNIT_ROUNDOFF[judged] / 2 * scale, UNIT_ROUNDOFF[compute] / 2 * (term_scale or 0.0))
    return Calibration(floor_for(floors, judged, grad), scale, least, K[judged])


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
    return {"dg": norm.scale * math.sqrt(norm.sumsq / count) if count and norm.scale else 0.0}


def finite_rms(x: NDArray[Any]) -> float:
    """The RMS of the finite values of ``x``, in float64, a chunk at a time, scaled by the
    largest so that squaring neither overflows nor underflows."""
    peak, count, total = 0.0, 0, 0.0
    for scaled in (False, True):
        for start in range(0, x.size, CHUNK_ELEMENTS):
            chunk = x[start : start + CHUNK_ELEMENTS].astype(np.float64)
            finite = np.abs(chunk[np.isfinite(chunk)])
            if not scaled:
                count += finite.size
                peak = max(peak, float(finite.max(initial=0.0)))
            elif peak > 0:
                total += float(np.vdot(finite / peak, finite / peak))
    return peak * math.sqrt(total / count) if peak > 0 else 0.0


#: Default (rtol, atol) by the less precise of the two dtypes, as torch.testing.assert_close
#: chooses them; longdouble is judged like float64.
DEFAULT_TOLERANCES: Final = {
    "bfloat16": (1.6e-2, 1e-5),
    "float16": (1e-3, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
}
#: Less precise first.
_PRECISION_RANK: Final = ("bfloat16", "float16", "float32", "float64", "longdouble")


def least_precise(*dtypes: np.dtype[Any]) -> str:
    """The name of the less precise dtype; one that is not a float is taken as float64."""
    names = [d.name if d.name in _PRECISION_RANK else "float64" for d in dtypes]
    return min(names, key=_PRECISION_RANK.index)


def _number(what: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"compare: {what} must be a float, got {type(value).__name__} {value!r}")
    number = float(value)
    if not number >= 0 or math.isinf(number):
        raise ValueError(f"compare: {what} must be a finite float >= 0, got {value!r}")
    return number


def per_grad(what: str, value: Tolerance | None) -> dict[str, float]:
    """The values given for ``what``, by gradient name; names left out are absent."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in GRADIENT_NAMES)
        if unknown:
            raise ValueError(
                f"compare: {what} has unknown gradient names {unknown}; "
                f"expected names among {', '.join(GRADIENT_NAMES)}"
            )
        return {name: _number(f"{what}[{name!r}]", value[name]) for name in value}
    return dict.fromkeys(GRADIENT_NAMES, _number(what, value))

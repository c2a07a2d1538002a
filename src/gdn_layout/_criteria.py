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

The calibrated criterion for an actual buffer whose (less precise) dtype is ``d`` passes a
gradient when both its RMS error ratio and its largest error over the expected RMS are at
most :data:`K` (16 for float32, 8 for float16 and bfloat16) times the floor for ``d``. A
floor is taken no lower than half of ``d``'s unit roundoff (:data:`UNIT_ROUNDOFF`), so that a
floor measured on a few elements is never 0. Fixtures without floors fall back to
:data:`DEFAULT_FLOORS`.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._stats import CHUNK_ELEMENTS
from .layout import GRADIENT_NAMES, GdnBackwardLayout

__all__ = [
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
]

#: A gradient's floors by dtype name, then gradient name: ``(rms, max)``.
Floors = Mapping[str, Mapping[str, tuple[float, float]]]
Number = float | np.floating[Any] | np.integer[Any]
#: A tolerance for every gradient, or a mapping from gradient name to its tolerance.
Tolerance = Number | Mapping[str, Number]

#: The dtypes a fixture measures floors for.
FLOOR_DTYPES: Final = ("float32", "float16", "bfloat16")
#: How far above its floor a correct kernel's error may be, by dtype: float32's floor is the
#: error of one order of operations (the spec's, step by step), which another correct order
#: has been measured to exceed 12-fold on a gradient of one element; float16's and bfloat16's
#: are the output's rounding, which every correct kernel shares (measured at most 2x;
#: benchmarks/README.md has the figures).
K: Final = {"float32": 16.0, "float16": 8.0, "bfloat16": 8.0}
#: The unit roundoff of each dtype (half its machine epsilon); a floor is never taken below
#: half of it, the size of the rounding error itself.
UNIT_ROUNDOFF: Final = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: Floors for fixtures that carry none: ``(rms, max)`` for every gradient, the largest measured
#: over the first four regimes of the standard suite (float32 inputs), rounded up, when floors
#: came from the chunked form; the step-by-step floors measured since are all below them.
DEFAULT_FLOORS: Final = {
    "float32": (6e-5, 2e-4),
    "float16": (1e-3, 1e-2),
    "bfloat16": (4e-3, 5e-2),
}


def round_to(values: NDArray[np.float32], name: str) -> NDArray[np.float32]:
    """``values`` rounded to float32, float16 or bfloat16 (to nearest, ties to even), returned
    as float32; bfloat16 without ml_dtypes, by rounding the float32 bits."""
    if name == "float32":
        return values
    if name == "float16":
        return values.astype(np.float16).astype(np.float32)
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    one, half, keep = np.uint64(1), np.uint64(0x7FFF), np.uint64(0xFFFF0000)
    bits = (bits + half + ((bits >> np.uint64(16)) & one)) & keep
    return bits.astype(np.uint32).view(np.float32)


def measure_floors(
    low: NDArray[np.float32], truth: NDArray[np.float64], layout: GdnBackwardLayout
) -> dict[str, dict[str, tuple[float, float]]]:
    """The floors of every gradient for every dtype of :data:`FLOOR_DTYPES`, from a packed
    float32 result ``low`` and the float64 ``truth`` of the same inputs."""
    floors: dict[str, dict[str, tuple[float, float]]] = {}
    for name in FLOOR_DTYPES:
        rounded = round_to(low, name).astype(np.float64)
        per_grad = {}
        for seg in layout.segments():
            span = slice(seg.offset, seg.offset + seg.length)
            per_grad[seg.name] = _figures(rounded[span], truth[span])
        floors[name] = per_grad
    return floors


def _figures(low: NDArray[np.float64], truth: NDArray[np.float64]) -> tuple[float, float]:
    if truth.size == 0:
        return (0.0, 0.0)
    rms = math.sqrt(float(np.mean(np.square(truth))))
    err = np.abs(low - truth)
    if rms == 0:
        return (0.0, 0.0) if not err.any() else (math.inf, math.inf)
    return (
        _short(math.sqrt(float(np.mean(np.square(err)))) / rms),
        _short(float(err.max()) / rms),
    )


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


def decode_floors(text: str) -> dict[str, dict[str, tuple[float, float]]]:
    """Parse :func:`encode_floors`' text; a ValueError says what is wrong."""
    try:
        document: Any = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"floors is not JSON: {err}") from None
    try:
        return checked_floors(document, "floors")
    except TypeError as err:  # the file's to fix, like every other damage
        raise ValueError(str(err)) from None


def checked_floors(value: object, where: str) -> dict[str, dict[str, tuple[float, float]]]:
    """``value`` as floors: ``{dtype: {gradient: (rms, max)}}``, each figure a finite number
    >= 0. A floor of inf, or one that is not a number, would let any error pass."""
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
            if grad not in GRADIENT_NAMES or not _is_floor(pair):
                raise ValueError(
                    f"{where}[{dtype!r}][{grad!r}] must be (rms, max) for a gradient among "
                    f"{', '.join(GRADIENT_NAMES)}, two finite numbers >= 0; got {pair!r}"
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
    """The ``(rms, max)`` floor used for gradient ``grad`` judged in ``dtype``: the measured
    one when ``floors`` has it, else :data:`DEFAULT_FLOORS`; never below half the unit
    roundoff."""
    measured = (floors or {}).get(dtype, {}).get(grad)
    rms, peak = DEFAULT_FLOORS[dtype] if measured is None else measured
    least = UNIT_ROUNDOFF[dtype] / 2
    return (max(rms, least), max(peak, least))


class Calibration(NamedTuple):
    """The calibrated criterion for one gradient: its ``(rms, max)`` floor, the RMS of the
    expected values, and the two limits that follow (``K`` times each floor)."""

    floor: tuple[float, float]
    scale: float
    atol: float
    max_rms_ratio: float

    def ratio(self, rms_ratio: float, max_abs_error: float) -> float:
        """The larger of ``rms_ratio / floor_rms`` and ``max_abs_error / scale / floor_max``."""
        if math.isnan(rms_ratio):
            return math.nan
        if self.scale > 0:
            return max(rms_ratio / self.floor[0], max_abs_error / self.scale / self.floor[1])
        return 0.0 if max_abs_error == 0 and rms_ratio == 0 else math.inf


def calibration(
    floors: Floors | None, judged: str, grad: str, expected: NDArray[Any]
) -> Calibration:
    """The calibrated criterion of gradient ``grad`` judged in ``judged``: RMS ratio and
    largest error over rms(expected) within :data:`K` times its floors."""
    floor_rms, floor_max = floor_for(floors, judged, grad)
    scale = finite_rms(expected)
    return Calibration(
        (floor_rms, floor_max), scale, K[judged] * floor_max * scale, K[judged] * floor_rms
    )


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

"""Precision floors and the calibrated criterion built on them.

A correct kernel in float32, float16 or bfloat16 differs from the float64 truth by its
precision's rounding. The *floor* of a gradient for a dtype measures that rounding on the
fixture's own inputs: the reference computed in float32 (for float16 and bfloat16, its output
then rounded to that dtype) against the float64 result, as two figures:

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
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from .layout import GRADIENT_NAMES, GdnBackwardLayout

__all__ = [
    "DEFAULT_FLOORS",
    "FLOOR_DTYPES",
    "UNIT_ROUNDOFF",
    "Floors",
    "K",
    "decode_floors",
    "encode_floors",
    "floor_for",
    "measure_floors",
    "round_to",
]

#: A gradient's floors by dtype name, then gradient name: ``(rms, max)``.
Floors = Mapping[str, Mapping[str, tuple[float, float]]]

#: The dtypes a fixture measures floors for.
FLOOR_DTYPES: Final = ("float32", "float16", "bfloat16")
#: How far above its floor a correct kernel's error may be, by dtype: float32's floor is the
#: reference's own arithmetic error, which another correct order of operations can exceed
#: 13-fold on a gradient of one element; float16's and bfloat16's are the output's rounding,
#: which every correct kernel shares (measured at most 2x; benchmarks/README.md has the figures).
K: Final = {"float32": 16.0, "float16": 8.0, "bfloat16": 8.0}
#: The unit roundoff of each dtype (half its machine epsilon); a floor is never taken below
#: half of it, the size of the rounding error itself.
UNIT_ROUNDOFF: Final = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: Floors for fixtures that carry none: ``(rms, max)`` for every gradient, the largest measured
#: over the standard suite (float32 inputs), rounded up.
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
    if not isinstance(document, dict):
        raise ValueError("floors must be a JSON object of dtypes")
    floors: dict[str, dict[str, tuple[float, float]]] = {}
    for dtype, per in document.items():
        if dtype not in FLOOR_DTYPES or not isinstance(per, dict):
            raise ValueError(f"floors: unknown dtype {dtype!r} or not an object")
        parsed = {}
        for grad, pair in per.items():
            if (
                grad not in GRADIENT_NAMES
                or not isinstance(pair, list)
                or len(pair) != 2
                or not all(isinstance(x, (int, float)) and x >= 0 for x in pair)
            ):
                raise ValueError(f"floors[{dtype!r}][{grad!r}] must be [rms, max] >= 0")
            parsed[grad] = (float(pair[0]), float(pair[1]))
        floors[dtype] = parsed
    return floors


def floor_for(floors: Floors | None, dtype: str, grad: str) -> tuple[float, float]:
    """The ``(rms, max)`` floor used for gradient ``grad`` judged in ``dtype``: the measured
    one when ``floors`` has it, else :data:`DEFAULT_FLOORS`; never below half the unit
    roundoff."""
    measured = (floors or {}).get(dtype, {}).get(grad)
    rms, peak = DEFAULT_FLOORS[dtype] if measured is None else measured
    least = UNIT_ROUNDOFF[dtype] / 2
    return (max(rms, least), max(peak, least))

"""Precision floors: what rounding alone makes of each gradient, measured on a fixture's inputs.

A correct kernel differs from the float64 truth by the rounding of what it computes. The
*floor* of a gradient for a precision class is the worst rounding of the correct forms a
kernel of that class computes (:data:`PANEL`), run on the fixture's own inputs against the
float64 result, as two figures:

``rms``
    the RMS error ratio ``rms(low - truth) / rms(truth)``;
``max``
    the largest error over the gradient's RMS, ``max|low - truth| / rms(truth)``: an
    elementwise relative error is unbounded where the truth crosses zero, this is not;

and no lower than a rounding analysis allows (:func:`panel_floors`), with the *reach*, how far
the class's forms go beyond the step-by-step form. A fixture stores them as JSON
(:func:`encode_floors`); the calibrated criterion (:mod:`gdn_layout.check._criterion`)
judges a kernel against them. The scale of the terms that form ``dg`` (:func:`term_scales`)
sets the least floor of a gradient far below its terms.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._dtypes import PRECISIONS
from ._norms import CHUNK_ELEMENTS, Norm
from .layout import GRADIENT_NAMES, GdnBackwardLayout

__all__ = [
    "CHUNKED_RUNS",
    "FEW_ELEMENTS",
    "FLOOR_CLASSES",
    "PANEL",
    "ROUNDINGS",
    "SAMPLE_MARGIN",
    "Floors",
    "Sample",
    "checked_floors",
    "decode_floors",
    "encode_floors",
    "measure_floors",
    "panel_floors",
    "round_to",
    "term_scales",
]


#: A gradient's floors by precision class, then gradient name: ``(rms, max)``, or
#: ``(rms, max, reach)`` where ``reach`` says how far the correct forms' rounding goes beyond
#: the step-by-step form's (the larger figure over the step-by-step form's).
Floors = Mapping[str, Mapping[str, tuple[float, ...]]]
#: The classes a fixture measures floors for: all but float64, whose are float32's, scaled.
FLOOR_CLASSES: Final = tuple(name for name in PRECISIONS if name != "float64")


def checked_floors(
    value: object, where: str, names: tuple[str, ...] = GRADIENT_NAMES
) -> dict[str, dict[str, tuple[float, ...]]]:
    """``value`` as floors: ``{class: {name: (rms, max)}}`` (or ``(rms, max, reach)``) for
    tensors among ``names`` (the gradients), each figure a finite number >= 0. A floor of inf,
    or one that is not a number, would let any error pass."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where} must be a mapping {{precision: {{gradient: (rms, max)}}}}, "
            f"got {type(value).__name__}"
        )
    floors: dict[str, dict[str, tuple[float, ...]]] = {}
    for precision, per in value.items():
        if precision not in FLOOR_CLASSES:
            raise ValueError(
                f"{where}: unknown precision class {precision!r}; expected among {FLOOR_CLASSES}"
            )
        if not isinstance(per, Mapping):
            raise TypeError(f"{where}[{precision!r}] must be a mapping, got {type(per).__name__}")
        parsed = {}
        for grad, figures in per.items():
            if grad not in names or not _is_floor(figures):
                raise ValueError(
                    f"{where}[{precision!r}][{grad!r}] must be (rms, max) or (rms, max, reach) "
                    f"for a tensor among {', '.join(names)}, finite numbers >= 0; got {figures!r}"
                )
            parsed[grad] = tuple(float(x) for x in figures)
        floors[precision] = parsed
    return floors


def _is_floor(figures: object) -> bool:
    if not isinstance(figures, (list, tuple)) or len(figures) not in (2, 3):
        return False
    numbers_only = all(
        isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) for x in figures
    )
    return numbers_only and all(math.isfinite(float(x)) and float(x) >= 0 for x in figures)


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

#: The dtypes a result is rounded to before its figures are taken.
ROUNDINGS: Final = ("float32", "float16", "bfloat16")
#: Elements a block of :func:`measure_floors` works on: its buffers stay in cache.
_FLOOR_BLOCK = 1 << 15


def measure_floors(
    low: NDArray[np.float32],
    truth: NDArray[np.float64],
    layout: GdnBackwardLayout,
    dtypes: tuple[str, ...] = ROUNDINGS,
) -> dict[str, dict[str, tuple[float, float]]]:
    """The figures of every gradient of a packed result ``low`` against the float64 ``truth``,
    with ``low`` rounded to each of ``dtypes`` (float32, float16, bfloat16)."""
    segments = layout.segments()
    return _measure(
        [
            (
                seg.name,
                low[seg.offset : seg.offset + seg.length],
                truth[seg.offset : seg.offset + seg.length],
            )
            for seg in segments
        ],
        dtypes,
    )


def _measure(
    pairs: list[tuple[str, NDArray[Any], NDArray[Any]]],
    dtypes: tuple[str, ...],
    scales: dict[int, float] | None = None,
) -> dict[str, dict[str, tuple[float, float]]]:
    """``(rms, max)`` of each ``(name, low, truth)`` pair of 1-D arrays, ``low`` rounded to each
    of ``dtypes``: bit for bit ``_figures(round_to(low, d).astype(float64), truth)``. Every mean
    is NumPy's over the whole array, as there; the rounding, the errors and their largest
    value are formed a block at a time, so that no copy of a whole array is made and each
    element is read from memory once per dtype. ``scales`` keeps each truth's RMS, by its
    ``id``, for the calls after (the truth's arrays live as long as it)."""
    scales = {} if scales is None else scales
    floors: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in dtypes}
    longest = max((truth.size for _, _, truth in pairs), default=0)
    squares = np.empty(longest, np.float64)  # one array's squared errors, for its mean
    block = max(1, min(_FLOOR_BLOCK, longest))
    rounded, bits = np.empty(block, np.float32), np.empty(block, np.uint32)
    error = np.empty(block, np.float64)
    for grad, low, truth in pairs:
        length = truth.size
        expected = np.asarray(truth, np.float64).reshape(-1)
        measured = np.ascontiguousarray(low, np.float32).reshape(-1)
        if length == 0:
            for name in dtypes:
                floors[name][grad] = (0.0, 0.0)
            continue
        sq = squares[:length]
        rms = scales.get(id(truth))
        if rms is None:
            rms = scales[id(truth)] = math.sqrt(float(np.mean(np.square(expected, out=sq))))
        for name in dtypes:
            peak = np.float64(0.0)
            for start in range(0, length, block):
                stop = min(start + block, length)
                err = error[: stop - start]
                part = measured[start:stop]
                if name != "float32":
                    _round_into(part, name, rounded[: stop - start], bits[: stop - start])
                    part = rounded[: stop - start]
                np.subtract(part, expected[start:stop], out=err)
                np.abs(err, out=err)
                peak = np.maximum(peak, err.max())
                np.square(err, out=sq[start:stop])
            floors[name][grad] = _floor_figures(rms, float(np.mean(sq)), float(peak))
    return floors


#: The panel of correct forms each class's floors come from: the step-by-step form computed in
#: float32, and the fused kernels' chunked form (:mod:`gdn_layout.reference._fused`) with its
#: matrix products on float32, TF32 or bfloat16 operands; each result rounded to the class's
#: buffers. float16 takes the TF32 run, whose operands have float16's 10 mantissa bits (not
#: its range: under extreme decay a float16 kernel's underflow is its own).
PANEL: Final = {
    "float32": (("step-by-step", "float32"), ("chunked", "float32")),
    "tf32": (("step-by-step", "float32"), ("chunked", "float32"), ("chunked-tf32", "float32")),
    "bfloat16": (("step-by-step", "bfloat16"), ("chunked-bfloat16", "bfloat16")),
    "float16": (("step-by-step", "float16"), ("chunked-tf32", "float16")),
}
#: Most elements of a tensor whose floors take the rounding analysis's least.
FEW_ELEMENTS: Final = 32
#: The runs of :data:`PANEL`: the mantissa bits of the chunked form's product operands (None:
#: float32's own).
CHUNKED_RUNS: Final = {"chunked": None, "chunked-tf32": 10, "chunked-bfloat16": 7}


#: How many times over the floors take the step-by-step form's figures estimated from a sample
#: of batch rows and heads (:class:`Sample`). Over every gate regime and gate mode at S = 512
#: and 4096 (H = 16, two rows and heads of sixteen sampled, several seeds), the floors so taken
#: were never below the whole run's, and at most 4.6 times above (1.03 at the median); taken
#: twice over, as low as 0.96 of them (benchmarks/bench_reference.py --sampled).
SAMPLE_MARGIN: Final = 2.5


class Sample(NamedTuple):
    """A form run on a sample of batch rows and heads alone (``form``), with the truth
    (``truth``, by tensor name) and every form's results there (``runs``, by form, then
    tensor name; that form's own among them)."""

    form: str
    truth: Mapping[str, NDArray[Any]]
    runs: Mapping[str, Mapping[str, NDArray[Any]]]


def panel_floors(
    runs: Mapping[str, Mapping[str, NDArray[Any]]],
    truth: Mapping[str, NDArray[Any]],
    sizes: Mapping[str, NDArray[Any]] | None,
    precisions: tuple[str, ...] = tuple(PANEL),
    sample: Sample | None = None,
) -> dict[str, dict[str, tuple[float, float, float]]]:
    """The floors of each class of ``precisions`` for every tensor of ``truth``: the worst
    figures of its forms' ``runs`` (by form name, then tensor name), with the *reach*: the
    floor's larger figure over the step-by-step form's.

    The form of ``sample`` ran on that sample alone. Its figures are estimated from the
    class's next form, which ran whole: that form's figures times the ratio of the two
    forms' figures on the sample (so that rows and heads of other scales and decays than
    the sample's weigh in as they do in the next form), and taken :data:`SAMPLE_MARGIN`
    times over.

    A tensor of at most :data:`FEW_ELEMENTS` elements is a few samples of each form's
    rounding, which another order of the same sums can exceed: its floors are no lower than
    the rounding analysis allows: a sum of terms whose absolute values sum to ``M`` may change
    by about ``u * M`` in another order, ``u`` the class's product roundoff (``sizes`` holds
    ``M`` of each tensor's last sums), and the floor is no lower than ``u * M``. On more
    elements the figures are many samples, and that bound, far above what rounding reaches
    where terms cancel (100 times a bfloat16 kernel's ``dg`` error), would hide real errors:
    over the standard suite, correct kernels exceed the panel's figures alone only on
    tensors of at most 30 elements."""
    pairs: dict[str, list[tuple[str, NDArray[Any], NDArray[Any]]]] = {
        form: [(name, runs[form][name], truth[name]) for name in truth] for form in runs
    }
    wanted: dict[str, set[str]] = {}
    for precision in precisions:
        for form, rounding in PANEL[precision]:
            wanted.setdefault(form, set()).add(rounding)
    scales: dict[int, float] = {}  # the truth's RMS, by array, for every form it is against
    measured = {
        form: _measure(pairs[form], tuple(sorted(roundings)), scales)
        for form, roundings in wanted.items()
        if form in runs
    }
    if sample is not None and sample.form in wanted:
        measured[sample.form] = _sampled(sample, measured, wanted, precisions, truth)
    magnitude = None if sizes is None else _magnitudes(sizes, truth)
    floors: dict[str, dict[str, tuple[float, float, float]]] = {}
    for precision in precisions:
        forms = PANEL[precision]
        u = PRECISIONS[precision].product_roundoff
        floors[precision] = {}
        for name in truth:
            step = measured["step-by-step"][forms[0][1]][name]
            worst = [measured[form][rounding][name] for form, rounding in forms]
            if magnitude is not None and name in magnitude and truth[name].size <= FEW_ELEMENTS:
                worst.append((u * magnitude[name][0], u * magnitude[name][1]))
            rms = _short(max(f[0] for f in worst))
            peak = _short(max(f[1] for f in worst))
            # Over the step-by-step form's figure, which is no lower than the least floor:
            # a form that happened to round exactly reaches nothing.
            base = max(*step, PRECISIONS[precision].unit_roundoff / 2)
            reach = _short(max(rms, peak) / base)
            floors[precision][name] = (rms, peak, reach)
    return floors


def _sampled(
    sample: Sample,
    measured: Mapping[str, Mapping[str, Mapping[str, tuple[float, float]]]],
    wanted: Mapping[str, set[str]],
    precisions: tuple[str, ...],
    truth: Mapping[str, NDArray[Any]],
) -> dict[str, dict[str, tuple[float, float]]]:
    """The figures of ``sample.form`` for the whole of ``truth``, by rounding: estimated from
    the next form of each class (see :func:`panel_floors`)."""
    scales: dict[int, float] = {}
    names = list(truth)
    on_sample = {
        form: _measure(
            [(name, sample.runs[form][name], sample.truth[name]) for name in names],
            tuple(sorted(wanted[form])),
            scales,
        )
        for form in sample.runs
        if form in wanted
    }
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for precision in precisions:
        (_, rounding), (other, other_rounding) = PANEL[precision][:2]
        own, next_form = on_sample[sample.form][rounding], on_sample[other][other_rounding]
        whole = measured[other][other_rounding]
        per = out.setdefault(rounding, {})
        for name in names:
            estimate = []
            for i in (0, 1):
                ratio = own[name][i] / next_form[name][i] if next_form[name][i] > 0 else math.inf
                figure = whole[name][i] * ratio
                if not math.isfinite(figure):  # nothing to scale by: the sample's own
                    figure = own[name][i] if math.isfinite(own[name][i]) else whole[name][i]
                estimate.append(_short(SAMPLE_MARGIN * figure))
            worst = per.get(name, (0.0, 0.0))
            per[name] = (max(worst[0], estimate[0]), max(worst[1], estimate[1]))
    return out


def _magnitudes(
    sizes: Mapping[str, NDArray[Any]], truth: Mapping[str, NDArray[Any]]
) -> dict[str, tuple[float, float]]:
    """``(rms(M), max(M))`` of each tensor over rms(truth); zeros where the truth is 0."""
    out = {}
    for name, expected in truth.items():
        if name not in sizes:
            continue
        m = np.asarray(sizes[name], np.float64).reshape(-1)
        rms = (
            math.sqrt(float(np.mean(np.square(np.asarray(expected, np.float64)))))
            if expected.size
            else 0.0
        )
        if rms == 0 or m.size == 0:
            out[name] = (0.0, 0.0)
            continue
        out[name] = (math.sqrt(float(np.mean(np.square(m)))) / rms, float(m.max()) / rms)
    return out


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
) -> dict[str, dict[str, tuple[float, ...]]]:
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

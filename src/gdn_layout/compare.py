"""Compare a packed gradient buffer with a reference, gradient by gradient.

Each gradient is judged on its own, by one of these criteria:

calibrated (the default for float32, float16, bfloat16 and float64)
    A correct kernel differs from the float64 truth by its precision's rounding, whose
    *floors* a fixture stores per gradient (:attr:`~gdn_layout.Fixture.floors`; pass them as
    ``floors=``; see :mod:`gdn_layout._criteria`): the RMS error ratio and the largest error
    over the gradient's RMS of the spec's step-by-step form computed in float32 (and rounded
    to float16 or bfloat16; for float64, float32's scaled by ``2**-29``, the ratio of their
    unit roundoffs). Judged in the less precise of the two dtypes, a gradient passes when its
    RMS ratio ``rms(a - e) / rms(e)`` and its largest error ``max|a - e| / rms(e)`` are both
    at most ``K`` times their floors: 16 for float32, 8 for float16 and bfloat16, 64 for
    float64 (whose truth is itself rounded to float64), chosen from measurement
    (``benchmarks/calibrate_tolerances.py``). No floor, as an error, is below half the unit
    roundoff times the larger of ``rms(e)`` and the scale of the terms that form the gradient
    (``scales=``, a fixture's :attr:`~gdn_layout.Fixture.scales`): a ``dg`` that is exactly
    0, or far below the ``q . dq - k . dk`` a chunked kernel forms it from, is judged against
    those terms, not against its own RMS. ``error_floor_ratio`` is the larger of the two
    errors over their floors; ``out/size`` counts the elements over the largest error
    allowed. Without ``floors``, the floors are defaults above every floor measured over the
    suite's first four regimes: float32 ``(6e-5, 2e-4)``, float16 ``(1e-3, 1e-2)``,
    bfloat16 ``(4e-3, 5e-2)``, float64 float32's times ``2**-29``.
elementwise (``rtol`` or ``atol`` given)
    ``numpy.isclose`` semantics: ``|a - e| <= atol + rtol * |e|`` for every element; the one
    not given defaults by the less precise dtype (bfloat16: 1.6e-2/1e-5, float16:
    1e-3/1e-5, float32: 1.3e-6/1e-5, float64: 1e-7/1e-7).
RMS (``max_rms_ratio`` given)
    ``rms(a - e) / rms(e) <= max_rms_ratio``, the figure flash-linear-attention gates its
    kernel tests on. Given with ``rtol`` or ``atol``, both criteria apply.

Errors are computed in float64 whatever the two dtypes are.

Non-finite values:

* A pair of equal infinities (``+inf`` against ``+inf``) matches; it has error 0.
* NaN never matches, not even NaN in both buffers, unless ``equal_nan=True``, under which
  NaN against NaN matches (error 0). A NaN reference is usually a bug in the reference.
* Every other pair with a non-finite side (NaN against a number, ``inf`` against a number or
  ``-inf``) is a *non-finite mismatch*: it is out of tolerance, has error ``inf`` in the error
  map, and fails its gradient in both modes, since an RMS figure cannot account for it.
* ``max_abs_error``, ``max_rel_error`` and ``rms_ratio`` are taken over the pairs in which both
  values are finite, unless there is a non-finite mismatch: then they are NaN (a NaN is
  involved) or Inf, so that the report shows it. NaN and Inf are counted on each side apart.

>>> import numpy as np
>>> from gdn_layout import GdnBackwardLayout, unpack
>>> layout = GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=3)
>>> expected = np.linspace(-1, 1, layout.total_elems)
>>> actual = expected.astype(np.float32)
>>> unpack(actual, layout).dk[0, 2, 1, 0] += 0.5
>>> result = compare(actual, expected, layout)
>>> result.passed, result.failed
(False, ('dk',))
>>> result["dk"].worst, result["dk"].mismatches
((0, 2, 1, 0), 1)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from ._arrays import as_packed
from ._checks import not_a_layout
from ._comparison import Comparison, GradComparison
from ._criteria import (
    CALIBRATED_DTYPES,
    DEFAULT_TOLERANCES,
    UNIT_ROUNDOFF,
    Floors,
    K,
    Tolerance,
    calibration,
    checked_floors,
    least_precise,
    per_grad,
)
from ._dtypes import is_floating
from ._errormap import ErrorMap, chunks
from ._stats import Norm, rms_ratio_of
from .layout import GdnBackwardLayout, Segment, layout_caption

__all__ = ["Comparison", "GradComparison", "K", "as_packed", "assert_close", "compare", "error_map"]

_Cell = TypeVar("_Cell", bound=np.generic)


def compare(
    actual: NDArray[Any],
    expected: NDArray[Any],
    layout: GdnBackwardLayout,
    *,
    rtol: Tolerance | None = None,
    atol: Tolerance | None = None,
    max_rms_ratio: Tolerance | None = None,
    equal_nan: bool = False,
    floors: Floors | None = None,
    scales: Tolerance | None = None,
) -> Comparison:
    """Compare the packed buffer ``actual`` with ``expected`` under ``layout``.

    Both must be 1-D float arrays (float16, bfloat16, float32, float64) of length
    ``layout.total_elems``, or anything :func:`as_packed` reads as one (a torch tensor, any
    object with ``__dlpack__`` or ``__array__``); their dtypes may differ. ``rtol``, ``atol``
    and ``max_rms_ratio`` are each a float for every gradient or a mapping from gradient name
    to float. A gradient given none of them is judged by the calibrated criterion against
    ``floors`` (a fixture's :attr:`~gdn_layout.Fixture.floors`, or the defaults); see the
    module for the criteria and for how NaN and Inf are judged.

    Parameters
    ----------
    actual, expected : array_like
        1-D float buffers (float16, bfloat16, float32, float64) of ``layout.total_elems``
        elements, or what :func:`as_packed` reads as one; their dtypes may differ.
    layout : GdnBackwardLayout
        The layout of both.
    rtol, atol : float or mapping of str to float, optional
        Elementwise tolerances, for every gradient or by gradient name; the one left out
        defaults by the less precise dtype.
    max_rms_ratio : float or mapping of str to float, optional
        Judge a gradient by ``rms(a - e) / rms(e) <= max_rms_ratio`` (and by ``rtol``/``atol``
        too when either is given).
    equal_nan : bool
        Whether NaN against NaN matches.
    floors : mapping, optional
        The precision floors of the calibrated criterion, used for a gradient given none of
        the three above (:attr:`~gdn_layout.Fixture.floors`); left out, the defaults.
    scales : float or mapping of str to float, optional
        The scale of the terms that form each gradient (:attr:`~gdn_layout.Fixture.scales`):
        where it is above ``rms(expected)``, no floor of the calibrated criterion is below
        half the unit roundoff times it. Left out, ``rms(expected)``.

    Returns
    -------
    Comparison
        One :class:`GradComparison` per gradient.

    Raises
    ------
    TypeError
        A buffer or ``layout`` has the wrong type or dtype, a buffer is a masked array or an
        ndarray subclass whose values may not be its data, or a tolerance is not a number.
    ValueError
        A buffer has the wrong shape, a tolerance is negative or infinite, or a mapping names
        an unknown gradient.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout
    >>> layout = GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=3)
    >>> expected = np.linspace(-1, 1, layout.total_elems)
    >>> noisy = expected * (1 + 1e-3 * np.cos(np.arange(expected.size)))
    >>> compare(noisy, expected, layout).passed
    False
    >>> compare(noisy, expected, layout, max_rms_ratio=2e-3).passed
    True
    >>> compare(noisy, expected, layout, rtol={"dg": 1e-2, "dbeta": 1e-2}).failed
    ('dq', 'dk', 'dv')
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "compare")
    actual = as_packed(actual, "actual")
    expected = as_packed(expected, "expected")
    _check_buffer("actual", actual, layout)
    _check_buffer("expected", expected, layout)
    actual, expected = np.asarray(actual), np.asarray(expected)
    if not isinstance(equal_nan, (bool, np.bool_)):
        raise TypeError(f"compare: equal_nan must be a bool, got {type(equal_nan).__name__}")
    floors = None if floors is None else checked_floors(floors, "compare: floors")
    judged = least_precise(actual.dtype, expected.dtype)
    default_rtol, default_atol = DEFAULT_TOLERANCES.get(judged, DEFAULT_TOLERANCES["float64"])
    rtols = per_grad("rtol", rtol)
    atols = per_grad("atol", atol)
    rms_limits = per_grad("max_rms_ratio", max_rms_ratio)
    term = per_grad("scales", scales)
    grads = []
    for seg in layout.segments():
        a = actual[seg.offset : seg.offset + seg.length]
        e = expected[seg.offset : seg.offset + seg.length]
        given = [d.get(seg.name) for d in (rtols, atols, rms_limits)]
        if given == [None, None, None] and judged in CALIBRATED_DTYPES:
            grads.append(
                _calibrated(seg, a, e, floors, judged, term.get(seg.name), bool(equal_nan))
            )
            continue
        r, t, m = given
        grads.append(
            _compare_grad(
                seg,
                a,
                e,
                default_rtol if r is None else r,
                default_atol if t is None else t,
                m,
                bool(equal_nan),
                elementwise=m is None or r is not None or t is not None,
            )
        )
    return Comparison(layout, tuple(grads))


def assert_close(
    actual: NDArray[Any],
    expected: NDArray[Any],
    layout: GdnBackwardLayout,
    *,
    rtol: Tolerance | None = None,
    atol: Tolerance | None = None,
    max_rms_ratio: Tolerance | None = None,
    equal_nan: bool = False,
    floors: Floors | None = None,
    scales: Tolerance | None = None,
) -> Comparison:
    """:func:`compare`, raising AssertionError naming each failing gradient; for pytest.

    Returns the :class:`Comparison` when every gradient passes.

    Parameters
    ----------
    actual, expected, layout, rtol, atol, max_rms_ratio, equal_nan, floors, scales
        As for :func:`compare`.

    Returns
    -------
    Comparison
        One :class:`GradComparison` per gradient.

    Raises
    ------
    AssertionError
        A gradient fails; the message names each failing gradient and its worst element.
    TypeError
        A buffer or ``layout`` has the wrong type or dtype, a buffer is a masked array or an
        ndarray subclass whose values may not be its data, or a tolerance is not a number.
    ValueError
        A buffer has the wrong shape, a tolerance is negative or infinite, or a mapping names
        an unknown gradient.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout, unpack
    >>> layout = GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=3)
    >>> expected = np.full(layout.total_elems, 0.5)
    >>> actual = expected.copy()
    >>> unpack(actual, layout).dk[0, 3, 1, 2] = 0.51
    >>> assert_close(actual, expected, layout)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: gradients differ: dk (1 of 5 failed) for B=1 S=4 H=2 N=3, ...
      dk[0, 3, 1, 2]: actual 0.51 expected 0.5; error/floor 5.37e+10 > 64 (floors for ...
    """
    result = compare(
        actual,
        expected,
        layout,
        rtol=rtol,
        atol=atol,
        max_rms_ratio=max_rms_ratio,
        equal_nan=equal_nan,
        floors=floors,
        scales=scales,
    )
    if not result.passed:
        lines = [
            f"gradients differ: {', '.join(result.failed)} ({len(result.failed)} of "
            f"{len(result.grads)} failed) for {layout_caption(layout)}"
        ]
        lines.extend(f"  {g.summary()}" for g in result.grads if not g.passed)
        raise AssertionError("\n".join(lines))
    return result


def error_map(
    actual: NDArray[Any], expected: NDArray[Any], layout: GdnBackwardLayout, name: str
) -> NDArray[np.float64]:
    """The largest ``|a - e|`` of one gradient over (sequence position, head), for plots.

    ``[S, H]`` for every gradient but ``dstate``, whose map is ``[N, H]`` over (key row
    ``i``, head); a non-finite mismatch is ``inf``, a matching non-finite pair 0. A map whose
    per-batch maps (``B * S * H`` cells) would pass 2**20 cells is binned, each cell the
    largest error of a block of positions (:attr:`GradComparison.error_map_bins`), so that
    its memory is bounded.

    Parameters
    ----------
    actual, expected : numpy.ndarray
        1-D float buffers of ``layout.total_elems`` elements.
    layout : GdnBackwardLayout
        The layout of both.
    name : str
        The gradient, ``"dq"`` to ``"dstate"``.

    Returns
    -------
    numpy.ndarray
        A read-only float64 map, ``[S, H]`` (``[N, H]`` for ``dstate``), binned when large.

    Raises
    ------
    TypeError, ValueError
        As :func:`compare`.
    KeyError
        The layout has no gradient ``name``.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout, unpack
    >>> layout = GdnBackwardLayout(batch=2, seq=4, heads=3, state_size=2)
    >>> actual = np.zeros(layout.total_elems)
    >>> unpack(actual, layout).dv[1, 2, 0, 1] = 0.25
    >>> error_map(actual, np.zeros_like(actual), layout, "dv")
    array([[0.  , 0.  , 0.  ],
           [0.  , 0.  , 0.  ],
           [0.25, 0.  , 0.  ],
           [0.  , 0.  , 0.  ]])
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "error_map")
    actual = as_packed(actual, "actual", "error_map")
    expected = as_packed(expected, "expected", "error_map")
    _check_buffer("actual", actual, layout, "error_map")
    _check_buffer("expected", expected, layout, "error_map")
    actual, expected = np.asarray(actual), np.asarray(expected)
    seg = layout.segment(name)
    span = slice(seg.offset, seg.offset + seg.length)
    return _compare_grad(seg, actual[span], expected[span], 0.0, 0.0, None, False).error_map


def compare_tensor(
    actual: object,
    expected: NDArray[Any],
    name: str,
    *,
    floors: Floors | None = None,
    func: str = "compare_states",
) -> GradComparison:
    """One tensor besides the gradients (``y``, ``h``, ``dh``, ``final_state``) judged as a
    gradient is: by the calibrated criterion against ``floors`` (``{dtype: {name: (rms,
    max)}}``, a fixture's :attr:`~gdn_layout.Fixture.state_floors`), the worst element named
    in the tensor's own axes (``b, c, h, i, j`` for ``h`` and ``dh``).

    Raises
    ------
    TypeError
        ``actual`` is not an array of a float dtype.
    ValueError
        Its shape is not ``expected``'s.
    """
    array = np.asarray(as_packed(actual, "actual", func))
    if not is_floating(array.dtype):
        raise TypeError(f"{func}: {name} must have a float dtype, got {array.dtype}")
    _check_plain_values(name, array, func)
    if array.shape != expected.shape:
        raise ValueError(f"{func}: {name} must have shape {expected.shape}, got {array.shape}")
    seg = Segment(name, 0, expected.size, expected.shape)
    a, e = array.reshape(-1), np.asarray(expected).reshape(-1)
    judged = least_precise(array.dtype, expected.dtype)
    if judged not in CALIBRATED_DTYPES:  # pragma: no cover - least_precise names one of them
        judged = "float64"
    return _calibrated(seg, a, e, floors, judged, None, False)


def _calibrated(
    seg: Segment,
    a: NDArray[Any],
    e: NDArray[Any],
    floors: Floors | None,
    judged: str,
    term_scale: float | None,
    equal_nan: bool,
) -> GradComparison:
    """One tensor judged by the calibrated criterion in dtype ``judged``."""
    c = calibration(floors, judged, seg.name, e, term_scale)
    result = _compare_grad(seg, a, e, 0.0, c.atol, c.max_rms_ratio, equal_nan)
    by_terms = c.least > UNIT_ROUNDOFF[judged] / 2 * c.scale
    ratio = c.ratio(result.rms_ratio, result.max_abs_error)
    return dataclasses.replace(
        result,
        floor=c.floor,
        judged_dtype=judged,
        error_floor_ratio=ratio,
        term_scale=term_scale if by_terms else None,
        passed=result.passed and ratio <= c.k,  # one verdict, the ratio's
    )


# -- validation ----------------------------------------------------------------------------


def _check_buffer(
    which: str, buffer: object, layout: GdnBackwardLayout, func: str = "compare"
) -> None:
    if not isinstance(buffer, np.ndarray):
        raise TypeError(f"{func}: {which} must be a NumPy array, got {type(buffer).__name__}")
    _check_plain_values(which, buffer, func)
    if not is_floating(buffer.dtype):
        raise TypeError(
            f"{func}: {which} must have a float dtype (float16, bfloat16, float32, float64), "
            f"got {buffer.dtype}"
        )
    if buffer.shape != (layout.total_elems,):
        raise ValueError(
            f"{func}: {which} must be 1-D with layout.total_elems = {layout.total_elems} "
            f"elements, got shape {buffer.shape}, for {layout!r}"
        )


#: What an ndarray subclass may not override for its values to be what np.asarray shows.
_VALUE_METHODS = ("__getitem__", "__array__", "__array_ufunc__", "__array_function__", "astype")


def _check_plain_values(which: str, buffer: np.ndarray[Any, Any], func: str) -> None:
    """Refuse arrays whose values are not their data: a mask, or a subclass that changes
    what indexing or conversion gives. A memory map is its data."""
    kind = type(buffer)
    if kind is np.ndarray or kind is np.memmap:
        return
    if isinstance(buffer, np.ma.MaskedArray):
        raise TypeError(
            f"{func}: {which} is a masked array; its masked elements would be compared as the "
            "values under the mask. Pass np.ma.filled(x, fill) or x.data to say what they are"
        )
    changed = [m for m in _VALUE_METHODS if getattr(kind, m, None) is not getattr(np.ndarray, m)]
    if changed and not issubclass(kind, np.memmap):
        raise TypeError(
            f"{func}: {which} is a {kind.__name__}, an ndarray subclass that overrides "
            f"{', '.join(changed)}: its values may not be its data. Pass np.asarray(x) to "
            "compare the data"
        )


# -- the comparison itself -----------------------------------------------------------------


def _compare_grad(
    seg: Segment,
    actual: NDArray[Any],
    expected: NDArray[Any],
    rtol: float,
    atol: float,
    max_rms_ratio: float | None,
    equal_nan: bool,
    *,
    elementwise: bool = True,
) -> GradComparison:
    name, shape = seg.name, seg.shape
    # Chunks of elements, never of rows: a dstate row alone is N * N elements. The per-batch
    # maps are over the first three axes, (b, s, h), or (b, h, i) for dstate, turned into
    # (b, i, h); the error map is their maximum over b. All of them are binned when large.
    emap = ErrorMap(shape)
    transpose = seg.axes[1] == "h"

    nan_a = inf_a = nan_e = inf_e = mismatches = bad_count = bad_nan = 0
    max_abs = max_rel = 0.0
    # |a - e| of two finite values overflows past the largest float; such pairs go into
    # norm_half as |a/2 - e/2|, so that the RMS ratio stays exact up to the largest values.
    norm_diff, norm_half, norm_exp = Norm(), Norm(), Norm()
    best = -math.inf
    worst_index: int | None = None
    worst_a = worst_e = 0.0

    for start, stop in chunks(shape):
        a = actual[start:stop].astype(np.float64)
        e = expected[start:stop].astype(np.float64)
        a_nan, e_nan = np.isnan(a), np.isnan(e)
        a_inf, e_inf = np.isinf(a), np.isinf(e)
        nan_a += int(a_nan.sum())
        nan_e += int(e_nan.sum())
        inf_a += int(a_inf.sum())
        inf_e += int(e_inf.sum())
        finite = ~(a_nan | e_nan | a_inf | e_inf)
        abs_e = np.where(finite, np.abs(e), 0.0)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(finite, np.abs(a - e), 0.0)
        overflowed = np.isinf(diff)  # both finite, yet |a - e| is past the largest float
        # Everything below sees finite numbers; non-finite pairs are patched in after.
        bad = ~finite
        if bad.any():
            matched = bad & ((a == e) | (equal_nan & a_nan & e_nan))
            bad &= ~matched
            bad_count += int(bad.sum())
            bad_nan += int((bad & (a_nan | e_nan)).sum())
            diff_map = np.where(bad, np.inf, diff)
        else:
            diff_map = diff
        allowed = atol + rtol * abs_e
        out = (diff > allowed) | bad
        counted = out if elementwise else bad  # what the criterion counts, element by element
        mismatches += int(counted.sum())
        if finite.any():
            max_abs = max(max_abs, float(diff.max()))
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                rel = np.where(diff == 0, 0.0, diff / abs_e)
            if overflowed.any():
                half = np.abs(a[overflowed] * 0.5 - e[overflowed] * 0.5)
                rel[overflowed] = half / (abs_e[overflowed] * 0.5)
                norm_half.add(half)
                norm_diff.add(np.where(overflowed, 0.0, diff))
            else:
                norm_diff.add(diff)
            max_rel = max(max_rel, float(rel.max()))
            norm_exp.add(abs_e)
        score = diff - allowed if elementwise else diff.copy()
        score[~finite] = -math.inf  # matching non-finite pairs are never the worst
        score[bad] = math.inf
        local = int(np.argmax(score))
        if worst_index is None or score[local] > best:
            best = float(score[local])
            worst_index = start + local
            worst_a, worst_e = float(a[local]), float(e[local])
        emap.update(start, diff_map, counted)

    rms_ratio = rms_ratio_of(norm_diff, norm_half, norm_exp)
    if bad_count:  # the error of a non-finite mismatch is NaN (or Inf), whatever the rest is
        max_abs = max_rel = rms_ratio = math.nan if bad_nan else math.inf
    passed = bad_count == 0 and mismatches == 0
    if max_rms_ratio is not None:
        passed = passed and rms_ratio <= max_rms_ratio
    worst = (
        None if worst_index is None else tuple(int(i) for i in np.unravel_index(worst_index, shape))
    )
    batch_cells, counts, bins = emap.cells, emap.counts, emap.bins
    if transpose:  # [B, H, N] to [B, N, H]
        batch_cells = np.ascontiguousarray(batch_cells.transpose(0, 2, 1))
        counts = np.ascontiguousarray(counts.transpose(0, 2, 1))
    return GradComparison(
        name=name,
        shape=shape,
        actual_dtype=actual.dtype.name,
        expected_dtype=expected.dtype.name,
        size=seg.length,
        rtol=rtol,
        atol=atol,
        max_rms_ratio=max_rms_ratio,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        rms_ratio=rms_ratio,
        mismatches=mismatches,
        nonfinite_mismatches=bad_count,
        nan_actual=nan_a,
        inf_actual=inf_a,
        nan_expected=nan_e,
        inf_expected=inf_e,
        worst=worst,
        worst_actual=None if worst is None else worst_a,
        worst_expected=None if worst is None else worst_e,
        passed=passed,
        error_map=_read_only(batch_cells.max(axis=0, initial=0.0)),
        batch_error_map=_read_only(batch_cells),
        mismatch_map=_read_only(counts),
        error_map_bins=(bins[2], bins[1]) if transpose else (bins[1], bins[2]),
        batch_bins=bins[0],
        elementwise=elementwise,
    )


def _read_only(cells: NDArray[_Cell]) -> NDArray[_Cell]:
    cells.flags.writeable = False
    return cells

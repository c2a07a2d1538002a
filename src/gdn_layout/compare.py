"""Compare a packed gradient buffer with a reference, gradient by gradient.

Each gradient is judged on its own, either elementwise (``numpy.isclose`` semantics:
``|a - e| <= atol + rtol * |e|`` for every element) or, when ``max_rms_ratio`` is given for
it, by the RMS error ratio ``rms(a - e) / rms(e) <= max_rms_ratio``: the figure
flash-linear-attention gates its kernel tests on, because bf16/f16 kernels cannot meet
elementwise tolerances. Errors are computed in float64 whatever the two dtypes are.

Non-finite values:

* A pair of equal infinities (``+inf`` against ``+inf``) matches; it has error 0.
* NaN never matches, not even NaN in both buffers, unless ``equal_nan=True``, under which
  NaN against NaN matches (error 0). A NaN reference is usually a bug in the reference.
* Every other pair with a non-finite side (NaN against a number, ``inf`` against a number or
  ``-inf``) is a *non-finite mismatch*: it is out of tolerance, has error ``inf`` in the error
  map, and fails its gradient in both modes, since an RMS figure cannot account for it.
* ``max_abs_error``, ``max_rel_error`` and ``rms_ratio`` are taken over the pairs in which
  both values are finite; NaN and Inf are counted on each side separately.

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

import math
import numbers
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from ._checks import not_a_layout
from ._comparison import Comparison, GradComparison
from ._dtypes import is_floating
from ._errormap import ErrorMap, chunks
from ._stats import Norm, rms_ratio_of
from .layout import GRADIENT_NAMES, GdnBackwardLayout, Segment, layout_caption

__all__ = ["Comparison", "GradComparison", "assert_close", "compare", "error_map"]

Number = float | np.floating[Any] | np.integer[Any]
#: A tolerance for every gradient, or a mapping from gradient name to its tolerance.
Tolerance = Number | Mapping[str, Number]
_Cell = TypeVar("_Cell", bound=np.generic)


#: Default (rtol, atol) by the less precise of the two dtypes, as torch.testing.assert_close
#: chooses them; longdouble is judged like float64.
_DEFAULT_TOLERANCES = {
    "bfloat16": (1.6e-2, 1e-5),
    "float16": (1e-3, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
}
#: Less precise first.
_PRECISION_RANK = ("bfloat16", "float16", "float32", "float64", "longdouble")


def compare(
    actual: NDArray[Any],
    expected: NDArray[Any],
    layout: GdnBackwardLayout,
    *,
    rtol: Tolerance | None = None,
    atol: Tolerance | None = None,
    max_rms_ratio: Tolerance | None = None,
    equal_nan: bool = False,
) -> Comparison:
    """Compare the packed buffer ``actual`` with ``expected`` under ``layout``.

    Both must be 1-D float arrays (float16, bfloat16, float32, float64) of length
    ``layout.total_elems``; their dtypes may differ. ``rtol``, ``atol`` and ``max_rms_ratio``
    are each a float for every gradient or a mapping from gradient name to float; a name a
    mapping leaves out gets the default. The default ``rtol``/``atol`` depend on the less
    precise of the two dtypes (bfloat16: 1.6e-2/1e-5, float16: 1e-3/1e-5, float32:
    1.3e-6/1e-5, float64: 1e-7/1e-7); a gradient with a ``max_rms_ratio`` is judged by it
    instead of elementwise. See the module for how NaN and Inf are judged.

    Parameters
    ----------
    actual, expected : numpy.ndarray
        1-D float buffers (float16, bfloat16, float32, float64) of ``layout.total_elems``
        elements; their dtypes may differ.
    layout : GdnBackwardLayout
        The layout of both.
    rtol, atol : float or mapping of str to float, optional
        Elementwise tolerances, for every gradient or by gradient name; left out, the default
        of the less precise dtype.
    max_rms_ratio : float or mapping of str to float, optional
        Judge a gradient by ``rms(a - e) / rms(e) <= max_rms_ratio`` instead.
    equal_nan : bool
        Whether NaN against NaN matches.

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
    _check_buffer("actual", actual, layout)
    _check_buffer("expected", expected, layout)
    actual, expected = np.asarray(actual), np.asarray(expected)
    if not isinstance(equal_nan, (bool, np.bool_)):
        raise TypeError(f"compare: equal_nan must be a bool, got {type(equal_nan).__name__}")
    default_rtol, default_atol = _default_tolerances(actual.dtype, expected.dtype)
    rtols = _per_grad("rtol", rtol)
    atols = _per_grad("atol", atol)
    rms_limits = _per_grad("max_rms_ratio", max_rms_ratio)
    grads = tuple(
        _compare_grad(
            seg,
            actual[seg.offset : seg.offset + seg.length],
            expected[seg.offset : seg.offset + seg.length],
            rtols.get(seg.name, default_rtol),
            atols.get(seg.name, default_atol),
            rms_limits.get(seg.name),
            bool(equal_nan),
        )
        for seg in layout.segments()
    )
    return Comparison(layout, grads)


def assert_close(
    actual: NDArray[Any],
    expected: NDArray[Any],
    layout: GdnBackwardLayout,
    *,
    rtol: Tolerance | None = None,
    atol: Tolerance | None = None,
    max_rms_ratio: Tolerance | None = None,
    equal_nan: bool = False,
) -> Comparison:
    """:func:`compare`, raising AssertionError naming each failing gradient; for pytest.

    Returns the :class:`Comparison` when every gradient passes.

    Parameters
    ----------
    actual, expected : numpy.ndarray
        1-D float buffers (float16, bfloat16, float32, float64) of ``layout.total_elems``
        elements; their dtypes may differ.
    layout : GdnBackwardLayout
        The layout of both.
    rtol, atol : float or mapping of str to float, optional
        Elementwise tolerances, for every gradient or by gradient name; left out, the default
        of the less precise dtype.
    max_rms_ratio : float or mapping of str to float, optional
        Judge a gradient by ``rms(a - e) / rms(e) <= max_rms_ratio`` instead.
    equal_nan : bool
        Whether NaN against NaN matches.

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
      dk[0, 3, 1, 2]: actual 0.51 expected 0.5; 1 of 24 out of tolerance ...
    """
    result = compare(
        actual,
        expected,
        layout,
        rtol=rtol,
        atol=atol,
        max_rms_ratio=max_rms_ratio,
        equal_nan=equal_nan,
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
    _check_buffer("actual", actual, layout, "error_map")
    _check_buffer("expected", expected, layout, "error_map")
    actual, expected = np.asarray(actual), np.asarray(expected)
    seg = layout.segment(name)
    span = slice(seg.offset, seg.offset + seg.length)
    return _compare_grad(seg, actual[span], expected[span], 0.0, 0.0, None, False).error_map


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


def _default_tolerances(*dtypes: np.dtype[Any]) -> tuple[float, float]:
    names = [d.name if d.name in _PRECISION_RANK else "float64" for d in dtypes]
    least = min(names, key=_PRECISION_RANK.index)
    return _DEFAULT_TOLERANCES.get(least, _DEFAULT_TOLERANCES["float64"])


def _number(what: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"compare: {what} must be a float, got {type(value).__name__} {value!r}")
    number = float(value)
    if not number >= 0 or math.isinf(number):
        raise ValueError(f"compare: {what} must be a finite float >= 0, got {value!r}")
    return number


def _per_grad(what: str, value: Tolerance | None) -> dict[str, float]:
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


# -- the comparison itself -----------------------------------------------------------------


def _compare_grad(
    seg: Segment,
    actual: NDArray[Any],
    expected: NDArray[Any],
    rtol: float,
    atol: float,
    max_rms_ratio: float | None,
    equal_nan: bool,
) -> GradComparison:
    name, shape = seg.name, seg.shape
    # Chunks of elements, never of rows: a dstate row alone is N * N elements. The per-batch
    # maps are over the first three axes, (b, s, h), or (b, h, i) for dstate, turned into
    # (b, i, h); the error map is their maximum over b. All of them are binned when large.
    emap = ErrorMap(shape)
    transpose = seg.axes[1] == "h"

    nan_a = inf_a = nan_e = inf_e = mismatches = bad_count = 0
    max_abs = max_rel = 0.0
    # |a - e| of two finite values overflows past the largest float; such pairs go into
    # norm_half as |a/2 - e/2|, so that the RMS ratio stays exact up to the largest values.
    norm_diff, norm_half, norm_exp = Norm(), Norm(), Norm()
    best = -math.inf
    worst_index: int | None = None
    worst_a = worst_e = 0.0
    elementwise = max_rms_ratio is None

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
            diff_map = np.where(bad, np.inf, diff)
        else:
            diff_map = diff
        allowed = atol + rtol * abs_e
        out = (diff > allowed) | bad
        mismatches += int(out.sum())
        if finite.any():
            max_abs = max(max_abs, float(diff.max()))
            with np.errstate(divide="ignore", invalid="ignore"):
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
        emap.update(start, diff_map, out)

    rms_ratio = rms_ratio_of(norm_diff, norm_half, norm_exp)
    if elementwise:
        passed = mismatches == 0
    else:
        assert max_rms_ratio is not None
        passed = bad_count == 0 and rms_ratio <= max_rms_ratio
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
    )


def _read_only(cells: NDArray[_Cell]) -> NDArray[_Cell]:
    cells.flags.writeable = False
    return cells

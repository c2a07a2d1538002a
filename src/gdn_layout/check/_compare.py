"""compare, assert_close, error_map and compare_tensor: where a call enters the comparison, its
inputs are checked, a criterion chosen per gradient, and each gradient scanned once."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypedDict, Unpack, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from .._arrays import as_packed, device_of
from .._checks import not_a_layout
from .._dtypes import Precision, default_precision, is_floating, precision_of
from .._floors import Floors, checked_floors
from ..layout import GdnBackwardLayout, Segment, layout_caption
from ..packing import unpack
from ._criterion import (
    DEFAULT_TOLERANCES,
    Criterion,
    Tolerance,
    judged_precision,
    per_grad,
)
from ._explain import Evidence, explain
from ._findings import size_findings, tensor_findings
from ._records import Comparison, GradComparison, failure_message, read_from
from ._scan import cause_maps, scan

__all__ = ["Expected", "Judging", "assert_close", "compare", "compare_tensor", "error_map"]


@runtime_checkable
class Expected(Protocol):
    """What :func:`compare` reads of a fixture (:class:`~gdn_layout.Fixture` is one): the
    expected buffer and its layout, the floors and term scales that judge it, the inputs the
    explanations re-run, and a guard that holds its file unchanged while it is read."""

    @property
    def packed(self) -> NDArray[Any]: ...
    @property
    def layout(self) -> GdnBackwardLayout: ...
    @property
    def floors(self) -> Floors | None: ...
    @property
    def scales(self) -> Mapping[str, float]: ...
    @property
    def inputs(self) -> Sequence[NDArray[Any] | None]: ...
    def unchanged(self) -> contextlib.AbstractContextManager[Any]: ...


class Judging(TypedDict, total=False):
    """The keywords that choose how a kernel is judged, as every entry point takes them
    (:func:`compare`, :func:`assert_close`, :meth:`~gdn_layout.suites.Case.compare`,
    :meth:`~gdn_layout.suites.Case.check`): each is defined once, by :func:`compare`."""

    rtol: Tolerance | None
    atol: Tolerance | None
    max_rms_ratio: Tolerance | None
    equal_nan: bool
    precision: str | None


def compare(
    actual: NDArray[Any],
    expected: NDArray[Any] | Expected,
    layout: GdnBackwardLayout | None = None,
    *,
    rtol: Tolerance | None = None,
    atol: Tolerance | None = None,
    max_rms_ratio: Tolerance | None = None,
    equal_nan: bool = False,
    precision: str | None = None,
    floors: Floors | None = None,
    scales: Tolerance | None = None,
) -> Comparison:
    """Compare the packed buffer ``actual`` with ``expected`` under ``layout``.

    ``expected`` is a :class:`~gdn_layout.Fixture` (``compare(actual, fixture)``: its layout,
    floors and term scales come with it) or a packed buffer with its ``layout``. Buffers are
    1-D float arrays (float16, bfloat16, float32, float64) of length ``layout.total_elems``,
    or anything :func:`as_packed` reads as one (a torch tensor, any object with
    ``__dlpack__`` or ``__array__``); their dtypes may differ. ``rtol``, ``atol`` and
    ``max_rms_ratio`` are each a float for every gradient or a mapping from gradient name to
    float. A gradient given none of them is judged by the calibrated criterion of
    ``precision`` against the fixture's floors (or the defaults); see the module for the
    criteria and for how NaN and Inf are judged.

    Parameters
    ----------
    actual : array_like
        A 1-D float buffer (float16, bfloat16, float32, float64) of ``layout.total_elems``
        elements, or what :func:`as_packed` reads as one.
    expected : Fixture or array_like
        The fixture, or a buffer as ``actual`` is (their dtypes may differ).
    layout : GdnBackwardLayout, optional
        The layout of both; a fixture's own when left out.
    rtol, atol : float or mapping of str to float, optional
        Elementwise tolerances, for every gradient or by gradient name; the one left out
        defaults by the less precise dtype.
    max_rms_ratio : float or mapping of str to float, optional
        Judge a gradient by ``rms(a - e) / rms(e) <= max_rms_ratio`` (and by ``rtol``/``atol``
        too when either is given).
    equal_nan : bool
        Whether NaN against NaN matches.
    precision : str, optional
        The precision class the kernel computes in, whose floors judge it: ``"float64"``,
        ``"float32"``, ``"tf32"`` (float32 with matrix products on operands of 10 mantissa
        bits), ``"bfloat16"`` or ``"float16"``. Left out, the class of the fixture's dtype,
        and an ``actual`` coarser than the fixture is refused (a stray cast would pass as
        the coarser class); with bare buffers, the class of the less precise one's dtype. A
        class whose buffers are more precise than the buffers given is refused.
    floors : mapping, optional
        With an array ``expected``: the precision floors of the calibrated criterion
        (:attr:`~gdn_layout.Fixture.floors`); left out, the defaults.
    scales : float or mapping of str to float, optional
        With an array ``expected``: the scale of the terms that form each gradient
        (:attr:`~gdn_layout.Fixture.scales`); where it is above ``rms(expected)``, no floor
        of the calibrated criterion is below half the computation dtype's unit roundoff times
        it.

    Returns
    -------
    Comparison
        One :class:`GradComparison` per gradient.

    Raises
    ------
    TypeError
        A buffer or ``layout`` has the wrong type or dtype, a buffer is a masked array or an
        ndarray subclass whose values may not be its data, a tolerance is not a number, or
        ``floors`` or ``scales`` is given with a fixture (it brings its own).
    ValueError
        A buffer has the wrong shape, a tolerance is negative or infinite, a mapping names
        an unknown gradient, or ``precision`` is unknown or finer than the buffers.

    See Also
    --------
    assert_close : The same, raising for pytest.
    error_map : One gradient's errors over the sequence and heads.
    check.compare_tensor : A state or ``y`` judged the same way.
    load_suite : Fixtures to compare against.

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

    A fixture brings its layout, floors and term scales:

    >>> from gdn_layout import make_fixture
    >>> from gdn_layout.reference import backward
    >>> fixture = make_fixture(GdnBackwardLayout(1, 8, 2, 4), regime="mild")
    >>> kernel = backward(*fixture.inputs, dtype=np.float32)
    >>> compare(kernel, fixture).passed, compare(kernel, fixture, precision="tf32").passed
    (True, True)
    """
    if isinstance(expected, Expected):
        if floors is not None or scales is not None:
            raise TypeError(
                "compare: floors and scales come with the fixture; pass fixture.packed and "
                "its layout to give others"
            )
        if layout is not None and not isinstance(layout, GdnBackwardLayout):
            raise not_a_layout(layout, "compare")
        if layout is not None and layout != expected.layout:
            raise ValueError(f"compare: layout {layout!r} is not the fixture's {expected.layout!r}")
        with expected.unchanged():
            packed = expected.packed
            return _compare(
                actual,
                packed,
                expected.layout,
                _Judging(rtol, atol, max_rms_ratio, equal_nan, precision, expected.floors),
                expected.scales,
                expected.inputs,
                fixture_class=precision_of(packed.dtype, "compare: the fixture's dtype"),
            )
    if layout is None:
        raise TypeError("compare: layout is required when expected is an array")
    floors = None if floors is None else checked_floors(floors, "compare: floors")
    judging = _Judging(rtol, atol, max_rms_ratio, equal_nan, precision, floors)
    return _compare(actual, expected, layout, judging, scales)


@dataclasses.dataclass(frozen=True)
class _Judging:
    """The judging keywords of one call, as given."""

    rtol: Tolerance | None
    atol: Tolerance | None
    max_rms_ratio: Tolerance | None
    equal_nan: bool
    precision: str | None
    floors: Floors | None


def _compare(
    actual: object,
    expected: object,
    layout: GdnBackwardLayout,
    judging: _Judging,
    scales: Tolerance | None,
    inputs: Sequence[NDArray[Any] | None] | None = None,
    fixture_class: Precision | None = None,
) -> Comparison:
    """:func:`compare` in its two stages: each gradient measured once into its record (its
    figures and verdict), then, where one fails, :func:`~gdn_layout.check._explain.explain`
    of the records; with the case's ``inputs``, the explanations re-run the op."""
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "compare")
    device = device_of(actual)
    mine = _checked_buffer("actual", actual, layout)
    theirs = _checked_buffer("expected", expected, layout)
    equal_nan = judging.equal_nan
    if not isinstance(equal_nan, (bool, np.bool_)):
        raise TypeError(f"compare: equal_nan must be a bool, got {type(equal_nan).__name__}")
    buffers = default_precision(mine.dtype, theirs.dtype)
    default_rtol, default_atol = DEFAULT_TOLERANCES[buffers.buffer]
    rtols = per_grad("rtol", judging.rtol)
    atols = per_grad("atol", judging.atol)
    rms_limits = per_grad("max_rms_ratio", judging.max_rms_ratio)
    tolerated = set(rtols) | set(atols) | set(rms_limits)
    judged = buffers  # a class is judged in, and checked, only where a gradient is calibrated
    if any(name not in tolerated for name in layout.names):
        judged = _judged_class(judging.precision, fixture_class, mine.dtype, theirs.dtype)
    term = per_grad("scales", scales)
    records = []
    for seg in layout.segments():
        a = mine[seg.offset : seg.offset + seg.length]
        e = theirs[seg.offset : seg.offset + seg.length]
        r, t, m = (d.get(seg.name) for d in (rtols, atols, rms_limits))
        if r is None and t is None and m is None:
            criterion = Criterion.calibrated(
                judging.floors, judged, seg.name, e, term.get(seg.name)
            )
        else:
            criterion = Criterion.tolerances(
                default_rtol if r is None else r,
                default_atol if t is None else t,
                m,
                elementwise=m is None or r is not None or t is not None,
            )
        record = scan(seg, a, e, criterion, bool(equal_nan))
        if not record.passed:  # the maps of a cause cost nothing when everything passes
            signed, ratio = cause_maps(seg, a, e)
            record = dataclasses.replace(record, signed_error_map=signed, ratio_map=ratio)
        records.append(record)
    if all(r.passed for r in records):
        return Comparison(layout, tuple(records), device=device)
    evidence = Evidence(
        layout,
        tuple(records),
        mine,
        theirs,
        unpack(mine, layout),
        unpack(theirs, layout),
        inputs,
        judging.floors,
        judged,
    )
    explained, whole = explain(evidence)
    return Comparison(layout, explained, whole, device)


def _judged_class(
    precision: str | None,
    fixture_class: Precision | None,
    *dtypes: np.dtype[Any],
) -> Precision:
    """The class judged in: ``precision``, else the fixture's dtype's, else that of the less
    precise buffer. A kernel coarser than its fixture is refused unless ``precision`` names
    its class: a stray cast would otherwise pass as the coarser class."""
    if precision is not None or fixture_class is None:
        return judged_precision(precision, "compare", *dtypes)
    buffers = default_precision(*dtypes)
    if buffers.unit_roundoff > fixture_class.unit_roundoff:
        raise ValueError(
            f"compare: the fixture is {fixture_class.buffer}, so the kernel is judged as "
            f"{fixture_class.name}, but its output is {buffers.buffer}, coarser: a stray "
            f"cast? A kernel that computes in {buffers.name} is judged with "
            f"precision={buffers.name!r} (--precision {buffers.name} on the command line, "
            f"--gdn-precision {buffers.name} with pytest)"
        )
    return fixture_class


def assert_close(
    actual: NDArray[Any],
    expected: NDArray[Any] | Expected,
    layout: GdnBackwardLayout | None = None,
    *,
    floors: Floors | None = None,
    scales: Tolerance | None = None,
    **judging: Unpack[Judging],
) -> Comparison:
    """:func:`compare`, raising AssertionError naming each failing gradient; for pytest.

    Returns the :class:`Comparison` when every gradient passes.

    Parameters
    ----------
    actual, expected, layout, floors, scales
        As for :func:`compare`.
    **judging
        The judging keywords of :func:`compare` (:class:`Judging`), as it takes them.

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

    See Also
    --------
    compare : The same comparison, returned rather than raised.

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
      dk[0, 3, 1, 2]: actual 0.51 expected 0.5; error/floor ... > 64 (floors for float64: ...
    """
    result = compare(actual, expected, layout, floors=floors, scales=scales, **judging)
    if not result.passed:
        heading = (
            f"gradients differ: {', '.join(result.failed)} ({len(result.failed)} of "
            f"{len(result.grads)} failed) for {layout_caption(result.layout)}"
            f"{read_from(result.device)}"
        )
        raise AssertionError(failure_message(heading, result))
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

    See Also
    --------
    compare : Every gradient judged.
    plot.plot_errors : The maps drawn.

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
    actual = _checked_buffer("actual", actual, layout, "error_map")
    expected = _checked_buffer("expected", expected, layout, "error_map")
    seg = layout.segment(name)
    span = slice(seg.offset, seg.offset + seg.length)
    return scan(seg, actual[span], expected[span], Criterion.tolerances(0.0, 0.0), False).error_map


def compare_tensor(
    actual: object,
    expected: NDArray[Any],
    name: str,
    *,
    floors: Floors | None = None,
    precision: str | None = None,
    func: str = "compare_states",
) -> GradComparison:
    """One tensor besides the gradients (``y``, ``h``, ``dh``, ``final_state``) judged as a
    gradient is: by the calibrated criterion of ``precision`` (as :func:`compare` takes it)
    against ``floors`` (``{precision: {name: (rms, max)}}``, a fixture's
    :attr:`~gdn_layout.Fixture.state_floors`), the worst element named in the tensor's own
    axes (``b, c, h, i, j`` for ``h`` and ``dh``).

    Raises
    ------
    TypeError
        ``actual`` is not an array of a float dtype.
    ValueError
        Its shape is not ``expected``'s.

    See Also
    --------
    compare : The gradients judged.
    suites.compare_states : A kernel's states against a fixture's.
    """
    array = np.asarray(as_packed(actual, "actual", func))
    if not is_floating(array.dtype):
        raise TypeError(f"{func}: {name} must have a float dtype, got {array.dtype}")
    _check_plain_values(name, array, func)
    if array.shape != expected.shape:
        raise ValueError(f"{func}: {name} must have shape {expected.shape}, got {array.shape}")
    seg = Segment(name, 0, expected.size, expected.shape)
    a, e = array.reshape(-1), np.asarray(expected).reshape(-1)
    judged = judged_precision(precision, func, array.dtype, expected.dtype)
    criterion = Criterion.calibrated(floors, judged, name, e)
    result = scan(seg, a, e, criterion, False)
    if result.passed:
        return result

    def score(part: NDArray[np.float64], truth: NDArray[np.float64]) -> float:
        # the whole tensor's criterion: its floors as errors of the whole
        return criterion.score(part, truth)

    found = tensor_findings(name, array, np.asarray(expected), score)
    return dataclasses.replace(result, findings=found)


# -- validation ----------------------------------------------------------------------------


def _checked_buffer(
    which: str, given: object, layout: GdnBackwardLayout, func: str = "compare"
) -> NDArray[Any]:
    """``given`` read as a packed buffer of ``layout`` (:func:`as_packed`), checked."""
    buffer = as_packed(given, which, func)
    if not isinstance(buffer, np.ndarray):
        raise TypeError(f"{func}: {which} must be a NumPy array, got {type(buffer).__name__}")
    _check_plain_values(which, buffer, func)
    if not is_floating(buffer.dtype):
        raise TypeError(
            f"{func}: {which} must have a float dtype (float16, bfloat16, float32, float64), "
            f"got {buffer.dtype}"
        )
    if buffer.shape != (layout.total_elems,):
        fits = size_findings(buffer.size, layout) if buffer.ndim == 1 else ()
        raise ValueError(
            f"{func}: {which} must be 1-D with layout.total_elems = {layout.total_elems} "
            f"elements, got shape {buffer.shape}, for {layout!r}"
            + "".join(f"; {f.text}" for f in fits)
        )
    return np.asarray(buffer)


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

"""compare, assert_close, error_map and compare_tensor: where a call enters the comparison, its
inputs are checked, a criterion chosen per gradient, and each gradient scanned once."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Final, TypedDict, Unpack

import numpy as np
from numpy.typing import NDArray

from .._arrays import as_packed, device_of
from .._checks import not_a_layout
from .._dtypes import PRECISIONS, Precision, default_precision, is_floating
from ..layout import GdnBackwardLayout, Segment, layout_caption
from ..packing import unpack
from ._criterion import (
    DEFAULT_TOLERANCES,
    Criterion,
    Floors,
    Tolerance,
    checked_floors,
    floor_for,
    judged_precision,
    per_grad,
    step_scores,
)
from ._findings import Finding, buffer_findings, grad_findings, size_findings, tensor_findings
from ._misreadings import misreading_findings, overflow_finding
from ._records import Comparison, GradComparison, failure_message, read_from
from ._scan import cause_maps, scan

if TYPE_CHECKING:
    from ..files._fixture import Fixture

__all__ = ["Judging", "assert_close", "compare", "compare_tensor", "error_map"]


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
    expected: NDArray[Any] | Fixture,
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
        bits), ``"bfloat16"`` or ``"float16"``. Left out, the class of the less precise
        buffer's dtype. A class whose buffers are more precise than the buffers given is
        refused.
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
    from ..files._fixture import Fixture  # the files import the criterion

    if isinstance(expected, Fixture):
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
            return _compare(
                actual,
                expected.packed,
                expected.layout,
                rtol,
                atol,
                max_rms_ratio,
                equal_nan,
                precision,
                expected.floors,
                expected.scales,
                expected.inputs,
            )
    if layout is None:
        raise TypeError("compare: layout is required when expected is an array")
    return _compare(
        actual, expected, layout, rtol, atol, max_rms_ratio, equal_nan, precision, floors, scales
    )


def _compare(
    actual: NDArray[Any],
    expected: NDArray[Any],
    layout: GdnBackwardLayout,
    rtol: Tolerance | None,
    atol: Tolerance | None,
    max_rms_ratio: Tolerance | None,
    equal_nan: bool,
    precision: str | None,
    floors: Floors | None,
    scales: Tolerance | None,
    inputs: tuple[NDArray[Any] | None, ...] | None = None,
) -> Comparison:
    """:func:`compare` of two buffers; with the case's ``inputs``, the misreadings are
    tried where it fails."""
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "compare")
    device = device_of(actual)
    actual = as_packed(actual, "actual")
    expected = as_packed(expected, "expected")
    _check_buffer("actual", actual, layout)
    _check_buffer("expected", expected, layout)
    actual, expected = np.asarray(actual), np.asarray(expected)
    if not isinstance(equal_nan, (bool, np.bool_)):
        raise TypeError(f"compare: equal_nan must be a bool, got {type(equal_nan).__name__}")
    floors = None if floors is None else checked_floors(floors, "compare: floors")
    buffers = default_precision(actual.dtype, expected.dtype)
    default_rtol, default_atol = DEFAULT_TOLERANCES[buffers.buffer]
    rtols = per_grad("rtol", rtol)
    atols = per_grad("atol", atol)
    rms_limits = per_grad("max_rms_ratio", max_rms_ratio)
    tolerated = set(rtols) | set(atols) | set(rms_limits)
    judged = buffers  # a class is judged in, and checked, only where a gradient is calibrated
    if any(name not in tolerated for name in layout.names):
        judged = judged_precision(precision, "compare", actual.dtype, expected.dtype)
    term = per_grad("scales", scales)
    grads = []
    criteria: dict[str, Criterion] = {}
    score = _Score(criteria, floors, judged)  # each gradient's criterion, once it is made
    for seg in layout.segments():
        a = actual[seg.offset : seg.offset + seg.length]
        e = expected[seg.offset : seg.offset + seg.length]
        r, t, m = (d.get(seg.name) for d in (rtols, atols, rms_limits))
        if r is None and t is None and m is None:
            criterion = Criterion.calibrated(floors, judged, seg.name, e, term.get(seg.name))
        else:
            criterion = Criterion.tolerances(
                default_rtol if r is None else r,
                default_atol if t is None else t,
                m,
                elementwise=m is None or r is not None or t is not None,
            )
        criteria[seg.name] = criterion
        grad = scan(seg, a, e, criterion, bool(equal_nan))
        if not grad.passed:  # findings and cause maps cost nothing when everything passes
            found = grad_findings(
                seg.name,
                a.reshape(seg.shape),
                e.reshape(seg.shape),
                layout,
                score,
            )
            signed, ratio = cause_maps(seg, a, e)
            grad = dataclasses.replace(
                grad, findings=found, signed_error_map=signed, ratio_map=ratio
            )
        grads.append(grad)
    whole: tuple[Finding, ...] = ()
    if not all(g.passed for g in grads) and inputs is not None:
        failed = [g for g in grads if not g.passed]
        if len(failed) > 1 or not any(_explained(f) for f in failed[0].findings):
            whole = _misreadings(actual, expected, layout, inputs, criteria, floors, judged)
        if whole:  # it explains every gradient: the per-gradient guesses go
            grads = [dataclasses.replace(g, findings=()) for g in grads]
        mine = unpack(actual, layout)
        nonfinite = {
            g.name: getattr(mine, g.name)
            for g in grads
            if any(f.kind == "nonfinite" for f in g.findings)
        }
        overflow = overflow_finding(nonfinite, np.asarray(inputs[3]), actual.dtype)
        whole = whole if overflow is None else (overflow, *whole)
    if not whole and not all(g.passed for g in grads):
        whole = buffer_findings(actual, expected, layout, score)
    return Comparison(layout, tuple(grads), whole, device)


#: The kinds that may explain a gradient failing alone by its own values, moved, not written
#: or not finite: no reading is re-run for it.
_EXPLAINED: Final = frozenset(
    {"unwritten", "nonfinite", "axes", "transpose", "heads", "batch", "shift"}
)


def _explained(finding: Finding) -> bool:
    """Whether ``finding`` explains its gradient by the op's own values as they are. One that
    needs a fitted factor (a ``scale``, a shift scaled by 95 on a 3-step case) does not: a
    reading may scale one gradient alone (``dv`` without ``beta``), which a re-run shows."""
    return finding.kind in _EXPLAINED and finding.details.get("factor", 1.0) == 1.0


def _misreadings(
    actual: NDArray[Any],
    expected: NDArray[Any],
    layout: GdnBackwardLayout,
    inputs: tuple[NDArray[Any] | None, ...],
    criteria: dict[str, Criterion],
    floors: Floors | None,
    judged: Precision,
) -> tuple[Finding, ...]:
    """:func:`~gdn_layout.check._misreadings.misreading_findings` with each gradient's
    criterion, calibrated ones made again against each re-run's values."""

    def criterion(
        name: str,
        values: NDArray[np.float64],
        term: float | None,
        least: tuple[float, float] | None,
    ) -> Criterion:
        given = criteria[name]
        if given.mode != "calibrated":
            return given
        merged = floors
        if least is not None:  # the fixture's floors, or the reading's rounding if more
            source = PRECISIONS["float32"] if judged.name == "float64" else judged
            base = floor_for(floors, source, name)
            merged = {source.name: {name: (max(base[0], least[0]), max(base[1], least[1]))}}
        return Criterion.calibrated(merged, judged, name, values, term)

    mine, theirs = unpack(actual, layout), unpack(expected, layout)
    return misreading_findings(
        {n: getattr(mine, n) for n in layout.names},
        {n: getattr(theirs, n) for n in layout.names},
        inputs,
        layout,
        criterion,
    )


class _Score:
    """Each gradient's criterion as the findings' score (with the per-step scores of
    :data:`~gdn_layout.check._findings.Score`); a gradient of another layout is judged by the
    calibrated criterion."""

    def __init__(
        self, criteria: dict[str, Criterion], floors: Floors | None, judged: Precision
    ) -> None:
        self.criteria, self.floors, self.judged = criteria, floors, judged

    def __call__(
        self, name: str, actual: NDArray[np.float64], expected: NDArray[np.float64]
    ) -> float:
        criterion = self.criteria.get(name)
        if criterion is None:
            criterion = Criterion.calibrated(self.floors, self.judged, name, expected)
        return criterion.score(actual, expected)

    def steps(
        self, name: str, actual: NDArray[np.float64], expected: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        return step_scores(self.criteria[name], actual, expected)


def assert_close(
    actual: NDArray[Any],
    expected: NDArray[Any] | Fixture,
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
    actual = as_packed(actual, "actual", "error_map")
    expected = as_packed(expected, "expected", "error_map")
    _check_buffer("actual", actual, layout, "error_map")
    _check_buffer("expected", expected, layout, "error_map")
    actual, expected = np.asarray(actual), np.asarray(expected)
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
        fits = size_findings(buffer.size, layout) if buffer.ndim == 1 else ()
        raise ValueError(
            f"{func}: {which} must be 1-D with layout.total_elems = {layout.total_elems} "
            f"elements, got shape {buffer.shape}, for {layout!r}"
            + "".join(f"; {f.text}" for f in fits)
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

"""compare, assert_close, error_map and compare_tensor: a call's inputs checked, a criterion
chosen per gradient, and each gradient scanned once, a chunk at a time (docs/criterion.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, Protocol, TypedDict, TypeVar, Unpack, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from .. import _norms
from .._arrays import as_packed, device_of
from .._checks import not_a_layout
from .._dtypes import Precision, default_precision, is_floating, precision_of
from .._floors import Floors, checked_floors
from ..layout import GdnBackwardLayout, Segment, layout_caption
from ..packing import unpack
from ._criterion import DEFAULT_TOLERANCES, Criterion, Tolerance, judged_precision, per_grad
from ._explain import Evidence, explain
from ._findings import size_findings, tensor_findings
from ._records import Comparison, GradComparison, failure_message, read_from


@runtime_checkable
class Expected(Protocol):
    """What :func:`compare` reads of a fixture (:class:`~gdn_layout.Fixture` is one)."""

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
    """The keywords that choose how a kernel is judged, declared here once for every entry
    point (:func:`compare`, :func:`assert_close`, ``Case.compare``, ``Case.check``)."""

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
    floors: Floors | None = None,
    scales: Tolerance | None = None,
    **judging: Unpack[Judging],
) -> Comparison:
    """Compare the packed buffer ``actual`` with ``expected`` under ``layout``.

    ``expected`` is a fixture (bringing its layout, floors and term scales) or a 1-D float
    buffer of ``layout.total_elems`` elements, as ``actual`` is. ``rtol``, ``atol`` and
    ``max_rms_ratio`` (a float, or a mapping by gradient name) judge elementwise or by the
    RMS ratio; a gradient given none is judged by the calibrated criterion of ``precision``
    (default: the fixture's class, else the less precise buffer's), with ``floors`` and
    ``scales`` for an array ``expected``. ``equal_nan`` makes NaN against NaN match.
    docs/criterion.md defines each criterion.

    Raises
    ------
    TypeError
        A buffer, ``layout`` or tolerance has the wrong type or dtype, a buffer is a masked
        array or an ndarray subclass that changes its values, a keyword is unknown, or
        ``floors`` or ``scales`` is given with a fixture.
    ValueError
        A buffer has the wrong shape, a tolerance is negative, infinite or names an unknown
        gradient, ``layout`` is not the fixture's, or ``precision`` is unknown, finer than the
        buffers, or the kernel's output is coarser than its fixture's.

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
    unknown = sorted(set(judging) - set(Judging.__annotations__))
    if unknown:
        raise TypeError(f"compare() got an unexpected keyword argument {unknown[0]!r}")
    fixture_class, inputs = None, None
    unchanged: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
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
        layout, floors, scales = expected.layout, expected.floors, expected.scales
        inputs, unchanged = expected.inputs, expected.unchanged()
    elif layout is None:
        raise TypeError("compare: layout is required when expected is an array")
    elif floors is not None:
        floors = checked_floors(floors, "compare: floors")
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "compare")
    with unchanged:  # a fixture's buffer may not change while it is judged
        if isinstance(expected, Expected):
            expected = expected.packed
            fixture_class = precision_of(expected.dtype, "compare: the fixture's dtype")
        device = device_of(actual)
        mine = _checked_buffer("actual", actual, layout)
        theirs = _checked_buffer("expected", expected, layout)
        equal_nan = judging.get("equal_nan", False)
        if not isinstance(equal_nan, (bool, np.bool_)):
            raise TypeError(f"compare: equal_nan must be a bool, got {type(equal_nan).__name__}")
        buffers = default_precision(mine.dtype, theirs.dtype)
        default_rtol, default_atol = DEFAULT_TOLERANCES[buffers.buffer]
        given = [
            per_grad("rtol", judging.get("rtol")),
            per_grad("atol", judging.get("atol")),
            per_grad("max_rms_ratio", judging.get("max_rms_ratio")),
        ]
        judged = buffers  # a class is judged in, and checked, only where a gradient is calibrated
        if any(all(name not in d for d in given) for name in layout.names):
            judged = _judged_class(
                judging.get("precision"), fixture_class, mine.dtype, theirs.dtype
            )
        term = per_grad("scales", scales)
        records = []
        for seg in layout.segments():
            a = mine[seg.offset : seg.offset + seg.length]
            e = theirs[seg.offset : seg.offset + seg.length]
            r, t, m = (d.get(seg.name) for d in given)
            if r is None and t is None and m is None:
                criterion = Criterion.calibrated(floors, judged, seg.name, e, term.get(seg.name))
            else:
                criterion = Criterion.tolerances(
                    default_rtol if r is None else r,
                    default_atol if t is None else t,
                    m,
                    elementwise=m is None or r is not None or t is not None,
                )
            record = scan(seg, a, e, criterion, bool(equal_nan))
            if not record.passed:
                # A second pass, over a failing gradient only: the maps of its cause cost a
                # passing one nothing.
                signed, ratio = _cause_maps(seg, a, e)
                record = dataclasses.replace(record, signed_error_map=signed, ratio_map=ratio)
            records.append(record)
        if all(r.passed for r in records):
            return Comparison(layout, tuple(records), device=device)
        mine_grads, their_grads = unpack(mine, layout), unpack(theirs, layout)
        evidence = Evidence(
            layout, tuple(records), mine, theirs, mine_grads, their_grads, inputs, floors, judged
        )
        explained, whole = explain(evidence)
        return Comparison(layout, explained, whole, device)


def _judged_class(
    precision: str | None, fixture_class: Precision | None, *dtypes: np.dtype[Any]
) -> Precision:
    """``precision``, else the fixture's class, else the less precise buffer's. A kernel
    coarser than its fixture is refused unless ``precision`` names its class: a stray cast
    would otherwise pass as the coarser class."""
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
    """:func:`compare`, raising AssertionError naming each failing gradient and its worst
    element; returns the :class:`Comparison` when every gradient passes.

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
    """The largest ``|a - e|`` of one gradient over ``[S, H]`` (``dstate``: ``[N, H]``),
    read-only, ``inf`` at a non-finite mismatch, binned past 2**20 cells (docs/memory.md).
    Raises as :func:`compare`, and KeyError for a gradient the layout lacks.

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
    """One tensor besides the gradients (``y``, ``h``, ``dh``, ``final_state``) judged by
    the calibrated criterion of ``precision`` against ``floors`` (a fixture's
    :attr:`~gdn_layout.Fixture.state_floors`). Raises TypeError for an array that is not of a
    float dtype, ValueError for a shape that is not ``expected``'s."""
    array = np.asarray(as_packed(actual, "actual", func))
    if not is_floating(array.dtype):
        raise TypeError(f"{func}: {name} must have a float dtype, got {array.dtype}")
    _check_plain_values(name, array, func)
    if array.shape != expected.shape:
        raise ValueError(f"{func}: {name} must have shape {expected.shape}, got {array.shape}")
    seg = Segment(name, 0, expected.size, expected.shape)
    judged = judged_precision(precision, func, array.dtype, expected.dtype)
    e = np.asarray(expected).reshape(-1)
    criterion = Criterion.calibrated(floors, judged, name, e)
    result = scan(seg, array.reshape(-1), e, criterion, False)
    if result.passed:
        return result
    found = tensor_findings(name, array, np.asarray(expected), criterion.score)
    return dataclasses.replace(result, findings=found)


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


# -- the scan: one pass over a gradient ``[d0, d1, d2, *rest]`` in chunks of whole *lines*
# (the ``prod(rest)`` elements of one map cell ``(d0, d1, d2)``) or pieces of one long line.
# Past MAP_CELLS cells a map is binned along d1, d2 past MAP_COLUMNS, then d0 (docs/memory.md).

_Cell = TypeVar("_Cell", bound=np.generic)

#: The most cells of a per-batch error map: 8 MiB of float64.
MAP_CELLS: Final = 1 << 20
#: The most columns (the third axis) of a binned map, so that the rows keep a useful number.
MAP_COLUMNS: Final = 1 << 10


def _element_chunks(shape: tuple[int, ...], chunk: int | None = None) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` ranges covering ``shape`` in C order: whole lines, or pieces of one."""
    chunk = _norms.CHUNK_ELEMENTS if chunk is None else chunk
    size, line = math.prod(shape), math.prod(shape[3:])
    if size == 0:
        return
    if line <= chunk:
        step = line * (chunk // line)
        yield from ((start, min(start + step, size)) for start in range(0, size, step))
        return
    for begin in range(0, size, line):
        for start in range(begin, begin + line, chunk):
            yield start, min(start + chunk, begin + line)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _ErrorMap:
    """The largest error, and the count of elements out, per (binned) ``(d0, d1, d2)`` cell."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        batch, self.period, self.width = shape[0], shape[1], shape[2]
        self.line = math.prod(shape[3:])
        self.bins = (1, 1, 1)
        budget = MAP_CELLS // max(batch, 1)  # cells for each batch element
        if self.period * self.width > budget:
            col_bin = _ceil(self.width, MAP_COLUMNS) if self.width > MAP_COLUMNS else 1
            cols = _ceil(self.width, col_bin)
            if budget >= cols:
                self.bins = (1, _ceil(self.period, budget // cols), col_bin)
            else:  # even one row per batch element is too many: the batch binned too
                self.bins = (_ceil(batch, MAP_CELLS // cols), max(self.period, 1), col_bin)
        cells = (_ceil(batch, self.bins[0]), _ceil(self.period, self.bins[1]))
        self.cols = _ceil(self.width, self.bins[2])
        self.cells = np.zeros((*cells, self.cols))
        self.counts = np.zeros((*cells, self.cols), dtype=np.int64)

    def lines_of(self, start: int, size: int) -> tuple[NDArray[np.int64], int]:
        """The cell of each run of a chunk, and the run's length (a line, or the chunk)."""
        line = self.line if start % self.line == 0 and size % self.line == 0 else size
        index = np.arange(start // self.line, start // self.line + size // line, dtype=np.int64)
        rest, col = np.divmod(index, self.width)
        batch, row = np.divmod(rest, self.period)
        block = batch // self.bins[0] * self.cells.shape[1] + row // self.bins[1]
        return block * self.cols + col // self.bins[2], line

    def update(self, start: int, errors: NDArray[np.float64], out: NDArray[np.bool_]) -> None:
        cells, line = self.lines_of(start, errors.size)
        np.maximum.at(self.cells.reshape(-1), cells, errors.reshape(-1, line).max(axis=1))
        np.add.at(self.counts.reshape(-1), cells, out.reshape(-1, line).sum(axis=1))


def scan(
    seg: Segment,
    actual: NDArray[Any],
    expected: NDArray[Any],
    criterion: Criterion,
    equal_nan: bool,
) -> GradComparison:
    """One gradient's figures, error maps and verdict under ``criterion``, in one pass."""
    shape, elementwise = seg.shape, criterion.counts_elements
    emap = _ErrorMap(shape)  # over (b, s, h), or (b, h, i) for dstate, turned to (b, i, h)
    nan_a = inf_a = nan_e = inf_e = mismatches = bad_count = bad_nan = 0
    max_abs = max_rel = 0.0
    norm_diff, norm_exp = _norms.Norm(), _norms.Norm()
    best, worst_index, worst_a, worst_e = -math.inf, None, 0.0, 0.0
    for start, stop in _element_chunks(shape):
        a = actual[start:stop].astype(np.float64)
        e = expected[start:stop].astype(np.float64)
        a_nan, e_nan, a_inf, e_inf = np.isnan(a), np.isnan(e), np.isinf(a), np.isinf(e)
        nan_a, nan_e = nan_a + int(a_nan.sum()), nan_e + int(e_nan.sum())
        inf_a, inf_e = inf_a + int(a_inf.sum()), inf_e + int(e_inf.sum())
        finite = ~(a_nan | e_nan | a_inf | e_inf)
        abs_e = np.where(finite, np.abs(e), 0.0)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(finite, np.abs(a - e), 0.0)
        bad = ~finite & (a != e) & ~(equal_nan & a_nan & e_nan)  # the non-finite mismatches
        bad_count += int(bad.sum())
        bad_nan += int((bad & (a_nan | e_nan)).sum())
        allowed = criterion.allowances(abs_e)
        counted = ((diff > allowed) | bad) if elementwise else bad  # what the criterion counts
        mismatches += int(counted.sum())
        if finite.any():
            max_abs = max(max_abs, float(diff.max()))
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                rel = np.where(diff == 0, 0.0, diff / abs_e)
            norm_diff.add(diff)
            max_rel = max(max_rel, float(rel.max()))
            norm_exp.add(abs_e)
        score = diff - allowed if elementwise else diff.copy()
        score[~finite] = -math.inf  # matching non-finite pairs are never the worst
        score[bad] = math.inf
        local = int(np.argmax(score))
        if worst_index is None or score[local] > best:
            best, worst_index = float(score[local]), start + local
            worst_a, worst_e = float(a[local]), float(e[local])
        emap.update(start, np.where(bad, np.inf, diff), counted)
    rms_ratio = norm_diff.over(norm_exp)
    if bad_count:  # the error of a non-finite mismatch is NaN (or Inf), whatever the rest is
        max_abs = max_rel = rms_ratio = math.nan if bad_nan else math.inf
    worst = None if worst_index is None else tuple(map(int, np.unravel_index(worst_index, shape)))
    batch_cells, counts, bins = emap.cells, emap.counts, emap.bins
    transpose = seg.axes[1] == "h"
    if transpose:  # [B, H, N] to [B, N, H]
        batch_cells = np.ascontiguousarray(batch_cells.transpose(0, 2, 1))
        counts = np.ascontiguousarray(counts.transpose(0, 2, 1))
    return GradComparison(
        name=seg.name,
        shape=shape,
        actual_dtype=actual.dtype.name,
        expected_dtype=expected.dtype.name,
        size=seg.length,
        criterion=criterion,
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
        error_map=_read_only(batch_cells.max(axis=0, initial=0.0)),
        batch_error_map=_read_only(batch_cells),
        mismatch_map=_read_only(counts),
        error_map_bins=(bins[2], bins[1]) if transpose else (bins[1], bins[2]),
        batch_bins=bins[0],
    )


def _cause_maps(
    seg: Segment, actual: NDArray[Any], expected: NDArray[Any]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """A failing gradient's signed error (the ``a - e`` of largest magnitude, NaN for a
    non-finite mismatch) and ratio (``<a, e> / <e, e>`` of the finite pairs) per cell of
    its batch error map; ``dstate``'s over ``[H, N, N]``, so that a transpose is mirrored."""
    chunk = _norms.CHUNK_ELEMENTS
    if seg.name != "dstate":
        geometry = _ErrorMap(seg.shape)
        shape, cells_of = geometry.cells.shape, geometry.lines_of
    else:
        heads, n = seg.shape[1], seg.shape[2]
        fold = max(1, math.ceil(math.sqrt(heads * n * n / MAP_CELLS)))
        side = _ceil(n, fold)
        shape, chunk = (heads, side, side), max(chunk // 8, 1)  # a dozen arrays of a chunk

        def cells_of(start: int, size: int) -> tuple[NDArray[np.int64], int]:
            index = np.arange(start, start + size, dtype=np.int64) % (heads * n * n)
            head, rest = np.divmod(index, n * n)
            row, col = np.divmod(rest, n)
            return (head * side + row // fold) * side + col // fold, 1

    peak, signed, dot, norm = np.full(shape, -1.0), *(np.zeros(shape) for _ in range(3))
    for start, stop in _element_chunks(seg.shape, chunk):
        cells, line = cells_of(start, stop - start)
        a, e = actual[start:stop].astype(np.float64), expected[start:stop].astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(a == e, 0.0, a - e)  # equal infinities match
            finite, both = np.isfinite(diff), np.isfinite(a) & np.isfinite(e)
            size = np.where(finite, np.abs(diff), np.inf).reshape(-1, line)
            at = size.argmax(axis=1)
            rows = np.arange(at.size)
            peaks = size[rows, at]
            worst = np.where(finite, diff, np.nan).reshape(-1, line)[rows, at]
            dots = np.where(both, a * e, 0.0).reshape(-1, line).sum(axis=1)
            norms = np.where(both, e * e, 0.0).reshape(-1, line).sum(axis=1)
        np.maximum.at(peak.reshape(-1), cells, peaks)
        won = peaks >= peak.reshape(-1)[cells]  # the run holding its cell's largest error so far
        signed.reshape(-1)[cells[won]] = worst[won]
        np.add.at(dot.reshape(-1), cells, dots)
        np.add.at(norm.reshape(-1), cells, norms)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(norm > 0, dot / norm, np.nan)
    return _read_only(signed), _read_only(ratio)


def _read_only(cells: NDArray[_Cell]) -> NDArray[_Cell]:
    cells.flags.writeable = False
    return cells

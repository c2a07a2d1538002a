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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
from numpy.typing import NDArray

from ._dtypes import is_floating
from ._render import CHUNK_ELEMENTS, fmt_float, html_table, layout_caption, text_table
from .layout import GRADIENT_NAMES, GdnBackwardLayout, _not_a_layout

if TYPE_CHECKING:
    from ._picture import Picture

__all__ = ["Comparison", "GradComparison", "assert_close", "compare", "error_map"]

Number = float | np.floating[Any] | np.integer[Any]
#: A tolerance for every gradient, or a mapping from gradient name to its tolerance.
Tolerance = Number | Mapping[str, Number]


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

#: The axes each gradient's coordinates are given in.
AXES = {
    "dq": ("b", "s", "h", "n"),
    "dk": ("b", "s", "h", "n"),
    "dv": ("b", "s", "h", "n"),
    "dg": ("b", "s", "h"),  # ("b", "s", "h", "n") when the gate is per channel
    "dbeta": ("b", "s", "h"),
    "dstate": ("b", "h", "i", "j"),
}


@dataclass(frozen=True)
class GradComparison:
    """How one gradient of an actual buffer compares with the expected one.

    Attributes:
        name: ``"dq"``, ..., ``"dstate"``.
        shape: the gradient's shape.
        actual_dtype, expected_dtype: the two buffers' dtype names.
        size: number of elements.
        rtol, atol: the elementwise tolerances used for ``mismatches``.
        max_rms_ratio: the RMS criterion, or None when the gradient is judged elementwise.
        max_abs_error: max ``|a - e|`` over pairs that are both finite (0.0 when none).
        max_rel_error: max ``|a - e| / |e|`` over those pairs; ``inf`` when some ``e == 0``
            has ``a != 0``.
        rms_ratio: ``rms(a - e) / rms(e)`` over those pairs; 0.0 when both are zero, ``inf``
            when only the reference is.
        mismatches: elements out of elementwise tolerance, non-finite mismatches included.
        nonfinite_mismatches: pairs with a non-finite side that do not match (see the module).
        nan_actual, inf_actual, nan_expected, inf_expected: NaN/Inf counts on each side.
        worst: coordinates (in :data:`AXES` order) of the element furthest out of tolerance
            (elementwise: largest ``|a - e| - (atol + rtol * |e|)``; RMS: largest ``|a - e|``);
            a non-finite mismatch outranks any finite error, and ties go to the first element
            in C order. None for an empty gradient.
        worst_actual, worst_expected: the two values there.
        passed: whether the gradient meets its criterion.
        error_map: read-only float64 map of the largest ``|a - e|`` (``inf`` for a non-finite
            mismatch, 0 for a matching non-finite pair): ``[S, H]`` over (sequence position,
            head) for every gradient but ``dstate``, whose map is ``[N, H]`` over (key row
            ``i``, head) because it has no sequence axis. Not part of equality or ``to_dict``.
        batch_error_map: the error map of each batch element, ``[B, S, H]`` (``[B, N, H]``
            for ``dstate``); ``error_map`` is its maximum over the batch. For plots; not part
            of equality or ``to_dict``.
        mismatch_map: how many elements of each cell of ``batch_error_map`` are out of
            elementwise tolerance (non-finite mismatches included), int32. For plots; not
            part of equality or ``to_dict``.
    """

    name: str
    shape: tuple[int, ...]
    actual_dtype: str
    expected_dtype: str
    size: int
    rtol: float
    atol: float
    max_rms_ratio: float | None
    max_abs_error: float
    max_rel_error: float
    rms_ratio: float
    mismatches: int
    nonfinite_mismatches: int
    nan_actual: int
    inf_actual: int
    nan_expected: int
    inf_expected: int
    worst: tuple[int, ...] | None
    worst_actual: float | None
    worst_expected: float | None
    passed: bool
    error_map: NDArray[np.float64] = field(compare=False, repr=False)
    batch_error_map: NDArray[np.float64] = field(compare=False, repr=False)
    mismatch_map: NDArray[np.int32] = field(compare=False, repr=False)

    @property
    def mode(self) -> Literal["elementwise", "rms"]:
        """How ``passed`` was judged: ``"rms"`` when ``max_rms_ratio`` is set."""
        return "elementwise" if self.max_rms_ratio is None else "rms"

    @property
    def axes(self) -> tuple[str, ...]:
        """The names of the axes ``worst`` indexes, e.g. ``("b", "s", "h", "n")``."""
        names = AXES[self.name]
        return ("b", "s", "h", "n") if len(self.shape) == 4 and self.name == "dg" else names

    @property
    def criterion(self) -> str:
        """The pass criterion in words, e.g. ``"rtol=1e-05 atol=1e-08"``."""
        if self.max_rms_ratio is not None:
            return f"rms ratio<={self.max_rms_ratio:.3g}"
        return f"rtol={self.rtol:.3g} atol={self.atol:.3g}"

    @property
    def exact(self) -> bool:
        """Every element equal, or both non-finite in the same way: no element is "worst"."""
        return self.max_abs_error == 0 and self.nonfinite_mismatches == 0

    def where(self) -> str:
        """The worst element as an index expression, e.g. ``"dk[0, 17, 3, 5]"``."""
        if self.worst is None:
            return f"{self.name}[]"
        return f"{self.name}[{', '.join(map(str, self.worst))}]"

    def summary(self) -> str:
        """One line: the worst element, its values and why the gradient passes or fails."""
        if self.worst is None:
            return f"{self.name}: empty"
        a, e = self.worst_actual, self.worst_expected
        head = f"{self.where()}: actual {_value(a)} expected {_value(e)}"
        facts = []
        if self.max_rms_ratio is None:
            assert e is not None
            allowed = self.atol + self.rtol * abs(e) if math.isfinite(e) else 0.0
            facts.append(
                f"{self.mismatches} of {self.size} out of tolerance "
                f"(|a-e| <= {self.atol:.3g} + {self.rtol:.3g}*|e|; here {allowed:.3g})"
            )
        else:
            verb = "<=" if self.rms_ratio <= self.max_rms_ratio else ">"
            facts.append(f"rms ratio {self.rms_ratio:.3g} {verb} {self.max_rms_ratio:.3g}")
        if self.nonfinite_mismatches:
            n = self.nonfinite_mismatches
            facts.append(f"{n} non-finite mismatch{'' if n == 1 else 'es'}")
        if self.nan_actual or self.nan_expected or self.inf_actual or self.inf_expected:
            facts.append(
                f"nan {self.nan_actual}/{self.nan_expected}, "
                f"inf {self.inf_actual}/{self.inf_expected} (actual/expected)"
            )
        facts.append(
            f"max abs {self.max_abs_error:.3g}, max rel {self.max_rel_error:.3g}, "
            f"rms ratio {self.rms_ratio:.3g}"
        )
        return f"{head}; " + "; ".join(facts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields (no error map); a non-finite float becomes ``"inf"``/``"nan"``."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "axes": list(self.axes),
            "actual_dtype": self.actual_dtype,
            "expected_dtype": self.expected_dtype,
            "size": self.size,
            "mode": self.mode,
            "rtol": _json_float(self.rtol),
            "atol": _json_float(self.atol),
            "max_rms_ratio": _json_float(self.max_rms_ratio),
            "max_abs_error": _json_float(self.max_abs_error),
            "max_rel_error": _json_float(self.max_rel_error),
            "rms_ratio": _json_float(self.rms_ratio),
            "mismatches": self.mismatches,
            "nonfinite_mismatches": self.nonfinite_mismatches,
            "nan_actual": self.nan_actual,
            "inf_actual": self.inf_actual,
            "nan_expected": self.nan_expected,
            "inf_expected": self.inf_expected,
            "worst": None if self.worst is None else list(self.worst),
            "worst_actual": _json_float(self.worst_actual),
            "worst_expected": _json_float(self.worst_expected),
            "passed": self.passed,
        }


@dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare`: one :class:`GradComparison` per gradient, in order.

    ``str(comparison)`` is a fixed-width table, ``comparison._repr_html_()`` an HTML one and
    ``comparison.to_dict()`` a JSON-safe dict. Index by name: ``comparison["dk"]``.
    """

    layout: GdnBackwardLayout
    grads: tuple[GradComparison, ...]

    @property
    def passed(self) -> bool:
        """Whether every gradient passed."""
        return all(g.passed for g in self.grads)

    @property
    def failed(self) -> tuple[str, ...]:
        """The names of the gradients that failed, in packing order."""
        return tuple(g.name for g in self.grads if not g.passed)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.grads)

    def __getitem__(self, name: str) -> GradComparison:
        for grad in self.grads:
            if grad.name == name:
                return grad
        raise KeyError(f"no gradient {name!r} in this comparison; it has {', '.join(self.names)}")

    def error_map(self, name: str) -> NDArray[np.float64]:
        """The :attr:`GradComparison.error_map` of the gradient called ``name``."""
        return self[name].error_map

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (``json.dumps(..., allow_nan=False)`` accepts it)."""
        return {
            "passed": self.passed,
            "failed": list(self.failed),
            "layout": self.layout.to_dict(),
            "grads": [g.to_dict() for g in self.grads],
        }

    def _title(self) -> str:
        verdict = "passed" if self.passed else f"FAILED ({', '.join(self.failed)})"
        return f"compare {verdict}: {layout_caption(self.layout)}"

    def _cells(self) -> list[list[str]]:
        return [
            [
                g.name,
                str(g.shape),
                f"{g.actual_dtype}/{g.expected_dtype}",
                fmt_float(g.max_abs_error),
                fmt_float(g.max_rel_error),
                fmt_float(g.rms_ratio),
                f"{g.mismatches}/{g.size}",
                f"{g.nan_actual}/{g.nan_expected}",
                f"{g.inf_actual}/{g.inf_expected}",
                "-" if g.exact or g.worst is None else str(list(g.worst)),
                g.criterion,
                "ok" if g.passed else "FAIL",
            ]
            for g in self.grads
        ]

    def __str__(self) -> str:
        return f"{self._title()}\n{text_table(_HEADERS, self._cells(), align=_ALIGN)}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return html_table(
            _HEADERS,
            self._cells(),
            align=_ALIGN,
            caption=self._title(),
            row_styles=["" if g.passed else "background:#fdd" for g in self.grads],
        )

    def plot(self, **options: Any) -> Picture:
        """:func:`gdn_layout.plot.plot_errors` of this comparison, with the same options.

        Needs ``gdn-layout[plot]``; a notebook displays the returned picture.
        """
        from .plot import plot_errors  # deferred: plot builds on this module

        return plot_errors(self, **options)


_HEADERS = [
    "grad",
    "shape",
    "dtypes",
    "max abs",
    "max rel",
    "rms ratio",
    "out/size",
    "nan a/e",
    "inf a/e",
    "worst",
    "criterion",
    "result",
]
_ALIGN = "lllrrrrrrlll"


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
        raise _not_a_layout(layout, "compare")
    _check_buffer("actual", actual, layout)
    _check_buffer("expected", expected, layout)
    if not isinstance(equal_nan, (bool, np.bool_)):
        raise TypeError(f"compare: equal_nan must be a bool, got {type(equal_nan).__name__}")
    default_rtol, default_atol = _default_tolerances(actual.dtype, expected.dtype)
    rtols = _per_grad("rtol", rtol)
    atols = _per_grad("atol", atol)
    rms_limits = _per_grad("max_rms_ratio", max_rms_ratio)
    grads = tuple(
        _compare_grad(
            seg.name,
            seg.shape,
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
    ``i``, head); a non-finite mismatch is ``inf``, a matching non-finite pair 0.

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
        raise _not_a_layout(layout, "error_map")
    _check_buffer("actual", actual, layout, "error_map")
    _check_buffer("expected", expected, layout, "error_map")
    seg = layout.segment(name)
    span = slice(seg.offset, seg.offset + seg.length)
    return _compare_grad(
        seg.name, seg.shape, actual[span], expected[span], 0.0, 0.0, None, False
    ).error_map


# -- validation ----------------------------------------------------------------------------


def _check_buffer(
    which: str, buffer: object, layout: GdnBackwardLayout, func: str = "compare"
) -> None:
    if not isinstance(buffer, np.ndarray):
        raise TypeError(f"{func}: {which} must be a NumPy array, got {type(buffer).__name__}")
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
    name: str,
    shape: tuple[int, ...],
    actual: NDArray[Any],
    expected: NDArray[Any],
    rtol: float,
    atol: float,
    max_rms_ratio: float | None,
    equal_nan: bool,
) -> GradComparison:
    # Work on [rows, cols] with rows over the first two axes ((b, s), or (b, h) for dstate),
    # so that chunks are whole rows and each row lands in one line of the error map.
    rows = shape[0] * shape[1]
    cols = math.prod(shape[2:])
    a2 = actual.reshape(rows, cols)
    e2 = expected.reshape(rows, cols)
    is_state = name == "dstate"
    # dstate [B, H, N, N] maps to [H, N] (transposed at the end), the others to [S, H].
    period = shape[1]
    width = shape[2]
    accum = np.zeros((period, width), dtype=np.float64)
    # The same maps per batch element, unfolded: row r of [rows, width] is (b, s) = divmod(r, S).
    cell_error = np.zeros((rows, width), dtype=np.float64)
    cell_out = np.zeros((rows, width), dtype=np.int32)

    nan_a = inf_a = nan_e = inf_e = mismatches = bad_count = 0
    max_abs = max_rel = 0.0
    norm_diff, norm_exp = _Norm(), _Norm()
    best = -math.inf
    worst_index: int | None = None
    worst_a = worst_e = 0.0
    elementwise = max_rms_ratio is None
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))

    for start in range(0, rows if rows * cols else 0, step):
        a = a2[start : start + step].astype(np.float64)
        e = e2[start : start + step].astype(np.float64)
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
            max_rel = max(max_rel, float(rel.max()))
            norm_diff.add(diff)
            norm_exp.add(abs_e)
        score = diff - allowed if elementwise else diff.copy()
        score[~finite] = -math.inf  # matching non-finite pairs are never the worst
        score[bad] = math.inf
        local = int(np.argmax(score))
        if worst_index is None or score.flat[local] > best:
            best = float(score.flat[local])
            worst_index = start * cols + local
            worst_a, worst_e = float(a.flat[local]), float(e.flat[local])
        # Reduce each row to its line of the map, then fold rows onto it by s (or h).
        line = diff_map.reshape(diff_map.shape[0], width, -1).max(axis=2)
        np.maximum.at(accum, np.arange(start, start + line.shape[0]) % period, line)
        cell_error[start : start + line.shape[0]] = line
        cell_out[start : start + line.shape[0]] = out.reshape(line.shape[0], width, -1).sum(axis=2)

    rms_ratio = _rms_ratio(norm_diff.value(), norm_exp.value())
    if elementwise:
        passed = mismatches == 0
    else:
        assert max_rms_ratio is not None
        passed = bad_count == 0 and rms_ratio <= max_rms_ratio
    worst = (
        None if worst_index is None else tuple(int(i) for i in np.unravel_index(worst_index, shape))
    )
    emap = accum.T.copy() if is_state else accum
    emap.flags.writeable = False
    return GradComparison(
        name=name,
        shape=shape,
        actual_dtype=actual.dtype.name,
        expected_dtype=expected.dtype.name,
        size=rows * cols,
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
        error_map=emap,
        batch_error_map=_per_batch(cell_error, shape, is_state),
        mismatch_map=_per_batch(cell_out, shape, is_state),
    )


_Cells = TypeVar("_Cells", bound=np.generic)


def _per_batch(cells: NDArray[_Cells], shape: tuple[int, ...], is_state: bool) -> NDArray[_Cells]:
    """``[B * S, H]`` cells as a read-only ``[B, S, H]`` map (``[B, H, N]`` to ``[B, N, H]``)."""
    split = cells.reshape(shape[0], shape[1], cells.shape[1])
    result = np.ascontiguousarray(split.transpose(0, 2, 1)) if is_state else split
    result.flags.writeable = False
    return result


class _Norm:
    """A Euclidean norm accumulated chunk by chunk, scaled as LAPACK's ``nrm2`` is, so that
    squaring neither overflows for huge values nor underflows for tiny ones."""

    def __init__(self) -> None:
        self.scale = 0.0
        self.sumsq = 1.0

    def add(self, x: NDArray[np.float64]) -> None:
        peak = float(x.max(initial=0.0))
        if peak == 0.0 or not math.isfinite(peak):
            self.scale = max(self.scale, peak)
            return
        scaled = x / peak
        chunk = float(np.vdot(scaled, scaled))
        if peak > self.scale:
            self.sumsq = chunk + self.sumsq * (self.scale / peak) ** 2
            self.scale = peak
        else:
            self.sumsq += chunk * (peak / self.scale) ** 2

    def value(self) -> float:
        return self.scale * math.sqrt(self.sumsq) if math.isfinite(self.scale) else math.inf


def _rms_ratio(norm_diff: float, norm_exp: float) -> float:
    # Both norms are over the same elements, so their ratio is the ratio of the RMS values.
    # A zero reference leaves no scale: any error at all is infinitely large against it.
    if norm_exp > 0:
        return norm_diff / norm_exp
    return 0.0 if norm_diff == 0 else math.inf


def _value(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _json_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return str(x)  # "inf", "-inf" or "nan": strict JSON has no non-finite numbers

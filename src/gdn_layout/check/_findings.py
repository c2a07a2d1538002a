"""Findings: simple hypotheses that name what is wrong with a failing gradient.

docs/findings.md says what each kind means to a user; this states each rule. Each hypothesis
undoes one kind of bug and asks the caller's criterion whether that explains the error.

**The rule.** ``score(name, actual, expected)`` is the error over the criterion's limit, at most
1 to pass. A hypothesis *holds* when, after undoing it, the score is at most 1 or has fallen by
at least :data:`FALLS` (100x) from the score before; and in every case it must have fallen by
at least :data:`GAIN` (4x), so that a gradient failing by a hair is not "explained" by a fit
that wins a few percent. A fall counts only when the undone actual ``u`` is along the expected
``e`` (``cos^2(u, e) >= 0.99``): dividing unrelated values by their size makes their score fall
too. A hypothesis that undoes a permutation, a shift or an axis order also tries a fitted
constant factor on top (``c = <u, e> / <e, e>``), so that a head swap of a gradient with a
wrong scale is still named, with its factor. An undone actual far from ``e`` times any factor
(``cos^2 < 0.5``, looked at first on 4096 evenly spaced elements) is refused unscored.

The hypotheses tried on a failing gradient, and on a failing ``y``, ``h``, ``dh`` or
``final_state`` (:func:`tensor_findings`), are one table, :data:`HYPOTHESES`: each entry a
kind, its test and the tensors it reads, so that adding one is one entry and its test.

The kinds (:data:`KINDS`, in the order findings are returned: most specific first):

``misreading``, ``overflow``, ``rows``
    With a fixture's inputs (:mod:`~gdn_layout.check._misreadings`,
    :mod:`~gdn_layout.check._explain`): docs/findings.md.
``unwritten``
    every element is zero (where the expected values do not all round to zero in the actual's
    dtype), or one finite constant, or looks like memory never written: at least 1%
    of the values below ``1e-30`` where the expected ones are not, and the magnitudes spread
    over more than 16 binades (a standard deviation of ``log2|x|``), as stale pointers (their
    high halves read as subnormals) and freed data of another type read by ``np.empty`` are.
    Not detected for float16, whose range has no such values. Or some batch rows are all
    zeros where the op's are not, and others are not (for ``dstate``: a kernel running the
    rows as one sequence has one initial state).
``nonfinite``
    NaN or Inf where the expected value is finite: the count, the first coordinates (in step
    order) and whether every step from one on, or up to one, has some (the backward sweep
    carries a NaN to earlier steps).
``layout``
    (:func:`buffer_findings`) a gradient is found at another offset of the packed buffer:
    where the other gate mode's layout puts it, or where another order of the segments does.
    :func:`size_findings` names the layouts of the same ``B, S, H, N`` a wrong length fits.
``axes``
    the gradient holds the expected values written in another axis order (``[B, H, S, N]``
    for ``[B, S, H, N]``...): the buffer reshaped to that order and transposed back explains it.
``transpose``
    the last two axes are exchanged, for a square trailing pair (``dstate``'s key and value
    axes; ``[H, N]`` too when ``H == N``).
``heads``, ``batch``
    a permutation of that axis explains it: read off the matrix of ``1 - cos^2`` between
    every actual and every expected head (``O(H * size)``).
``shift``
    ``actual[:, t] == expected[:, t - k]`` for ``k`` in ``+1, -1, +2, -2``, scored on the
    steps both have.
``scale``
    ``actual = c * expected``, ``c`` the least-squares ``<a, e> / <e, e>``, further from 1
    than 10 standard errors of the fit and than ``1e-3`` and 4 unit roundoffs of the actual's
    dtype (which one dominant element's rounding reaches); named when it is -1, 2, 1/2,
    sqrt(N), 1/sqrt(N), N or 1/N (within 1%). The factor fitted on top of another hypothesis
    obeys the same bounds.
``boundary``
    from per-step scores along ``s``: the steps before ``t0`` pass and at least 90% of those
    from ``t0`` on fail (or the reverse; an error from the first step that falls by less than
    :data:`FALLS` at ``t0`` fades, as an initial state's does, and names no step), or the
    failing steps all lie within one step of the multiples of a period ``P >= 4`` and cover at
    least 3/4 of at least two of them, or they fill at least 3/4 of one run of 3 or more steps
    (24 elements or more), at most half the sequence, with right steps on both sides (a state
    not carried across a step: its error fades with the decay on either side; the step is named
    when the error starts or stops by :data:`FALLS` from one step to the next). Each way the
    wrong part must score above :data:`ROUNDING_MAX` (past rounding's reach: a chunked float32
    form's own error steps up at a chunk boundary too) and at least :data:`FALLS` times the
    right part, and the right part must pass, with at least 8 elements and some non-zero
    expected value in it.
``rounding``
    no structural hypothesis holds and the score is at most :data:`ROUNDING_MAX`: the error is
    only too large, as rounding is. Above that, an unexplained gradient gets no finding.

A passing gradient gets no finding. Every structural hypothesis but ``boundary`` needs
:data:`_IDENTIFIED` (16) non-zero expected elements (docs/findings.md, *No structure from
too little data*).

**Cost and memory.** :func:`grad_findings` first scans the gradient in blocks for
``unwritten`` and ``nonfinite``; if either holds, or the expected values are not all finite,
nothing else is tried. The others run in float64 on at most :data:`MAX_WHOLE_ELEMENTS`
elements (the first batch elements, or steps, that fit: ``batch`` and axis orders moving
``b`` are then skipped), each a few passes over that region; the score is called a few times,
and per step once through its ``steps`` (:data:`Score`). Once one hypothesis explains the
gradient fully, the later ones are not tried.

>>> import numpy as np
>>> from gdn_layout import GdnBackwardLayout
>>> layout = GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=16)
>>> def score(name, actual, expected):
...     scale = max(float(np.sqrt(np.mean(expected**2))), 1e-30)
...     return float(np.sqrt(np.mean((actual - expected) ** 2))) / scale / 1e-3
>>> expected = np.random.default_rng(0).standard_normal((1, 4, 2, 16))
>>> [f.text for f in grad_findings("dq", 4 * expected, expected, layout, score)]
['dq is 4.000 x expected (a missing 1/sqrt(N) = 1/4?)']
>>> grad_findings("dq", expected[:, :, ::-1], expected, layout, score)[0].details["pairs"]
((0, 1),)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple, TypeVar

import numpy as np
from numpy.typing import NDArray

from .._checks import not_a_layout
from .._dtypes import UNIT_ROUNDOFF
from ..layout import GdnBackwardLayout, Segment, gradient_axes

__all__ = [
    "FALLS",
    "GAIN",
    "HYPOTHESES",
    "KINDS",
    "MAX_WHOLE_ELEMENTS",
    "ROUNDING_MAX",
    "Finding",
    "Hypothesis",
    "Score",
    "buffer_findings",
    "grad_findings",
    "size_findings",
    "tensor_findings",
]

#: Every kind of finding, most specific first: the order findings are returned in.
KINDS: Final = (
    "misreading",
    "overflow",
    "unwritten",
    "nonfinite",
    "layout",
    "rows",
    "axes",
    "transpose",
    "heads",
    "batch",
    "shift",
    "scale",
    "boundary",
    "rounding",
)
#: The most elements of a gradient the hypotheses hold in float64 at once.
MAX_WHOLE_ELEMENTS: Final = 1 << 21
#: An undone hypothesis holds when its score is at most 1 or fell by this factor.
FALLS: Final = 100.0
#: ... and in either case fell by at least this factor.
GAIN: Final = 4.0
#: The largest score called ``rounding`` when nothing structural holds.
ROUNDING_MAX: Final = 10.0

#: ``score(gradient_name, actual, expected)``: the error over the criterion's limit for two
#: float64 arrays of one shape (a whole gradient or a region of it); at most 1 passes. A score
#: with a method ``steps(gradient_name, actual, expected)`` gives the scores of every step
#: (index along axis 1) at once, as an array: the findings use it for their per-step scores,
#: instead of calling the score once per step.
Score = Callable[[str, NDArray[np.float64], NDArray[np.float64]], float]

_Array = NDArray[np.float64]
_SHIFTS: Final = (1, -1, 2, -2)
_TINY: Final = 1e-30  # below every real gradient's value, above float32's least normal
_HUGE: Final = 1e30
_GARBAGE_BINADES: Final = 16.0
_ALIGNED: Final = 0.99  # cos^2 of a fall that counts: within 10% RMS of e times a factor
_SIMILAR: Final = 0.5  # cos^2 below which an undone actual is not even scored
_SCAN_ELEMENTS: Final = 1 << 16  # elements of a block of the unwritten and nonfinite scan
_PREVIEW: Final = 4096  # elements compared before a candidate offset is scored in full
_WINDOW_ELEMENTS: Final = 24  # the least a run of wrong steps holds, both sides right
_RIGHT_ELEMENTS: Final = 8  # the least a boundary's right side holds: fewer pass by chance
_IDENTIFIED: Final = 16  # the least non-zero elements a factor is fitted to
_FIT_ERRORS: Final = 10.0
#: The least ``|c - 1|`` of a scale, unless 4 unit roundoffs of the actual's dtype are more:
#: a factor that close to 1 can be one element's rounding.
_LEAST_FACTOR: Final = 1e-3
_SHOWN: Final = 5  # coordinates, steps or moves a text or a detail lists


@dataclasses.dataclass(frozen=True)
class Finding:
    """One hypothesis that holds.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    gradient : str or None
        The gradient's name, or None for the packed buffer as a whole.
    text : str
        One line for a person, with the numbers.
    details : Mapping
        The kind's fields (``factor``, ``permutation``, ``pairs``, ``step``, ``period``,
        ``offsets``, ``count``, ``first``, ``order``...), read-only: ints, floats, strings,
        None (for a number that is not finite too), tuples and mappings of them.

    See Also
    --------
    GradComparison : A gradient's findings.
    Comparison : The findings of a whole buffer.

    Examples
    --------
    >>> f = Finding("scale", "dq", "dq is -1.000 x expected (a sign flip?)", {"factor": -1.0})
    >>> f.to_dict()["details"]
    {'factor': -1.0}
    """

    kind: str
    gradient: str | None
    text: str
    details: Mapping[str, object] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Finding: kind must be one of {KINDS}, got {self.kind!r}")
        frozen = {str(key): _frozen(value) for key, value in dict(self.details).items()}
        object.__setattr__(self, "details", types.MappingProxyType(frozen))

    def to_dict(self) -> dict[str, object]:
        """The finding as plain JSON-ready values: tuples become lists, mappings dicts."""
        return {
            "kind": self.kind,
            "gradient": self.gradient,
            "text": self.text,
            "details": _plain(self.details),
        }


def _frozen(value: object) -> object:
    """A detail as an immutable plain value: NumPy scalars as Python's, sequences as tuples."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({str(k): _frozen(v) for k, v in value.items()})
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None  # JSON has no Inf or NaN
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"Finding: a detail must be a number, a string or None, got {value!r}")


def _plain(value: object) -> object:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


# -- the rule --------------------------------------------------------------------------------


def _holds(base: float, undone: float, u: _Array, e: _Array) -> bool:
    """The rule, for the score ``undone`` of ``u``, an undone actual, against ``e``."""
    if undone * GAIN > base:
        return False
    if undone <= 1.0:
        return True
    # A base that is not finite (the score failed) can only be undone to a pass; and a fall
    # counts only when ``u`` is along ``e`` (a fall from a mere magnitude mismatch does not).
    return math.isfinite(base) and undone * FALLS <= base and _cos2(u, e) >= _ALIGNED


def _cos2(u: _Array, e: _Array) -> float:
    """``cos^2`` of the angle between ``u`` and ``e``: 1 when ``u`` is ``e`` times a factor,
    about ``1 / size`` for unrelated values; 0 when either is zero or not finite."""
    with np.errstate(all="ignore"):
        ue, uu, ee = float(np.vdot(u, e)), float(np.vdot(u, u)), float(np.vdot(e, e))
        cos2 = ue * ue / (uu * ee) if uu > 0 and ee > 0 else 0.0
    return cos2 if math.isfinite(cos2) else 0.0


def _scored(score: Score, name: str, actual: _Array, expected: _Array) -> float:
    """The caller's score, a non-finite one (or an error on odd input) taken as no pass."""
    with np.errstate(all="ignore"):
        try:
            value = float(score(name, actual, expected))
        except (ArithmeticError, ValueError):
            return math.inf
    return value if math.isfinite(value) else math.inf


def _f64(x: NDArray[Any]) -> _Array:
    """``x`` in float64, copied when converted; never written to."""
    return np.asarray(x, dtype=np.float64)


def _fit(u: _Array, e: _Array, floor: float) -> float | None:
    """The least-squares factor ``c`` of ``u ~ c * e`` when it differs from 1 by more than
    ``floor`` and :data:`_FIT_ERRORS` standard errors of the fit (a fit of rounding noise does
    not); else None."""
    with np.errstate(all="ignore"):
        ee = float(np.vdot(e, e))
        c = float(np.vdot(u, e)) / ee if ee > 0 else math.nan
        if not math.isfinite(c) or c == 0.0 or u.size < 2:
            return None
        resid = u - c * e
        error = math.sqrt(float(np.vdot(resid, resid)) / ((u.size - 1) * ee))
    return c if abs(c - 1.0) > max(_FIT_ERRORS * error, floor) else None


def _sample(u: _Array, e: _Array) -> tuple[_Array, _Array]:
    """At most 4096 evenly spaced elements of both (in C order): a cheap look at a reordered
    view, which would otherwise be copied whole."""
    if u.size <= 2 * _PREVIEW:
        return u, e
    at = np.linspace(0, u.size - 1, _PREVIEW).astype(np.intp)
    return u.flat[at], e.flat[at]


class _Context:
    """The float64 region of one failing gradient that the hypotheses share."""

    def __init__(
        self,
        name: str,
        a: _Array,
        e: _Array,
        score: Score,
        base: float,
        state_size: int,
        whole: bool,
        dtype: np.dtype[Any],
    ) -> None:
        self.name, self.a, self.e, self.base, self.state_size, self.whole = (
            name,
            a,
            e,
            base,
            state_size,
            whole,
        )
        self._score = score
        self.dtype = dtype
        #: Whether the first step reads a zero state (none carried): what reads it is right there.
        self.zero_start = False

    @functools.cached_property
    def floor(self) -> float:
        """The least ``|c - 1|`` a fitted factor must have: more than a dominant element's
        rounding, and than the expected values' own rounding in the actual's dtype (large for
        subnormals)."""
        least = max(_LEAST_FACTOR, 4 * UNIT_ROUNDOFF.get(self.dtype.name, 0.0))
        with np.errstate(all="ignore"):
            rounded = self.e.astype(self.dtype).astype(np.float64)
            relative = math.sqrt(float(np.vdot(rounded - self.e, rounded - self.e))) / max(
                math.sqrt(float(np.vdot(self.e, self.e))), 1e-300
            )
        return max(least, 4 * relative) if math.isfinite(relative) else least

    def score(self, a: _Array, e: _Array) -> float:
        return _scored(self._score, self.name, a, e)

    def row_step_scores(self) -> _Array:
        """The score of each step of each batch row: ``[B, S]``."""
        steps = getattr(self._score, "steps", None)
        a, e = self.a, self.e
        with np.errstate(all="ignore"):
            if steps is not None:
                rows = [
                    np.asarray(steps(self.name, a[r : r + 1], e[r : r + 1])) for r in range(len(a))
                ]
                return np.stack(rows)
            cells = [
                [self.score(a[r : r + 1, t], e[r : r + 1, t]) for t in range(a.shape[1])]
                for r in range(len(a))
            ]
            return np.array(cells, dtype=np.float64)

    def step_scores(self) -> _Array:
        """The score of each step of the region (its index along axis 1)."""
        steps = getattr(self._score, "steps", None)
        if steps is None:
            a, e = self.a, self.e
            return np.array([self.score(a[:, t], e[:, t]) for t in range(a.shape[1])])
        with np.errstate(all="ignore"):
            per = np.asarray(steps(self.name, self.a, self.e), dtype=np.float64)
        return np.where(np.isfinite(per), per, math.inf)

    def explain(self, u: _Array, e: _Array) -> tuple[float, float] | None:
        """``(score, factor)`` when ``u`` (an undone actual) explains the error as is or
        times a fitted constant; None when neither holds. A constant is fitted only to at
        least :data:`_IDENTIFIED` non-zero expected elements: a handful fits one by chance.
        Nothing is identified on fewer: a shift, a transpose or a permutation of a handful
        of values may match them as a rounding does."""
        if np.count_nonzero(e) < _IDENTIFIED:
            return None
        if _cos2(*_sample(u, e)) < _SIMILAR or _cos2(u, e) < _SIMILAR:
            return None  # far from e times any factor: no score needed to say no
        plain = self.score(u, e)
        if _holds(self.base, plain, u, e):
            return plain, 1.0
        c = _fit(u, e, self.floor) if np.count_nonzero(e) >= _IDENTIFIED else None
        if c is None:
            return None
        with np.errstate(all="ignore"):
            scaled = self.score(u / c, e)
        return (scaled, c) if _holds(self.base, scaled, u, e) else None


# -- grad_findings ---------------------------------------------------------------------------


def grad_findings(
    name: str, actual: NDArray[Any], expected: NDArray[Any], layout: GdnBackwardLayout, score: Score
) -> tuple[Finding, ...]:
    """The hypotheses that explain a failing gradient (see the module docstring).

    Parameters
    ----------
    name : str
        The gradient: ``"dq"``, ``"dk"``, ``"dv"``, ``"dg"``, ``"dbeta"`` or ``"dstate"``.
    actual : numpy.ndarray
        The kernel's gradient, shaped as ``layout.shape(name)``, any floating dtype (float16
        and ml_dtypes' bfloat16 included); read, never written.
    expected : numpy.ndarray
        The reference's gradient (converted to float64 if it is not).
    layout : GdnBackwardLayout
        The layout both belong to.
    score : callable
        ``score(name, actual, expected) -> float``, float64 arrays of one shape, a whole
        gradient or a region of it: the error over the criterion's limit, at most 1 passing.

    Returns
    -------
    tuple of Finding
        Most specific first (:data:`KINDS`' order); empty when nothing holds, or when the
        region tested passes.

    Raises
    ------
    TypeError
        ``layout`` is not a :class:`GdnBackwardLayout`.
    ValueError
        ``name`` is not a gradient of ``layout``, or a shape is not ``layout.shape(name)``.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout
    >>> layout = GdnBackwardLayout(batch=1, seq=2, heads=1, state_size=4, carry_state=True)
    >>> def score(name, a, e):
    ...     return float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-30) / 1e-3)
    >>> expected = np.arange(1.0, 17.0).reshape(1, 1, 4, 4)
    >>> found = grad_findings("dstate", expected.swapaxes(-1, -2), expected, layout, score)
    >>> [f.kind for f in found]
    ['transpose']
    >>> grad_findings("dstate", np.zeros((1, 1, 4, 4)), expected, layout, score)[0].text
    'dstate is all zeros: never written? (a fresh np.empty buffer often reads as zeros)'
    """
    shape = _checked_shape(name, layout)
    if not isinstance(actual, np.ndarray) or actual.shape != shape:
        got = getattr(actual, "shape", type(actual).__name__)
        raise ValueError(f"grad_findings: actual {name} must have shape {shape}, got {got}")
    e_all = np.asarray(expected)  # converted a block at a time: no float64 copy of it whole
    if e_all.shape != shape:
        raise ValueError(
            f"grad_findings: expected {name} must have shape {shape}, got {e_all.shape}"
        )
    if actual.size == 0:
        return ()
    scan = _scan(name, actual, e_all)
    found = [f for f in (scan.unwritten(name), scan.nonfinite(name)) if f is not None]
    if found or not scan.expected_finite:
        return tuple(found)

    region = _leading(name, shape)
    if region is None:
        return ()
    rows, steps = region
    a, e = _f64(actual[:rows, :steps]), _f64(e_all[:rows, :steps])
    base = _scored(score, name, a, e)
    if base <= 1.0:
        return ()
    whole = a.shape == shape
    ctx = _Context(name, a, e, score, base, layout.state_size, whole, actual.dtype)
    ctx.zero_start = not layout.carry_state
    found += _tried(ctx, GRADIENTS)
    if not found and base <= ROUNDING_MAX:
        found.append(_rounding(name, base))
    return tuple(sorted(found, key=lambda f: KINDS.index(f.kind)))


def _explains(finding: Finding) -> bool:
    """Whether a finding leaves the gradient passing: nothing else needs trying."""
    score = finding.details.get("score")
    return isinstance(score, float) and score <= 1.0


def _checked_shape(name: str, layout: GdnBackwardLayout) -> tuple[int, ...]:
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "grad_findings")
    if name not in layout.names:
        raise ValueError(
            f"grad_findings: {name!r} is not a gradient of this layout; it has "
            f"{', '.join(layout.names)}"
        )
    return layout.shape(name)


def _leading(name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The leading region of gradient ``name`` of ``shape`` that the hypotheses read, at most
    :data:`MAX_WHOLE_ELEMENTS` elements: ``(rows, steps)``, its first batch elements and, when
    one is too many, the first steps of the first; None when not even one step fits."""
    size = math.prod(shape)
    per_batch = size // shape[0]
    if size <= MAX_WHOLE_ELEMENTS:
        return shape[0], shape[1] if len(shape) > 1 else 0
    if per_batch <= MAX_WHOLE_ELEMENTS:
        return MAX_WHOLE_ELEMENTS // per_batch, shape[1]
    if _step_axis(name) is None:
        return None
    steps = MAX_WHOLE_ELEMENTS // (per_batch // shape[1])
    return (1, steps) if steps else None


def _step_axis(name: str) -> int | None:
    """The axis of steps (of chunks for ``h`` and ``dh``); None for a state."""
    return None if name in _STATES else 1


def _head_axis(name: str) -> int:
    return 1 if name in _STATES else 2


_STATES: Final = ("dstate", "final_state")  # [B, H, N, N]: no step axis


def _unit(name: str) -> tuple[str, str]:
    """What axis 1 counts, and its index's letter: steps ``t``, or the chunks ``c`` of ``h``
    and ``dh``."""
    return ("chunk", "c") if name in ("h", "dh") else ("step", "t")


# -- the blockwise scan: unwritten and nonfinite ---------------------------------------------


@dataclasses.dataclass
class _Scan:
    size: int
    dtype: np.dtype[Any]
    zeros: int = 0
    first_value: float = 0.0
    constant: bool = True
    tiny: int = 0
    wild: int = 0  # huge or non-finite
    log_n: int = 0
    log_sum: float = 0.0
    log_sumsq: float = 0.0
    bad: int = 0
    first_bad: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    bad_per_slab: list[int] = dataclasses.field(default_factory=list)
    expected_finite: bool = True
    expected_zero: bool = True
    expected_max: float = 0.0
    slab_axis: str = "s"

    def unwritten(self, name: str) -> Finding | None:
        if self.expected_zero or not np.asarray(self.expected_max).astype(self.dtype):
            return None  # expected values all round to zero in this dtype: zeros are right
        if self.zeros == self.size:
            return Finding(
                "unwritten",
                name,
                f"{name} is all zeros: never written? (a fresh np.empty buffer often reads as "
                "zeros)",
                {"value": 0.0, "how": "zeros"},
            )
        if self.constant and self.size > 1 and math.isfinite(self.first_value):
            value = self.first_value  # a NaN or Inf everywhere is nonfinite's to name
            return Finding(
                "unwritten",
                name,
                f"{name} is {value:.6g} everywhere: filled and never written?",
                {"value": value, "how": "constant"},
            )
        if self._garbage():
            nonzero = self.size - self.zeros
            return Finding(
                "unwritten",
                name,
                f"{name} looks untouched from np.empty(): {self.tiny} values below {_TINY:g}, "
                f"{self.wild} above {_HUGE:g} or not finite, {nonzero} of {self.size} non-zero "
                "(stale memory, never written?)",
                {"how": "empty", "tiny": self.tiny, "wild": self.wild, "nonzero": nonzero},
            )
        return None

    def _garbage(self) -> bool:
        if self.dtype.name == "float16":
            return False  # its range holds neither value: not detectable
        if self.tiny == 0 or self.tiny < 0.01 * self.size:
            return False
        mean = self.log_sum / max(self.log_n, 1)
        spread = math.sqrt(max(self.log_sumsq / max(self.log_n, 1) - mean * mean, 0.0))
        return spread > _GARBAGE_BINADES

    def nonfinite(self, name: str) -> Finding | None:
        if not self.bad:
            return None
        slabs = np.flatnonzero(np.asarray(self.bad_per_slab) > 0)
        first, last, count = int(slabs[0]), int(slabs[-1]), len(self.bad_per_slab)
        details: dict[str, object] = {
            "count": self.bad,
            "first": tuple(self.first_bad),
            "spread": None,
        }
        where = ""
        if self.slab_axis == "s":
            details.update(first_step=first, last_step=last)
            every = slabs.size == last - first + 1
            if every and first == 0 and last == count - 1:
                details["spread"], where = "all", "; at every step"
            elif every and last == count - 1:
                details["spread"], where = "later", f"; at every step from s={first} on"
            elif every and first == 0:
                details["spread"] = "earlier"
                where = (
                    f"; at every step up to s={last} (carried to earlier steps from there, as "
                    "the backward sweep does)"
                )
            else:
                where = f"; at {slabs.size} of {count} steps, from s={first} to s={last}"
        coords = ", ".join(str(list(c)) for c in self.first_bad[:3])
        return Finding(
            "nonfinite",
            name,
            f"{name} has {self.bad} NaN or Inf where the expected values are finite, first at "
            f"{coords}{where}",
            details,
        )


def _scan(name: str, actual: NDArray[Any], expected: NDArray[Any]) -> _Scan:
    """One pass in float64, a block of steps (for ``dstate`` of batch elements) at a time, each
    block at most :data:`_SCAN_ELEMENTS` elements; a step (a batch element) of more, in pieces
    of that many."""
    axis = 0 if _step_axis(name) is None else 1
    scan = _Scan(size=actual.size, dtype=actual.dtype, slab_axis="b" if axis == 0 else "s")
    scan.first_value = float(actual.flat[0])
    count = actual.shape[axis]
    slab = actual.size // count
    block = max(1, _SCAN_ELEMENTS // slab)
    slab_shape = actual.shape[:axis] + actual.shape[axis + 1 :]
    with np.errstate(all="ignore"):
        if slab > _SCAN_ELEMENTS:  # a dstate of N = 4096: 16.8 M elements a batch element
            for i in range(count):
                a_slab = (actual[i] if axis == 0 else actual[:, i]).reshape(-1)
                e_slab = (expected[i] if axis == 0 else expected[:, i]).reshape(-1)
                for j0 in range(0, slab, _SCAN_ELEMENTS):
                    part = slice(j0, j0 + _SCAN_ELEMENTS)
                    a, e = (np.asarray(t[part], np.float64)[None] for t in (a_slab, e_slab))
                    _scan_block(scan, a, e, i, axis, slab_shape, j0)
            return scan
        for i0 in range(0, count, block):
            part = slice(i0, min(i0 + block, count))
            # Each slab a row: [slabs, elements], in the slab's own C order.
            a = actual[part] if axis == 0 else actual[:, part]
            e = expected[part] if axis == 0 else expected[:, part]
            rows = a.shape[axis]
            a = np.ascontiguousarray(np.moveaxis(a, axis, 0), dtype=np.float64)
            e = np.ascontiguousarray(np.moveaxis(e, axis, 0), dtype=np.float64)
            a, e = a.reshape(rows, -1), e.reshape(rows, -1)
            _scan_block(scan, a, e, i0, axis, slab_shape)
    return scan


def _scan_block(
    scan: _Scan,
    a: _Array,
    e: _Array,
    i0: int,
    axis: int,
    slab_shape: tuple[int, ...],
    start: int | None = None,
) -> None:
    """Add the slabs ``i0, i0 + 1, ...`` (the rows of ``a`` and ``e``, each of
    ``slab_shape``) to ``scan``; with ``start``, ``a`` and ``e`` are one row, the elements of
    slab ``i0`` from ``start`` on."""
    fin_a, fin_e = np.isfinite(a), np.isfinite(e)
    rows_finite = fin_e.all(axis=1)
    scan.expected_finite &= bool(rows_finite.all())
    scan.expected_zero &= not np.any(e)
    if e.shape[1] and rows_finite.any():
        scan.expected_max = max(scan.expected_max, float(np.abs(e[rows_finite]).max()))
    scan.zeros += a.size - int(np.count_nonzero(a))
    if scan.constant:
        same = np.isnan(a) if math.isnan(scan.first_value) else a == scan.first_value
        scan.constant = bool(same.all())
    mag = np.abs(a)
    nonzero = fin_a & (mag > 0)
    scan.tiny += int(np.count_nonzero(nonzero & (mag < _TINY) & (np.abs(e) >= 1e-20)))
    scan.wild += int(np.count_nonzero(~fin_a | (mag > _HUGE)))
    logs = np.log2(mag[nonzero])
    scan.log_n += logs.size
    scan.log_sum += float(logs.sum())
    scan.log_sumsq += float(np.square(logs).sum())
    bad = ~fin_a & fin_e
    per_row = np.count_nonzero(bad, axis=1)
    scan.bad += int(per_row.sum())
    if start:  # a later piece of the slab before
        scan.bad_per_slab[-1] += int(per_row[0])
    else:
        scan.bad_per_slab.extend(int(n) for n in per_row)
    if scan.bad and len(scan.first_bad) < _SHOWN:
        for row, flat in np.argwhere(bad)[: _SHOWN - len(scan.first_bad)]:
            full = [int(c) for c in np.unravel_index(int(flat) + (start or 0), slab_shape)]
            full.insert(axis, i0 + int(row))
            scan.first_bad.append(tuple(full))


# -- the hypotheses on the float64 region ----------------------------------------------------


def _transpose(ctx: _Context) -> Finding | None:
    a, e = ctx.a, ctx.e
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or a.shape[-1] < 2:
        return None
    result = ctx.explain(np.swapaxes(a, -1, -2), e)
    if result is None:
        return None
    axes = gradient_axes(ctx.name, a.ndim)
    lead = ", ".join(axes[:-2])
    x, y = axes[-2], axes[-1]
    text = (
        f"{ctx.name} holds its transpose: {ctx.name}[{lead}, {x}, {y}] is expected[{lead}, "
        f"{y}, {x}]"
    )
    if ctx.name in ("h", "dh", "final_state"):
        text += " (a state kept as [V, K]?)"
    return _finding(ctx, "transpose", text, result, {"axes": (a.ndim - 2, a.ndim - 1)})


def _finding(
    ctx: _Context,
    kind: str,
    text: str,
    result: tuple[float, float],
    details: Mapping[str, object],
) -> Finding:
    score, factor = result
    if factor != 1.0:
        text += f", and scaled by {factor:#.4g}"
    return Finding(
        kind,
        ctx.name,
        text,
        {**details, "factor": factor, "score": score, "score_before": ctx.base},
    )


def _permutation(a: _Array, e: _Array, axis: int) -> NDArray[np.intp] | None:
    """``perm`` with ``a``'s index ``i`` along ``axis`` closest to ``e``'s ``perm[i]`` up to a
    factor (least ``1 - cos^2``), when that is a permutation other than the identity."""
    k = a.shape[axis]
    am = np.moveaxis(a, axis, 0).reshape(k, -1)
    em = np.moveaxis(e, axis, 0).reshape(k, -1)
    with np.errstate(all="ignore"):
        dots = am @ em.T
        na, ne = np.einsum("ij,ij->i", am, am), np.einsum("ij,ij->i", em, em)
        rel = 1.0 - dots**2 / np.outer(na, ne)
    rel[~np.isfinite(rel)] = 1.0
    perm = np.argmin(rel, axis=1)
    # Ties go to the identity: a moved index must fit strictly better.
    stay = np.arange(k)
    perm = np.where(rel[stay, stay] <= rel[stay, perm], stay, perm)
    if np.array_equal(perm, stay) or not np.array_equal(np.sort(perm), stay):
        return None
    return perm


def _moves(perm: Sequence[int], one: str, many: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """A permutation in words, and its exchanged pairs."""
    pairs = tuple((i, int(p)) for i, p in enumerate(perm) if i < p and perm[p] == i)
    swapped = {i for pair in pairs for i in pair}
    words = [f"{many} {i} and {j} exchanged" for i, j in pairs]
    words += [
        f"{one} {i} holds {one} {p}'s values"
        for i, p in enumerate(perm)
        if i != p and i not in swapped
    ]
    shown = "; ".join(words[:_SHOWN]) + ("; ..." if len(words) > _SHOWN else "")
    return shown, pairs


def _axis_permutation(ctx: _Context, axis: int, one: str, many: str, kind: str) -> Finding | None:
    a, e = ctx.a, ctx.e
    if a.shape[axis] < 2:
        return None
    perm = _permutation(a, e, axis)
    if perm is None:
        return None
    result = ctx.explain(np.take(a, np.argsort(perm), axis=axis), e)
    if result is None:
        return None
    words, pairs = _moves(perm.tolist(), one, many)
    text = f"{ctx.name}'s {many} are permuted: {words}"
    details = {
        "permutation": perm,
        "pairs": pairs,
        "moved": int(np.count_nonzero(perm != np.arange(perm.size))),
    }
    return _finding(ctx, kind, text, result, details)


def _heads(ctx: _Context) -> Finding | None:
    return _axis_permutation(ctx, _head_axis(ctx.name), "head", "heads", "heads")


def _batch(ctx: _Context) -> Finding | None:
    return (
        _axis_permutation(ctx, 0, "batch element", "batch elements", "batch") if ctx.whole else None
    )


_Key = TypeVar("_Key")


def _best(
    ctx: _Context, tried: Iterable[tuple[_Key, _Array, _Array]]
) -> tuple[_Key, tuple[float, float]] | None:
    """The tried undoing that explains the error with the least score, the first on a tie."""
    best = None
    for key, u, e in tried:
        result = ctx.explain(u, e)
        if result is not None and (best is None or result[0] < best[1][0]):
            best = (key, result)
    return best


def _shift(ctx: _Context) -> Finding | None:
    axis = _step_axis(ctx.name)
    if axis is None:
        return None
    a, e = ctx.a, ctx.e
    steps = a.shape[axis]

    def tried() -> Iterator[tuple[int, _Array, _Array]]:
        for k in _SHIFTS:
            if steps - abs(k) < 1 or steps < 2:
                continue
            # actual[:, t] holds expected[:, t - k], on the steps both have.
            u, ref = (a[:, k:], e[:, : steps - k]) if k > 0 else (a[:, :k], e[:, -k:])
            if np.any(ref):
                yield k, u, ref

    best = _best(ctx, tried())
    if best is None:
        return None
    k, result = best
    unit, i = _unit(ctx.name)
    axis_name = "c" if unit == "chunk" else "s"
    text = (
        f"{ctx.name} is expected shifted by {k:+d} {unit}{'s' if abs(k) > 1 else ''} along "
        f"{axis_name}: {ctx.name}[:, {i}] holds expected[:, {i}{-k:+d}]"
    )
    if unit == "chunk" and k == -1:  # the state leaving chunk c, not the one entering it
        what = "the cotangent of the state" if ctx.name == "dh" else "the state"
        text += f" ({what} leaving chunk {i}, as another library keeps it?)"
    details: dict[str, object] = {"step": k}
    if ctx.name == "dg" and abs(k) == 1:  # the misreading gate_shift, where gates are equal
        when = "late" if k == -1 else "early"
        text += (
            f" (dg stored a step off, or the gate read one step {when}: where the gates "
            "are equal, only dg shows that)"
        )
        details["or_reading"] = "gate_shift"
    return _finding(ctx, "shift", text, result, details)


def _scale_hint(c: float, n: int) -> tuple[str, ...]:
    root = math.sqrt(n)
    named = [
        (-1.0, "-1", "a sign flip?"),
        (2.0, "2", "counted twice?"),
        (0.5, "1/2", "a factor 1/2 too many?"),
        (root, "sqrt(N)", f"a missing 1/sqrt(N) = 1/{root:g}?"),
        (1.0 / root, "1/sqrt(N)", f"1/sqrt(N) = 1/{root:g} applied twice?"),
        (float(n), "N", f"a missing 1/N = 1/{n}?"),
        (1.0 / n, "1/N", f"an extra 1/N = 1/{n}?"),
    ]
    return tuple(
        f"{label}: {hint}"
        for value, label, hint in named
        if value != 1.0 and abs(c / value - 1) <= 0.01
    )


def _scale(ctx: _Context) -> Finding | None:
    if np.count_nonzero(ctx.e) < _IDENTIFIED:
        return None  # a handful of values may share one rounded factor
    if _cos2(*_sample(ctx.a, ctx.e)) < _SIMILAR or _cos2(ctx.a, ctx.e) < _SIMILAR:
        return None
    c = _fit(ctx.a, ctx.e, ctx.floor)
    if c is None:
        return None
    with np.errstate(all="ignore"):
        undone = ctx.score(ctx.a / c, ctx.e)
    if not _holds(ctx.base, undone, ctx.a, ctx.e):
        return None
    n = ctx.state_size
    hints = _scale_hint(c, n) if n > 0 else ()
    text = f"{ctx.name} is {c:#.4g} x expected"
    if hints:
        text += " (" + " or ".join(h.split(": ", 1)[1] for h in hints) + ")"
    named = tuple(h.split(": ", 1)[0] for h in hints)
    return Finding(
        "scale",
        ctx.name,
        text,
        {"factor": c, "named": named, "score": undone, "score_before": ctx.base},
    )


def _axes(ctx: _Context) -> Finding | None:
    a, e = ctx.a, ctx.e
    shape, nd = a.shape, a.ndim
    names = [x.upper() for x in gradient_axes(ctx.name, nd)]
    seen = {tuple(i for i in range(nd) if shape[i] > 1)}
    if nd >= 2 and shape[-1] == shape[-2]:
        swap = (*range(nd - 2), nd - 1, nd - 2)
        seen.add(tuple(i for i in swap if shape[i] > 1))  # the transpose kind's

    def tried() -> Iterator[tuple[tuple[int, ...], _Array, _Array]]:
        for order in itertools.permutations(range(nd)):
            if not ctx.whole and order[0] != 0:
                continue  # the region is the first batch elements: b must stay first
            key = tuple(i for i in order if shape[i] > 1)
            if key in seen:
                continue
            seen.add(key)
            # The kernel wrote e.transpose(order) in C order: read it so and put the axes back.
            written = tuple(shape[i] for i in order)
            yield order, a.reshape(written).transpose(np.argsort(order)), e

    best = _best(ctx, tried())
    if best is None:
        return None
    order, result = best
    got = ", ".join(names[i] for i in order)
    text = f"{ctx.name} holds its values in the order [{got}], not [{', '.join(names)}]"
    return _finding(ctx, "axes", text, result, {"order": tuple(names[i] for i in order)})


def _rows_carried(ctx: _Context) -> Finding | None:
    """Rows after the first wrong from their first step while row 0 starts right: a state
    carried from one batch row into the next (the rows run as one sequence), which in the
    backward also makes the row before wrong at its last steps."""
    a, e = ctx.a, ctx.e
    if _unit(ctx.name)[0] != "step" or _step_axis(ctx.name) is None:
        return None  # the seams are between the steps of rows: not of h's chunks
    if not ctx.whole or a.shape[0] < 2 or a.shape[1] < 2:
        return None
    per = ctx.row_step_scores()
    fail = ~(per <= 1.0)
    last = a.shape[0] - 1
    # Wrong next to a seam between rows, where no other row is: a row's first steps after
    # the first row (row 0's first steps right), or a row's last steps before the last one
    # (the last row's right: the next row's dy carried back into the row before).
    first = [r for r in range(1, last + 1) if fail[r, 0]] if not fail[0, 0] else []
    ends = [r for r in range(last) if fail[r, -1]] if not fail[last, -1] else []
    if not (first or ends):
        return None
    seams = sorted({*first, *(r + 1 for r in ends)})
    rows_failing = {r for r in range(last + 1) if fail[r].any()}
    if not rows_failing <= {*seams, *(r - 1 for r in seams)}:
        return None
    # One wrong step is one wrong place, not a seam: the run of failing steps at each side
    wrong = sum(int(np.argmin(np.append(fail[r], False))) for r in first)
    wrong += sum(int(np.argmin(np.append(fail[r, ::-1], False))) for r in ends)
    if wrong < 2:
        return None
    if np.nanmax(np.where(fail, per, 0.0)) <= ROUNDING_MAX or np.count_nonzero(e) < _IDENTIFIED:
        return None
    r = seams[0]
    parts = [f"row {r}'s first steps"] if r in first else []
    parts += [f"row {r - 1}'s last steps"] if r - 1 in ends else []
    text = f"{ctx.name} is wrong in {' and '.join(parts)}"
    text += ": the state carried across rows (the rows run as one sequence)?"
    rows = tuple(seams)
    before = r - 1 in ends
    details = {"rows": rows, "previous_last_wrong": before}
    return Finding("boundary", ctx.name, text, details)


def _boundary(ctx: _Context) -> Finding | None:
    axis = _step_axis(ctx.name)
    if axis is None or ctx.a.shape[axis] < 2:
        return None
    a = ctx.a
    steps = a.shape[axis]
    per = ctx.step_scores()
    fail = per > 1.0
    failing = np.flatnonzero(fail)
    if failing.size == 0 or failing.size == steps:
        return None
    lo, hi = int(failing[0]), int(failing[-1])
    every = np.arange(steps)
    sides: list[tuple[str, int, NDArray[np.intp], NDArray[np.intp]]] = []
    if hi == steps - 1 and lo > 0:
        sides.append(("from", lo, every[:lo], every[lo:]))
    if lo == 0 and hi < steps - 1:
        sides.append(("before", hi + 1, every[hi + 1 :], every[: hi + 1]))
    for side, t0, right, wrong in sides:
        # One wrong step is one wrong place, not a side of a boundary.
        if wrong.size < 2 or np.count_nonzero(fail[wrong]) < 0.9 * wrong.size:
            continue
        contrast = _contrast(ctx, right, wrong)
        if contrast is None:
            continue
        unit, _ = _unit(ctx.name)
        count = f"{'C' if unit == 'chunk' else 'S'}={steps}"
        if side == "from" and t0 == 1 and unit == "step" and ctx.zero_start:
            # Step 0 reads a zero state: a wrong term that reads the state vanishes there.
            # That is no step of the sequence, so none is named.
            text = (
                f"{ctx.name} is right at step 0 alone, where the state it reads is still zero "
                f"(none carried), and wrong from step 1 on ({count}): a term that reads the "
                "state before the step wrong?"
            )
            first: dict[str, object] = {"step": None, "side": "zero state"}
            first.update(count=int(failing.size), **contrast)
            return Finding("boundary", ctx.name, text, first)
        if side == "before" and per[t0 - 1] < FALLS * per[t0]:
            # No edge: an error from the first step that fades with the decay, as that of
            # the initial state does. Where it passes under the limit is no boundary.
            seen = (
                f"{ctx.name} is wrong from the first {unit} on and its error fades, within the "
                f"limit from {unit} {t0} on ({count})"
            )
            if ctx.zero_start:
                seen += ", as one made in the first steps does with the decay"
            why = ": the initial state, or how it is read, wrong? (its effect fades with the decay)"
            text = seen if ctx.zero_start else seen + why
            fades: dict[str, object] = {"step": None, "side": "fades", "until": t0, "seen": seen}
            fades.update(count=int(failing.size), **contrast)
            return Finding("boundary", ctx.name, text, fades)
        if side == "from":
            text = f"{ctx.name} is right before {unit} {t0} and wrong from {unit} {t0} on ({count})"
            seen = text
            if unit == "step" and t0 >= 8 and t0 & (t0 - 1) == 0:
                text += f": the second chunk, with chunks of {t0}?"
        else:
            text = f"{ctx.name} is wrong before {unit} {t0} and right from {unit} {t0} on ({count})"
            seen = text
        zeros = not np.any(a[:, wrong])
        if zeros:
            text += "; all zeros there"
        details = {
            "step": t0,
            "side": side,
            "count": int(failing.size),
            "zeros": zeros,
            "seen": seen,
            **contrast,
        }
        return Finding("boundary", ctx.name, text, details)
    return _period(ctx, fail, failing) or _window(ctx, per, fail, failing)


def _window(
    ctx: _Context, per: NDArray[np.float64], fail: NDArray[np.bool_], failing: NDArray[np.intp]
) -> Finding | None:
    """Wrong only in one run of steps, right on both sides: what a state that is not carried
    across a step does, its error fading with the decay on either side of it. The step is
    named when the error starts or stops there abruptly (by :data:`FALLS` from one step to
    the next)."""
    steps = fail.size
    lo, hi = int(failing[0]), int(failing[-1])
    run = hi - lo + 1
    if run < 3 or run * 2 > steps or np.count_nonzero(fail[lo : hi + 1]) < 0.75 * run:
        return None
    if ctx.a[:, lo : hi + 1].size < _WINDOW_ELEMENTS:
        return None  # a few wrong elements in a row are a rounding's chance, not a boundary
    every = np.arange(steps)
    inside = (every >= lo) & (every <= hi)
    contrast = _contrast(ctx, every[~inside], every[inside])
    if contrast is None:
        return None
    worst = int(lo + np.argmax(per[lo : hi + 1]))
    # An abrupt edge next to the worst of the run, not the end of a fading tail.
    near = per[worst] / FALLS
    step: int | None = None
    if lo > 0 and per[lo] >= max(near, FALLS * per[lo - 1]):
        step = lo
    elif hi < steps - 1 and per[hi] >= max(near, FALLS * per[hi + 1]):
        step = hi + 1
    unit, _ = _unit(ctx.name)
    text = (
        f"{ctx.name} is wrong only from {unit} {lo} to {unit} {hi} "
        f"({'C' if unit == 'chunk' else 'S'}={steps}), worst at {unit} {worst}, and right "
        "elsewhere"
    )
    seen = text
    if step is None:
        text += ": a state not carried across a step there?"
    else:
        text += f"; it jumps at step {step}: a state not carried across step {step}?"
    details = {
        "step": step,
        "side": "window",
        "first": lo,
        "last": hi,
        "worst": worst,
        "count": int(failing.size),
        "seen": seen,
        **contrast,
    }
    return Finding("boundary", ctx.name, text, details)


def _contrast(
    ctx: _Context, right: NDArray[np.intp], wrong: NDArray[np.intp]
) -> dict[str, float] | None:
    """The scores of the right and the wrong steps, when they are far apart."""
    e_right = ctx.e[:, right]
    if e_right.size < _RIGHT_ELEMENTS or not np.any(e_right):
        return None  # too little, or nothing, to be right about
    s_right = ctx.score(ctx.a[:, right], e_right)
    s_wrong = ctx.score(ctx.a[:, wrong], ctx.e[:, wrong])
    # Wrong past rounding's reach: a chunked float32 form's own error steps up at a chunk
    # boundary too, within a few times its limit.
    if s_right > 1.0 or s_wrong <= ROUNDING_MAX or s_wrong < FALLS * s_right:
        return None
    return {"score_right": s_right, "score_wrong": s_wrong}


def _period(ctx: _Context, fail: NDArray[np.bool_], failing: NDArray[np.intp]) -> Finding | None:
    steps = fail.size
    if failing.size * 2 > steps:
        return None
    for period in range(steps // 2, 3, -1):
        multiples = np.arange(period, steps, period)
        if multiples.size < 2:
            continue
        phase = failing % period
        offset = np.where(phase > period // 2, phase - period, phase)
        if np.any(np.abs(offset) > 1):
            continue
        hit = np.isin(multiples, failing - offset)
        if np.count_nonzero(hit) < 0.75 * multiples.size:
            continue
        contrast = _contrast(ctx, np.flatnonzero(~fail), failing)
        if contrast is None:
            return None
        offsets = tuple(sorted({int(o) for o in offset}))
        shown = ", ".join(str(int(t)) for t in failing[:_SHOWN]) + (
            ", ..." if failing.size > _SHOWN else ""
        )
        text = (
            f"{ctx.name} is wrong only near multiples of {period} steps (steps {shown}; "
            f"offsets {', '.join(f'{o:+d}' for o in offsets)}): a chunk size of {period}?"
        )
        details = {
            "period": period,
            "offsets": offsets,
            "count": int(failing.size),
            "steps": tuple(int(t) for t in failing[:_SHOWN]),
            **contrast,
        }
        return Finding("boundary", ctx.name, text, details)
    return None


def _rounding(name: str, base: float) -> Finding:
    return Finding(
        "rounding",
        name,
        f"{name}'s error is {base:.3g} x the limit with no structure found: only its size "
        "fails, as rounding's does (a chunked float32 form typically reaches about 10x its "
        "floor)",
        {"score": base},
    )


# -- the packed buffer -----------------------------------------------------------------------


def buffer_findings(
    actual_flat: NDArray[Any],
    expected_flat: NDArray[Any],
    layout: GdnBackwardLayout,
    score: Score,
) -> tuple[Finding, ...]:
    """The ``layout`` finding of a packed buffer: gradients found at other offsets.

    Each gradient that fails at its own offset is looked for where the layout of the other
    gate mode puts it and at every offset another order of the segments can give it (the sums
    of the other segments' lengths); an offset holds it when the hypothesis rule of the module
    docstring does. A candidate is scored only when its first 4096 elements are within 50% (RMS)
    of the expected ones, and on at most :data:`MAX_WHOLE_ELEMENTS` of it (its first batch
    elements), so the cost is a few passes over the buffer.

    Parameters
    ----------
    actual_flat : numpy.ndarray
        The kernel's 1-D packed buffer, ``layout.total_elems`` long, any floating dtype.
    expected_flat : numpy.ndarray
        The reference's packed buffer, float64.
    layout : GdnBackwardLayout
        The layout both should have.
    score : callable
        As for :func:`grad_findings`.

    Returns
    -------
    tuple of Finding
        One ``layout`` finding (gradient None) when some gradient sits elsewhere, else empty.
        Its details: ``offsets`` (where each gradient was found), ``expected_offsets``,
        ``moved``, ``order`` (the gradients by found offset), ``pairs`` (exchanged ones),
        ``layout`` (the other layout's fields, when it explains every move), ``missing``
        (failing gradients found nowhere).

    Raises
    ------
    TypeError
        ``layout`` is not a :class:`GdnBackwardLayout`.
    ValueError
        A buffer is not 1-D of ``layout.total_elems`` elements.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout, pack, unpack
    >>> layout = GdnBackwardLayout(batch=1, seq=3, heads=2, state_size=4)
    >>> expected = np.random.default_rng(1).standard_normal(layout.total_elems)
    >>> g = unpack(expected, layout)
    >>> swapped = pack(g.dk, g.dq, g.dv, g.dg, g.dbeta)
    >>> def score(name, a, e):
    ...     return float(np.abs(a - e).max() / np.abs(e).max() / 1e-3)
    >>> buffer_findings(swapped, expected, layout, score)[0].text
    'dq and dk are exchanged (dq at 24, dk at 0)'
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "buffer_findings")
    total = layout.total_elems
    for what, flat in (("actual_flat", actual_flat), ("expected_flat", expected_flat)):
        if not isinstance(flat, np.ndarray) or flat.shape != (total,):
            got = getattr(flat, "shape", type(flat).__name__)
            raise ValueError(f"buffer_findings: {what} must have shape ({total},), got {got}")
    segments = layout.segments()
    other = dataclasses.replace(layout, gate_per_channel=not layout.gate_per_channel)
    found: dict[str, int] = {}
    missing: list[str] = []
    for seg in segments:
        region = _segment_region(seg.name, seg.length, seg.shape)
        if region is None:
            continue
        count, shape = region
        # Converted a region at a time: never a float64 copy of the whole buffer.
        e = _f64(expected_flat[seg.offset : seg.offset + count]).reshape(shape)
        base, _ = _segment_score(score, seg.name, actual_flat, seg.offset, count, e, check=False)
        if base <= 1.0:
            found[seg.name] = seg.offset
            continue
        if np.count_nonzero(e) < _IDENTIFIED:
            continue  # a few values turn up at some offset by chance: not looked for
        best: tuple[float, int] | None = None
        for offset in _candidates(seg.name, seg.length, segments, other, total):
            s, a = _segment_score(score, seg.name, actual_flat, offset, count, e, check=True)
            if a is not None and _holds(base, s, a, e) and (best is None or s < best[0]):
                best = (s, offset)
        if best is None:
            missing.append(seg.name)
        else:
            found[seg.name] = best[1]
    expected_at = {seg.name: seg.offset for seg in segments}
    moved = [name for name in found if found[name] != expected_at[name]]
    if not moved:
        return ()
    return (_layout_finding(layout, other, found, expected_at, moved, missing),)


def _segment_region(
    name: str, length: int, shape: tuple[int, ...]
) -> tuple[int, tuple[int, ...]] | None:
    """The leading part of a segment the hypotheses read (:func:`_leading`): its length and
    shape, contiguous in C order."""
    region = None if length == 0 else _leading(name, shape)
    if region is None:
        return None
    rows, steps = region
    if len(shape) == 1:
        return length, shape
    part = (rows, steps, *shape[2:])
    return math.prod(part), part


def _segment_score(
    score: Score,
    name: str,
    flat: NDArray[Any],
    offset: int,
    count: int,
    e: _Array,
    check: bool,
) -> tuple[float, _Array | None]:
    """The score of ``count`` elements of ``flat`` from ``offset`` read as ``e``, and them in
    float64; with ``check``, a candidate that is not finite or is far off in its first
    elements is refused unscored (``inf, None``)."""
    part = flat[offset : offset + count]
    if check:
        # A cheap look at the first elements before a full score.
        head = _f64(part[:_PREVIEW])
        ref = e.reshape(-1)[: head.size]
        with np.errstate(all="ignore"):
            if not np.isfinite(head).all():
                return math.inf, None
            norm = float(np.sqrt(np.mean(ref * ref)))
            if norm > 0 and float(np.sqrt(np.mean((head - ref) ** 2))) > 0.5 * norm:
                return math.inf, None
    a = _f64(part).reshape(e.shape)
    if check and not np.isfinite(a).all():
        return math.inf, None
    return _scored(score, name, a, e), a


def _candidates(
    name: str,
    length: int,
    segments: Sequence[Segment],
    other: GdnBackwardLayout,
    total: int,
) -> list[int]:
    """Where else a segment may sit: the other gate mode's offset, and every sum of the other
    segments' lengths (its offset in some order of the segments)."""
    here = next(seg.offset for seg in segments if seg.name == name)
    rest = [seg.length for seg in segments if seg.name != name]
    offsets = {
        sum(subset) for r in range(len(rest) + 1) for subset in itertools.combinations(rest, r)
    }
    if name in other.names:
        offsets.add(other.segment(name).offset)
    return sorted(o for o in offsets if o != here and o + length <= total)


def _layout_finding(
    layout: GdnBackwardLayout,
    other: GdnBackwardLayout,
    found: dict[str, int],
    expected_at: dict[str, int],
    moved: list[str],
    missing: list[str],
) -> Finding:
    order = tuple(sorted(found, key=lambda n: (found[n], layout.names.index(n))))
    pairs = tuple(
        (x, y)
        for i, x in enumerate(moved)
        for y in moved[i + 1 :]
        if found[x] == expected_at[y] and found[y] == expected_at[x]
    )
    in_pairs = {n for pair in pairs for n in pair}
    where = ", ".join(f"{n} at {found[n]} (expected {expected_at[n]})" for n in moved)
    details: dict[str, object] = {
        "offsets": dict(found),
        "expected_offsets": dict(expected_at),
        "moved": tuple(moved),
        "order": order,
        "pairs": pairs,
        "layout": None,
        "missing": tuple(missing),
    }
    if all(n in other.names and other.segment(n).offset == found[n] for n in moved):
        mode = "per-channel" if other.gate_per_channel else "per-head"
        details["layout"] = other.to_dict()
        text = (
            f"the buffer is packed as the {mode}-gate layout "
            f"(gate_per_channel={other.gate_per_channel}): {where}"
        )
    elif in_pairs == set(moved):
        text = "; ".join(
            f"{x} and {y} are exchanged ({x} at {found[x]}, {y} at {found[y]})" for x, y in pairs
        )
    else:
        text = (
            f"the segments sit in the order {', '.join(order)} (expected "
            f"{', '.join(layout.names)}): {where}"
        )
    if missing:
        text += f"; {', '.join(missing)} found nowhere"
    return Finding("layout", None, text, details)


def size_findings(elems: int, layout: GdnBackwardLayout) -> tuple[Finding, ...]:
    """What a packed buffer of ``elems`` elements, where ``layout`` wants another number, fits.

    The layouts of the same ``B, S, H, N`` in the other gate and state modes with that many
    elements; else a buffer that ends where a gradient starts; else twice or half the length
    (values of one size read as another).

    Parameters
    ----------
    elems : int
        The buffer's length.
    layout : GdnBackwardLayout
        The layout it should have.

    Returns
    -------
    tuple of Finding
        One ``layout`` finding (gradient None), or none when nothing fits or the length is
        right. Its details: ``elems``, ``expected``, ``layouts`` (the fields of each layout
        that fits), ``ends_before`` (a gradient's name or None), ``factor`` (2, 0.5 or None).

    Raises
    ------
    TypeError
        ``layout`` is not a :class:`GdnBackwardLayout`.

    Examples
    --------
    >>> from gdn_layout import GdnBackwardLayout
    >>> layout = GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=4, carry_state=True)
    >>> layout.total_elems
    144
    >>> size_findings(112, layout)[0].text
    '112 elements: the layout without dstate (carry_state=False)'
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "size_findings")
    elems = int(elems)
    total = layout.total_elems
    if elems == total:
        return ()
    fits: list[GdnBackwardLayout] = []
    words: list[str] = []
    for per_channel in (False, True):
        for carry in (False, True):
            alt = dataclasses.replace(layout, gate_per_channel=per_channel, carry_state=carry)
            if alt == layout or alt.total_elems != elems:
                continue
            fits.append(alt)
            diffs = []
            if per_channel != layout.gate_per_channel:
                gate = "a per-channel gate" if per_channel else "a per-head gate"
                diffs.append(f"with {gate} (gate_per_channel={per_channel})")
            if carry != layout.carry_state:
                diffs.append(f"{'with' if carry else 'without'} dstate (carry_state={carry})")
            words.append("the layout " + " and ".join(diffs))
    ends_before = None
    if not fits:
        for seg in layout.segments()[1:]:
            if seg.offset == elems:
                ends_before = seg.name
                lost = layout.names[layout.names.index(seg.name) :]
                words.append(f"the buffer ends where {seg.name} starts ({', '.join(lost)} missing)")
                break
    factor = None
    if total and elems == 2 * total:
        factor = 2.0
        words.append(f"twice the {total} of the layout: 4-byte values read as 2-byte ones?")
    elif total and 2 * elems == total:
        factor = 0.5
        words.append(f"half the {total} of the layout: 2-byte values read as 4-byte ones?")
    if not words:
        return ()
    details = {
        "elems": elems,
        "expected": total,
        "layouts": tuple(alt.to_dict() for alt in fits),
        "ends_before": ends_before,
        "factor": factor,
    }
    return (Finding("layout", None, f"{elems} elements: {'; or '.join(words)}", details),)


# -- the tensors besides the gradients: y and the states ---------------------------------------


def tensor_findings(
    name: str,
    actual: NDArray[Any],
    expected: NDArray[Any],
    score: Callable[[_Array, _Array], float],
) -> tuple[Finding, ...]:
    """What explains a failing ``y``, ``h``, ``dh`` or ``final_state`` (``name``): the
    hypotheses of :data:`HYPOTHESES` that read states, by the rule of the gradients' (module
    docstring); ``score(actual, expected)`` is the tensor's criterion on float64 arrays of
    one shape (a part of it too). Along axis 1 ``h`` and ``dh`` count chunks: ``dh`` one chunk
    off is a ``shift`` (``dh[:, c]`` holding ``expected[:, c+1]``, the cotangent of the state
    *leaving* chunk ``c``), the chunks that fail a ``boundary``; the rows that fail, when
    some pass, are a ``batch`` finding.

    >>> import numpy as np
    >>> e = np.random.default_rng(0).standard_normal((1, 4, 2, 4, 4))
    >>> def score(a, e):
    ...     return float(np.abs(a - e).max() / np.abs(e).max() / 1e-6)
    >>> late = np.concatenate([e[:, 1:], np.zeros_like(e[:, :1])], axis=1)
    >>> found = tensor_findings("dh", late, e, score)[0]
    >>> found.kind, found.text[:52]
    ('shift', 'dh is expected shifted by -1 chunk along c: dh[:, c]')
    """
    a, e = _f64(np.asarray(actual)), _f64(np.asarray(expected))
    if a.shape != e.shape or a.ndim < 3 or a.size == 0 or a.size > MAX_WHOLE_ELEMENTS:
        return ()
    with np.errstate(all="ignore"):
        if not (np.isfinite(a).all() and np.isfinite(e).all()):
            return ()
        base = score(a, e)
        if base <= 1.0:
            return ()
        if not a.any() and e.any():
            text = f"{name} is all zeros: never written?"
            return (Finding("unwritten", name, text, {"value": 0.0, "how": "zeros"}),)
        ctx = _Context(name, a, e, lambda _, x, y: score(x, y), base, a.shape[-1], True, a.dtype)
        return tuple(sorted(_tried(ctx, STATES), key=lambda f: KINDS.index(f.kind)))


def _rows(ctx: _Context) -> Finding | None:
    """The batch rows that fail, when some pass: where the kernel goes wrong."""
    a, e = ctx.a, ctx.e
    count = a.shape[0]
    if count < 2 or np.count_nonzero(e) < _IDENTIFIED:
        return None
    failing = [r for r in range(count) if ctx.score(a[r], e[r]) > 1.0]
    if not failing or len(failing) == count:
        return None
    shown = ", ".join(map(str, failing[:_SHOWN])) + (", ..." if len(failing) > _SHOWN else "")
    text = f"{ctx.name} fails in batch row{'s' if len(failing) > 1 else ''} {shown} of {count}"
    return Finding("batch", ctx.name, text, {"rows": tuple(failing), "count": count})


def _zero_rows(ctx: _Context) -> Finding | None:
    """The failing batch rows that are all zeros where the op's are not (at least
    :data:`_IDENTIFIED` values that do not round to zero in the actual's dtype), when other
    rows are not zeros."""
    a, e = ctx.a, ctx.e
    rows = range(a.shape[0])
    if all(not a[r].any() for r in rows):
        return None  # no row to set them apart from: a tensor of zeros is the scan's to name
    with np.errstate(all="ignore"):  # a row at a time: the region's copies stay few
        zero = [
            r
            for r in rows
            if not a[r].any()
            and np.count_nonzero(e[r].astype(ctx.dtype).astype(np.float64)) >= _IDENTIFIED
            and ctx.score(a[r], e[r]) > 1.0
        ]
    if not zero:
        return None
    shown = ", ".join(map(str, zero[:_SHOWN])) + (", ..." if len(zero) > _SHOWN else "")
    many = len(zero) > 1
    text = (
        f"{ctx.name}'s batch row{'s' if many else ''} {shown} {'are' if many else 'is'} all "
        "zeros where the op's are not: never written?"
    )
    details: dict[str, object] = {"value": 0.0, "how": "rows", "rows": tuple(zero)}
    if ctx.name == "dstate":
        text += " (or the batch rows run as one sequence, which has one initial state)"
        details["or_reading"] = "batch_folded"
    return Finding("unwritten", ctx.name, text, details)


class Hypothesis(NamedTuple):
    """One kind of bug a failing tensor is tried for: ``test`` undoes it on the float64
    region and words what holds, or returns None; ``reads`` says which tensors it is tried
    on: ``"both"``, ``"gradients"`` or ``"states"`` (``y``, ``h``, ``dh``, ``final_state``).
    Adding a hypothesis is one entry here and its test."""

    kind: str
    test: Callable[[_Context], Finding | None]
    reads: str = "both"


#: Every hypothesis a failing gradient or state is tried for, in the order they are tried,
#: after the blockwise scan's ``unwritten`` and ``nonfinite`` of the whole tensor (the
#: buffer's ``layout`` and the case's ``misreading`` and ``overflow`` are tried on the whole).
HYPOTHESES: Final = (
    Hypothesis("unwritten", _zero_rows),
    Hypothesis("transpose", _transpose),
    Hypothesis("heads", _heads),
    Hypothesis("batch", _batch),
    Hypothesis("shift", _shift),
    Hypothesis("scale", _scale),
    Hypothesis("axes", _axes, "gradients"),
    Hypothesis("boundary", _rows_carried),
    Hypothesis("boundary", _boundary),
    Hypothesis("batch", _rows, "states"),
)
GRADIENTS: Final = tuple(h for h in HYPOTHESES if h.reads in ("both", "gradients"))
STATES: Final = tuple(h for h in HYPOTHESES if h.reads in ("both", "states"))


def _tried(ctx: _Context, hypotheses: tuple[Hypothesis, ...]) -> list[Finding]:
    """The findings of ``hypotheses`` on ``ctx``, until one explains it whole (or the rows'
    seams say where the steps go wrong)."""
    found: list[Finding] = []
    for hypothesis in hypotheses:
        finding = hypothesis.test(ctx)
        if finding is not None:
            found.append(finding)
            if _explains(finding) or hypothesis.test is _rows_carried:
                break
    return found

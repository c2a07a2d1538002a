"""Findings: simple hypotheses that name what is wrong with a failing gradient.

docs/findings.md says what each kind means. Each hypothesis undoes one kind of bug and asks
the caller's score (the error over the criterion's limit, at most 1 to pass) whether that
explains the error: it *holds* when the undone score is at most 1 or fell by :data:`FALLS`,
and in either case by :data:`GAIN`; a fall counts only when the undone actual is along the
expected values (``cos^2 >= 0.99``). Undoing a permutation, a shift or an axis order also
tries a fitted constant factor on top, so a head swap with a wrong scale is still named.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .._checks import not_a_layout
from .._dtypes import UNIT_ROUNDOFF
from ..layout import GdnBackwardLayout, Segment, gradient_axes
from ._criterion import json_float

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
#: The kinds of a gradient's own findings that explain it failing alone by the op's values as
#: they are (moved, not written, not finite), without a fitted factor: no misreading is re-run
#: for it. Never ``scale``: ``dv`` without ``beta`` is ``dv`` scaled where ``beta`` is constant.
ALONE: Final = frozenset({"unwritten", "nonfinite", "axes", "transpose", "heads", "batch", "shift"})

# -- the tuned constants, each with its reason -----------------------------------------------

#: The most elements of a gradient held in float64 at once (its first batch rows, or steps):
#: a few copies of 16 MiB, whatever the case's size.
MAX_WHOLE_ELEMENTS: Final = 1 << 21
#: An undone hypothesis holds when its score is at most 1 or fell by this factor: a fall that
#: large is no fit of rounding noise.
FALLS: Final = 100.0
#: ... and in either case fell by at least this factor, so that a gradient failing by a hair
#: is not "explained" by a fit that wins a few percent.
GAIN: Final = 4.0
#: The largest score called ``rounding``: a chunked float32 form reaches about 10x its floor.
ROUNDING_MAX: Final = 10.0
#: The least non-zero expected values any structure is identified on: on a handful a shift,
#: a transpose, a permutation or a factor matches as a rounding does.
_IDENTIFIED: Final = 16
#: ``cos^2`` of a fall that counts (within 10% RMS of ``e`` times a factor), and below which
#: an undone actual is refused unscored (far from ``e`` times any factor).
_ALIGNED: Final = 0.99
_SIMILAR: Final = 0.5
#: Standard errors of the fit a factor must be away from 1: a fit of rounding noise is not.
_FIT_ERRORS: Final = 10.0
#: The least ``|c - 1|`` of a factor (unless 4 unit roundoffs of the dtype are more): one
#: dominant element's rounding reaches that far.
_LEAST_FACTOR: Final = 1e-3
#: The least a boundary's right side holds, and a run of wrong steps with right steps on both
#: sides: fewer values pass, or fail, by chance.
_RIGHT_ELEMENTS: Final = 8
_WINDOW_ELEMENTS: Final = 24
#: Elements compared before a candidate offset is scored in full (a cheap first look).
_PREVIEW: Final = 4096
_SHIFTS: Final = (1, -1, 2, -2)
_SHOWN: Final = 5  # coordinates, rows or moves a text or a detail lists

#: ``score(gradient_name, actual, expected)``: the error over the criterion's limit for two
#: float64 arrays of one shape (a gradient or a region of it). A score with a method
#: ``steps(name, actual, expected)`` gives every step's score (along axis 1) at once.
Score = Callable[[str, NDArray[np.float64], NDArray[np.float64]], float]

_Array = NDArray[np.float64]
_STATES: Final = ("dstate", "final_state")  # [B, H, N, N]: no step axis


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
        The kind's fields (``factor``, ``permutation``, ``pairs``, ``step``, ``offsets``,
        ``count``, ``first``, ``order``...), read-only: ints, floats, strings, None, tuples
        and mappings of them.

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
        """The finding as plain JSON-ready values: tuples become lists, mappings dicts, a
        non-finite number ``"inf"``, ``"-inf"`` or ``"nan"``, as in the records."""
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
        return float(value)
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"Finding: a detail must be a number, a string or None, got {value!r}")


def _plain(value: object) -> object:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return json_float(value) if isinstance(value, float) else value


# -- the rule --------------------------------------------------------------------------------


def _holds(base: float, undone: float, u: _Array, e: _Array) -> bool:
    """The rule, for the score ``undone`` of ``u``, an undone actual, against ``e``."""
    if undone * GAIN > base:
        return False
    if undone <= 1.0:
        return True
    # A base that is not finite can only be undone to a pass; and a fall counts only when
    # ``u`` is along ``e`` (a fall from a mere magnitude mismatch does not).
    return math.isfinite(base) and undone * FALLS <= base and _cos2(u, e) >= _ALIGNED


def _cos2(u: _Array, e: _Array) -> float:
    """``cos^2`` of the angle between ``u`` and ``e``; 0 when either is zero or not finite."""
    with np.errstate(all="ignore"):
        ue, uu, ee = float(np.vdot(u, e)), float(np.vdot(u, u)), float(np.vdot(e, e))
        cos2 = ue * ue / (uu * ee) if uu > 0 and ee > 0 else 0.0
    return cos2 if math.isfinite(cos2) else 0.0


def _scored(score: Callable[..., float], *args: Any) -> float:
    """The caller's score, a non-finite one (or an error on odd input) taken as no pass."""
    with np.errstate(all="ignore"):
        try:
            value = float(score(*args))
        except (ArithmeticError, ValueError):
            return math.inf
    return value if math.isfinite(value) else math.inf


def _f64(x: NDArray[Any]) -> _Array:
    return np.asarray(x, dtype=np.float64)


def _fit(u: _Array, e: _Array, floor: float) -> float | None:
    """The least-squares factor ``c`` of ``u ~ c * e`` when it differs from 1 by more than
    ``floor`` and :data:`_FIT_ERRORS` standard errors of the fit; else None."""
    with np.errstate(all="ignore"):
        ee = float(np.vdot(e, e))
        c = float(np.vdot(u, e)) / ee if ee > 0 else math.nan
        if not math.isfinite(c) or c == 0.0 or u.size < 2:
            return None
        resid = u - c * e
        error = math.sqrt(float(np.vdot(resid, resid)) / ((u.size - 1) * ee))
    return c if abs(c - 1.0) > max(_FIT_ERRORS * error, floor) else None


def _similar(u: _Array, e: _Array) -> bool:
    """Whether ``u`` is near ``e`` times some factor: looked at first on 4096 evenly spaced
    elements, so that a reordered view is not copied whole to say no."""
    if u.size > 2 * _PREVIEW:
        at = np.linspace(0, u.size - 1, _PREVIEW).astype(np.intp)
        if _cos2(u.flat[at], e.flat[at]) < _SIMILAR:
            return False
    return _cos2(u, e) >= _SIMILAR


class _Context:
    """The float64 region of one failing tensor that the hypotheses share."""

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
        zero_start: bool = False,
    ) -> None:
        self.name, self.a, self.e, self._score, self.base = name, a, e, score, base
        self.state_size, self.whole, self.dtype = state_size, whole, dtype
        #: Whether the first step reads a zero state (none carried).
        self.zero_start = zero_start

    @functools.cached_property
    def floor(self) -> float:
        """The least ``|c - 1|`` a fitted factor must have: more than a dominant element's
        rounding, and than the expected values' own rounding in the actual's dtype."""
        least = max(_LEAST_FACTOR, 4 * UNIT_ROUNDOFF.get(self.dtype.name, 0.0))
        with np.errstate(all="ignore"):
            rounded = self.e.astype(self.dtype).astype(np.float64)
            relative = math.sqrt(float(np.vdot(rounded - self.e, rounded - self.e))) / max(
                math.sqrt(float(np.vdot(self.e, self.e))), 1e-300
            )
        return max(least, 4 * relative) if math.isfinite(relative) else least

    def score(self, a: _Array, e: _Array) -> float:
        return _scored(self._score, self.name, a, e)

    def step_scores(self) -> _Array:
        """The score of each step of the region (its index along axis 1)."""
        steps = getattr(self._score, "steps", None)
        a, e = self.a, self.e
        if steps is None:
            return np.array([self.score(a[:, t], e[:, t]) for t in range(a.shape[1])])
        with np.errstate(all="ignore"):
            per = np.asarray(steps(self.name, a, e), dtype=np.float64)
        return np.where(np.isfinite(per), per, math.inf)

    def explain(self, u: _Array, e: _Array) -> tuple[float, float] | None:
        """``(score, factor)`` when ``u`` (an undone actual) explains the error as is or times
        a fitted constant; None when neither holds or ``e`` has too few values."""
        if np.count_nonzero(e) < _IDENTIFIED or not _similar(u, e):
            return None
        plain = self.score(u, e)
        if _holds(self.base, plain, u, e):
            return plain, 1.0
        c = _fit(u, e, self.floor)
        if c is None:
            return None
        with np.errstate(all="ignore"):
            scaled = self.score(u / c, e)
        return (scaled, c) if _holds(self.base, scaled, u, e) else None

    def finding(
        self, kind: str, text: str, result: tuple[float, float], details: Mapping[str, object]
    ) -> Finding:
        score, factor = result
        if factor != 1.0:
            text += f", and scaled by {factor:#.4g}"
        extra = {"factor": factor, "score": score, "score_before": self.base}
        return Finding(kind, self.name, text, {**details, **extra})


# -- grad_findings ---------------------------------------------------------------------------


def grad_findings(
    name: str, actual: NDArray[Any], expected: NDArray[Any], layout: GdnBackwardLayout, score: Score
) -> tuple[Finding, ...]:
    """The findings of a failing gradient ``name`` of ``layout`` (any floating dtype, read,
    never written), most specific first; ``score`` as :data:`Score`. Raises TypeError for a
    ``layout`` that is not one, ValueError for a name or shape not the layout's.

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
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "grad_findings")
    if name not in layout.names:
        raise ValueError(
            f"grad_findings: {name!r} is not a gradient of this layout; it has "
            f"{', '.join(layout.names)}"
        )
    shape = layout.shape(name)
    for what, given in (("actual", actual), ("expected", expected)):
        if not isinstance(given, np.ndarray) or given.shape != shape:
            got = getattr(given, "shape", type(given).__name__)
            raise ValueError(f"grad_findings: {what} {name} must have shape {shape}, got {got}")
    if actual.size == 0:
        return ()
    # Reductions over the whole gradient in its own dtype (no float64 copy of it): what
    # holds of every value. The hypotheses below read a float64 region of at most
    # MAX_WHOLE_ELEMENTS, converted once.
    with np.errstate(all="ignore"):
        whole = _constant(name, actual, expected) or _nonfinite(name, actual, expected)
        if whole is not None:
            return (whole,)
        if not np.isfinite(expected).all():
            return ()
    region = _leading(name, shape)
    if region is None:
        return ()
    rows, steps = region
    a, e = _f64(actual[:rows, :steps]), _f64(expected[:rows, :steps])
    base = _scored(score, name, a, e)
    if base <= 1.0:
        return ()
    ctx = _Context(
        name, a, e, score, base, layout.state_size, a.shape == shape, actual.dtype,
        zero_start=not layout.carry_state,
    )  # fmt: skip
    found = _tried(ctx, GRADIENTS)
    if not found and base <= ROUNDING_MAX:
        found.append(_rounding(name, base))
    return _ordered(found)


def _ordered(found: Iterable[Finding]) -> tuple[Finding, ...]:
    return tuple(sorted(found, key=lambda f: KINDS.index(f.kind)))


def _leading(name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The leading region the hypotheses read, at most :data:`MAX_WHOLE_ELEMENTS` elements:
    ``(rows, steps)``, its first batch rows or, when one is too many, the first steps of the
    first; None when not even one step fits."""
    size = math.prod(shape)
    per_row = size // shape[0]
    if size <= MAX_WHOLE_ELEMENTS:
        return shape[0], shape[1] if len(shape) > 1 else 0
    if per_row <= MAX_WHOLE_ELEMENTS:
        return MAX_WHOLE_ELEMENTS // per_row, shape[1]
    if name in _STATES:
        return None
    steps = MAX_WHOLE_ELEMENTS // (per_row // shape[1])
    return (1, steps) if steps else None


def _constant(name: str, actual: NDArray[Any], expected: NDArray[Any]) -> Finding | None:
    """``unwritten``: every value zero, or one finite constant, where the expected values do
    not all round to zero in the actual's dtype."""
    low, high = actual.min(), actual.max()
    if low != high or not math.isfinite(float(low)):
        return None  # a NaN or Inf everywhere is nonfinite's to name
    peak = max(float(expected.max()), -float(expected.min()))
    if not np.asarray(peak).astype(actual.dtype):
        return None  # the expected values all round to zero: zeros are right
    value = float(low)
    if value == 0.0:
        text = f"{name} is all zeros: never written? (a fresh np.empty buffer often reads as zeros)"
        return Finding("unwritten", name, text, {"value": 0.0, "how": "zeros"})
    if actual.size < 2:
        return None
    text = f"{name} is {value:.6g} everywhere: filled and never written?"
    return Finding("unwritten", name, text, {"value": value, "how": "constant"})


def _nonfinite(name: str, actual: NDArray[Any], expected: NDArray[Any]) -> Finding | None:
    """``nonfinite``: NaN or Inf where the expected value is finite, counted per step (per
    batch row for ``dstate``), with the first coordinates in that order."""
    if np.isfinite(actual).all():
        return None
    bad = ~np.isfinite(actual) & np.isfinite(expected)
    count = int(np.count_nonzero(bad))
    if not count:
        return None
    axis = 0 if name in _STATES else 1
    per = np.moveaxis(bad, axis, 0).reshape(bad.shape[axis], -1).any(axis=1)
    slabs = np.flatnonzero(per)
    first_bad: list[tuple[int, ...]] = []
    for i in slabs:
        for c in np.argwhere(np.take(bad, i, axis=axis))[: _SHOWN - len(first_bad)]:
            first_bad.append(tuple(int(x) for x in (*c[:axis], i, *c[axis:])))
        if len(first_bad) >= _SHOWN:
            break
    details: dict[str, object] = {"count": count, "first": tuple(first_bad), "spread": None}
    where = ""
    if axis == 1:
        first, last, steps = int(slabs[0]), int(slabs[-1]), per.size
        details.update(first_step=first, last_step=last)
        every = slabs.size == last - first + 1
        if every and first == 0 and last == steps - 1:
            details["spread"], where = "all", "; at every step"
        elif every and last == steps - 1:
            details["spread"], where = "later", f"; at every step from s={first} on"
        elif every and first == 0:
            details["spread"] = "earlier"
            where = (
                f"; at every step up to s={last} (carried to earlier steps from there, as "
                "the backward sweep does)"
            )
        else:
            where = f"; at {slabs.size} of {steps} steps, from s={first} to s={last}"
    coords = ", ".join(str(list(c)) for c in first_bad[:3])
    text = (
        f"{name} has {count} NaN or Inf where the expected values are finite, first at "
        f"{coords}{where}"
    )
    return Finding("nonfinite", name, text, details)


def _rounding(name: str, base: float) -> Finding:
    return Finding(
        "rounding",
        name,
        # Past the limit, so not a correct kernel's rounding: say what was measured, no cause.
        f"{name}'s error is {base:.3g} x the limit, with no structure found",
        {"score": base},
    )


# -- the hypotheses on the float64 region ----------------------------------------------------


def _unit(name: str) -> tuple[str, str]:
    """What axis 1 counts and its index's letter: steps ``t``, or the chunks ``c`` of ``h``
    and ``dh``."""
    return ("chunk", "c") if name in ("h", "dh") else ("step", "t")


def _shown(items: Sequence[object], sep: str = ", ") -> str:
    return sep.join(map(str, items[:_SHOWN])) + (f"{sep}..." if len(items) > _SHOWN else "")


def _zero_rows(ctx: _Context) -> Finding | None:
    """``unwritten``: the failing batch rows that are all zeros where the op's are not (on
    values that do not round to zero in the actual's dtype), when other rows are not."""
    a, e = ctx.a, ctx.e
    if not a.any():
        return None  # no row to set them apart from
    with np.errstate(all="ignore"):
        zero = [
            r
            for r in range(a.shape[0])
            if not a[r].any()
            and np.count_nonzero(e[r].astype(ctx.dtype)) >= _IDENTIFIED
            and ctx.score(a[r], e[r]) > 1.0
        ]
    if not zero:
        return None
    many = len(zero) > 1
    text = (
        f"{ctx.name}'s batch row{'s' if many else ''} {_shown(zero)} {'are' if many else 'is'} "
        "all zeros where the op's are not: never written?"
    )
    details: dict[str, object] = {"value": 0.0, "how": "rows", "rows": tuple(zero)}
    if ctx.name == "dstate":
        text += " (or the batch rows run as one sequence, which has one initial state)"
        details["or_reading"] = "batch_folded"
    return Finding("unwritten", ctx.name, text, details)


def _transpose(ctx: _Context) -> Finding | None:
    a = ctx.a
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or a.shape[-1] < 2:
        return None
    result = ctx.explain(np.swapaxes(a, -1, -2), ctx.e)
    if result is None:
        return None
    axes = gradient_axes(ctx.name, a.ndim)
    lead, x, y = ", ".join(axes[:-2]), axes[-2], axes[-1]
    text = (
        f"{ctx.name} holds its transpose: {ctx.name}[{lead}, {x}, {y}] is expected[{lead}, "
        f"{y}, {x}]"
    )
    if ctx.name in ("h", "dh", "final_state"):
        text += " (a state kept as [V, K]?)"
    return ctx.finding("transpose", text, result, {"axes": (a.ndim - 2, a.ndim - 1)})


def _permutation(a: _Array, e: _Array, axis: int) -> NDArray[np.intp] | None:
    """``perm`` with ``a``'s index ``i`` along ``axis`` closest to ``e``'s ``perm[i]`` up to a
    factor (least ``1 - cos^2``), when that is a permutation other than the identity."""
    k = a.shape[axis]
    am = np.moveaxis(a, axis, 0).reshape(k, -1)
    em = np.moveaxis(e, axis, 0).reshape(k, -1)
    with np.errstate(all="ignore"):
        na, ne = np.einsum("ij,ij->i", am, am), np.einsum("ij,ij->i", em, em)
        rel = 1.0 - (am @ em.T) ** 2 / np.outer(na, ne)
    rel[~np.isfinite(rel)] = 1.0
    stay = np.arange(k)
    perm = np.argmin(rel, axis=1)
    perm = np.where(rel[stay, stay] <= rel[stay, perm], stay, perm)  # ties stay
    if np.array_equal(perm, stay) or not np.array_equal(np.sort(perm), stay):
        return None
    return perm


def _permuted(ctx: _Context) -> Finding | None:
    """``heads`` or ``batch``: a permutation of that axis (batch rows only when the region
    holds them all)."""
    axes = [(1 if ctx.name in _STATES else 2, "head", "heads")]
    if ctx.whole:
        axes.append((0, "batch element", "batch"))
    for axis, one, kind in axes:
        if ctx.a.shape[axis] < 2:
            continue
        perm = _permutation(ctx.a, ctx.e, axis)
        result = (
            None if perm is None else ctx.explain(np.take(ctx.a, np.argsort(perm), axis), ctx.e)
        )
        if perm is None or result is None:
            continue
        many = "heads" if kind == "heads" else "batch elements"
        pairs = tuple((i, int(p)) for i, p in enumerate(perm) if i < p and perm[p] == i)
        swapped = {i for pair in pairs for i in pair}
        words = [f"{many} {i} and {j} exchanged" for i, j in pairs]
        words += [f"{one} {i} holds {one} {p}'s values" for i, p in enumerate(perm)
                  if i != p and i not in swapped]  # fmt: skip
        text = f"{ctx.name}'s {many} are permuted: {_shown(words, '; ')}"
        moved = int(np.count_nonzero(perm != np.arange(perm.size)))
        return ctx.finding(
            kind, text, result, {"permutation": perm, "pairs": pairs, "moved": moved}
        )
    return None


def _best(ctx: _Context, tried: Iterable[tuple[Any, _Array, _Array]]) -> tuple[Any, Any] | None:
    """The undoing that explains the error with the least score, the first on a tie."""
    best = None
    for key, u, e in tried:
        result = ctx.explain(u, e)
        if result is not None and (best is None or result[0] < best[1][0]):
            best = (key, result)
    return best


def _shift(ctx: _Context) -> Finding | None:
    """``actual[:, t] == expected[:, t - k]`` on the steps both have."""
    if ctx.name in _STATES:
        return None
    a, e, steps = ctx.a, ctx.e, ctx.a.shape[1]
    tried = (
        (k, *((a[:, k:], e[:, : steps - k]) if k > 0 else (a[:, :k], e[:, -k:])))
        for k in _SHIFTS
        if steps - abs(k) >= 1 and steps >= 2
    )
    best = _best(ctx, ((k, u, ref) for k, u, ref in tried if np.any(ref)))
    if best is None:
        return None
    k, result = best
    unit, i = _unit(ctx.name)
    text = (
        f"{ctx.name} is expected shifted by {k:+d} {unit}{'s' if abs(k) > 1 else ''} along "
        f"{'c' if unit == 'chunk' else 's'}: {ctx.name}[:, {i}] holds expected[:, {i}{-k:+d}]"
    )
    if unit == "chunk" and k == -1:  # the state leaving chunk c, not the one entering it
        what = "the cotangent of the state" if ctx.name == "dh" else "the state"
        text += f" ({what} leaving chunk {i}, as another library keeps it?)"
    details: dict[str, object] = {"step": k}
    if ctx.name == "dg" and abs(k) == 1:  # the misreading gate_shift, where gates are equal
        text += (
            f" (dg stored a step off, or the gate read one step {'late' if k == -1 else 'early'}"
            ": where the gates are equal, only dg shows that)"
        )
        details["or_reading"] = "gate_shift"
    return ctx.finding("shift", text, result, details)


def _scale_hints(c: float, n: int) -> list[tuple[str, str]]:
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
    return [
        (label, hint) for value, label, hint in named if value != 1 and abs(c / value - 1) <= 0.01
    ]


def _scale(ctx: _Context) -> Finding | None:
    """``actual = c * expected``, named with the factors a port gets wrong."""
    if np.count_nonzero(ctx.e) < _IDENTIFIED or not _similar(ctx.a, ctx.e):
        return None
    c = _fit(ctx.a, ctx.e, ctx.floor)
    if c is None:
        return None
    with np.errstate(all="ignore"):
        undone = ctx.score(ctx.a / c, ctx.e)
    if not _holds(ctx.base, undone, ctx.a, ctx.e):
        return None
    hints = _scale_hints(c, ctx.state_size) if ctx.state_size > 0 else []
    text = f"{ctx.name} is {c:#.4g} x expected"
    if hints:
        text += " (" + " or ".join(hint for _, hint in hints) + ")"
    details = {"factor": c, "named": tuple(label for label, _ in hints), "score": undone}
    return Finding("scale", ctx.name, text, {**details, "score_before": ctx.base})


def _axes(ctx: _Context) -> Finding | None:
    """The values written in another axis order, read back in C order."""
    a, e = ctx.a, ctx.e
    shape, nd = a.shape, a.ndim
    names = [x.upper() for x in gradient_axes(ctx.name, nd)]
    seen = {tuple(i for i in range(nd) if shape[i] > 1)}
    if nd >= 2 and shape[-1] == shape[-2]:  # the transpose kind's
        seen.add(tuple(i for i in (*range(nd - 2), nd - 1, nd - 2) if shape[i] > 1))
    tried = []
    for order in itertools.permutations(range(nd)):
        key = tuple(i for i in order if shape[i] > 1)
        if (not ctx.whole and order[0] != 0) or key in seen:
            continue  # a region of the first rows: b stays first
        seen.add(key)
        written = a.reshape(tuple(shape[i] for i in order))
        tried.append((order, written.transpose(np.argsort(order)), e))
    best = _best(ctx, tried)
    if best is None:
        return None
    order, result = best
    got = ", ".join(names[i] for i in order)
    text = f"{ctx.name} holds its values in the order [{got}], not [{', '.join(names)}]"
    return ctx.finding("axes", text, result, {"order": tuple(names[i] for i in order)})


def _boundary(ctx: _Context) -> Finding | None:
    """The failing steps one run, right before and after it: wrong from a step on, before a
    step, or only from one step to another (a state not carried across a step: its error
    fades with the decay on either side; the step named where the error starts or stops by
    :data:`FALLS`). The wrong part scores past rounding's reach and :data:`FALLS` times the
    right part, which passes."""
    if ctx.name in _STATES or ctx.a.shape[1] < 2:
        return None
    a, steps = ctx.a, ctx.a.shape[1]
    per = ctx.step_scores()
    fail = per > 1.0
    failing = np.flatnonzero(fail)
    if failing.size in (0, steps):
        return None
    lo, hi = int(failing[0]), int(failing[-1])
    every = np.arange(steps)
    inside = (every >= lo) & (every <= hi)
    right, wrong = every[~inside], every[inside]
    if hi == steps - 1 or lo == 0:
        side, t0 = ("from", lo) if lo > 0 else ("before", hi + 1)
        # One wrong step is one wrong place, not a side of a boundary.
        if wrong.size < 2 or np.count_nonzero(fail[wrong]) < 0.9 * wrong.size:
            return None
    else:
        side, t0 = "window", None
        if wrong.size < 3 or wrong.size * 2 > steps or failing.size < 0.75 * wrong.size:
            return None
        if a[:, wrong].size < _WINDOW_ELEMENTS:
            return None
    e_right = ctx.e[:, right]
    if e_right.size < _RIGHT_ELEMENTS or not np.any(e_right):
        return None
    s_right = ctx.score(a[:, right], e_right)
    s_wrong = ctx.score(a[:, wrong], ctx.e[:, wrong])
    # Wrong past rounding's reach: a chunked float32 form's own error steps up at a chunk
    # boundary too, within a few times its limit.
    if s_right > 1.0 or s_wrong <= ROUNDING_MAX or s_wrong < FALLS * s_right:
        return None
    unit, _ = _unit(ctx.name)
    count = f"{'C' if unit == 'chunk' else 'S'}={steps}"
    details: dict[str, object] = {
        "step": t0, "side": side, "count": int(failing.size),
        "score_right": s_right, "score_wrong": s_wrong,
    }  # fmt: skip
    if side == "window":
        worst = int(lo + np.argmax(per[lo : hi + 1]))
        near = per[worst] / FALLS  # an abrupt edge next to the worst, not a fading tail's end
        if lo > 0 and per[lo] >= max(near, FALLS * per[lo - 1]):
            t0 = lo
        elif per[hi] >= max(near, FALLS * per[hi + 1]):
            t0 = hi + 1
        seen = (
            f"{ctx.name} is wrong only from {unit} {lo} to {unit} {hi} ({count}), worst at "
            f"{unit} {worst}, and right elsewhere"
        )
        if t0 is None:
            text = seen + ": a state not carried across a step there?"
        else:
            text = seen + f"; it jumps at step {t0}: a state not carried across step {t0}?"
        details.update(step=t0, first=lo, last=hi, worst=worst, seen=seen)
        return Finding("boundary", ctx.name, text, details)
    if side == "from" and t0 == 1 and unit == "step" and ctx.zero_start:
        # Step 0 reads a zero state: a wrong term that reads the state vanishes there.
        text = (
            f"{ctx.name} is right at step 0 alone, where the state it reads is still zero "
            f"(none carried), and wrong from step 1 on ({count}): a term that reads the "
            "state before the step wrong?"
        )
        return Finding("boundary", ctx.name, text, {**details, "step": None, "side": "zero state"})
    if side == "before" and per[hi] < FALLS * per[hi + 1]:
        # No edge: an error from the first step that fades with the decay, as that of the
        # initial state does; where it passes under the limit is no boundary.
        seen = (
            f"{ctx.name} is wrong from the first {unit} on and its error fades, within the "
            f"limit from {unit} {t0} on ({count})"
        )
        if ctx.zero_start:
            seen += ", as one made in the first steps does with the decay"
            text = seen
        else:
            text = seen + ": the initial state, or how it is read, wrong? (its effect fades "
            text += "with the decay)"
        details.update(step=None, side="fades", until=t0, seen=seen)
        return Finding("boundary", ctx.name, text, details)
    assert t0 is not None  # a side's step
    if side == "from":
        seen = f"{ctx.name} is right before {unit} {t0} and wrong from {unit} {t0} on ({count})"
        text = seen
        if unit == "step" and t0 >= 8 and t0 & (t0 - 1) == 0:
            text += f": the second chunk, with chunks of {t0}?"
    else:
        seen = f"{ctx.name} is wrong before {unit} {t0} and right from {unit} {t0} on ({count})"
        text = seen
    zeros = not np.any(a[:, wrong])
    if zeros:
        text += "; all zeros there"
    return Finding("boundary", ctx.name, text, {**details, "zeros": zeros, "seen": seen})


def _rows(ctx: _Context) -> Finding | None:
    """``batch`` (states only): the batch rows that fail, when some pass."""
    a, e = ctx.a, ctx.e
    if a.shape[0] < 2 or np.count_nonzero(e) < _IDENTIFIED:
        return None
    failing = [r for r in range(a.shape[0]) if ctx.score(a[r], e[r]) > 1.0]
    if not failing or len(failing) == a.shape[0]:
        return None
    many = "s" if len(failing) > 1 else ""
    text = f"{ctx.name} fails in batch row{many} {_shown(failing)} of {a.shape[0]}"
    return Finding("batch", ctx.name, text, {"rows": tuple(failing), "count": a.shape[0]})


class Hypothesis(NamedTuple):
    """One kind of bug a failing tensor is tried for: ``test`` undoes it on the float64
    region and words what holds, or returns None; ``reads``: ``"both"``, ``"gradients"`` or
    ``"states"`` (``y``, ``h``, ``dh``, ``final_state``)."""

    kind: str
    test: Callable[[_Context], Finding | None]
    reads: str = "both"


#: Every hypothesis a failing gradient or state is tried for, in order, after the whole
#: tensor's ``unwritten`` and ``nonfinite`` (the buffer's ``layout`` and the case's
#: ``misreading`` and ``overflow`` are tried on the whole).
HYPOTHESES: Final = (
    Hypothesis("unwritten", _zero_rows),
    Hypothesis("transpose", _transpose),
    Hypothesis("heads", _permuted),
    Hypothesis("shift", _shift),
    Hypothesis("scale", _scale),
    Hypothesis("axes", _axes, "gradients"),
    Hypothesis("boundary", _boundary),
    Hypothesis("batch", _rows, "states"),
)
GRADIENTS: Final = tuple(h for h in HYPOTHESES if h.reads != "states")
STATES: Final = tuple(h for h in HYPOTHESES if h.reads != "gradients")


def _tried(ctx: _Context, hypotheses: tuple[Hypothesis, ...]) -> list[Finding]:
    """The findings of ``hypotheses``, until one leaves the tensor passing."""
    found: list[Finding] = []
    for hypothesis in hypotheses:
        finding = hypothesis.test(ctx)
        if finding is not None:
            found.append(finding)
            score = finding.details.get("score")
            if isinstance(score, float) and score <= 1.0:
                break
    return found


# -- the tensors besides the gradients: y and the states ---------------------------------------


def tensor_findings(
    name: str,
    actual: NDArray[Any],
    expected: NDArray[Any],
    score: Callable[[_Array, _Array], float],
) -> tuple[Finding, ...]:
    """What explains a failing ``y``, ``h``, ``dh`` or ``final_state`` (``name``): the
    hypotheses of :data:`HYPOTHESES` that read states; ``score(actual, expected)`` is the
    tensor's criterion on float64 arrays of one shape. Along axis 1 ``h`` and ``dh`` count
    chunks.

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
        return _ordered(_tried(ctx, STATES))


# -- the packed buffer -----------------------------------------------------------------------


def buffer_findings(
    actual_flat: NDArray[Any],
    expected_flat: NDArray[Any],
    layout: GdnBackwardLayout,
    score: Score,
) -> tuple[Finding, ...]:
    """The ``layout`` finding of a packed buffer: gradients found at other offsets (where
    the other gate mode's layout puts them, or another order of the segments), by the rule
    of the module docstring. A pass of its own over the buffer (it reads the kernel's values
    where no gradient of the layout sits), a segment at a time in float64, on at most
    :data:`MAX_WHOLE_ELEMENTS` of it. Raises as :func:`grad_findings` does, and ValueError
    for a buffer not 1-D of ``layout.total_elems``.

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
        region = None if seg.length == 0 else _leading(seg.name, seg.shape)
        if region is None:
            continue
        shape = seg.shape if len(seg.shape) == 1 else (*region, *seg.shape[2:])
        count = math.prod(shape)
        e = _f64(expected_flat[seg.offset : seg.offset + count]).reshape(shape)
        base = _scored(
            score, seg.name, _f64(actual_flat[seg.offset : seg.offset + count]).reshape(shape), e
        )
        if base <= 1.0:
            found[seg.name] = seg.offset
            continue
        if np.count_nonzero(e) < _IDENTIFIED:
            continue  # a few values turn up at some offset by chance: not looked for
        best: tuple[float, int] | None = None
        for offset in _candidates(seg, segments, other, total):
            part = actual_flat[offset : offset + count]
            head, ref = _f64(part[:_PREVIEW]), e.reshape(-1)[:_PREVIEW]
            with np.errstate(all="ignore"):  # a cheap look at the first elements first
                norm = float(np.sqrt(np.mean(ref * ref)))
                if not np.isfinite(head).all() or (
                    norm > 0 and float(np.sqrt(np.mean((head - ref) ** 2))) > 0.5 * norm
                ):
                    continue
            a = _f64(part).reshape(shape)
            if not np.isfinite(a).all():
                continue
            s = _scored(score, seg.name, a, e)
            if _holds(base, s, a, e) and (best is None or s < best[0]):
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


def _candidates(
    seg: Segment, segments: Sequence[Segment], other: GdnBackwardLayout, total: int
) -> list[int]:
    """Where else a segment may sit: the other gate mode's offset, and every sum of the other
    segments' lengths (its offset in some order of the segments)."""
    rest = [s.length for s in segments if s.name != seg.name]
    offsets = {sum(sub) for r in range(len(rest) + 1) for sub in itertools.combinations(rest, r)}
    if seg.name in other.names:
        offsets.add(other.segment(seg.name).offset)
    return sorted(o for o in offsets if o != seg.offset and o + seg.length <= total)


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
    elif {n for pair in pairs for n in pair} == set(moved):
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
    """What a packed buffer of ``elems`` elements, where ``layout`` wants another number,
    fits: the layouts of the same ``B, S, H, N`` in the other gate and state modes; else a
    buffer that ends where a gradient starts; else twice or half the length. One ``layout``
    finding (details ``elems``, ``expected``, ``layouts``, ``ends_before``, ``factor``) or
    none; TypeError for a ``layout`` that is not one.

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
    elems, total = int(elems), layout.total_elems
    if elems == total:
        return ()
    fits: list[GdnBackwardLayout] = []
    words: list[str] = []
    for per_channel, carry in itertools.product((False, True), repeat=2):
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

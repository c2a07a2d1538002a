"""The criteria a gradient is judged by, as one type: :class:`Criterion`.

Elementwise tolerances (``numpy.isclose``'s), an RMS ratio (flash-linear-attention's), both,
or the calibrated criterion: a correct kernel differs from the float64 truth by its
precision's rounding, whose *floors* a fixture measures (:mod:`gdn_layout.check._floors`).
The calibrated criterion for an actual buffer whose (less precise) dtype is ``d`` passes a
gradient when both its RMS error and its largest error are at most :data:`K` (16 for float32,
8 for float16 and bfloat16, 64 for float64, whose truth has float64's rounding too) times the
floor for ``d`` times ``rms(expected)``.

float64's floors are float32's scaled by the ratio of their unit roundoffs, ``2**-29``: to
first order the rounding error of one order of operations is proportional to the unit
roundoff, and a float32 floor measured on float32 inputs is the arithmetic's alone (on
float64 inputs it also holds their rounding to float32, which only makes it larger).

Each floor, as an error, is taken no lower than half of ``d``'s unit roundoff
(half its machine epsilon) times the *scale of the terms* that form the gradient, where that
scale is larger than ``rms(expected)``. A gradient can be far below its terms: ``dg`` is
exactly 0 at a sequence's first step without a carried state, and of order ``exp(g)`` under
extreme decay, while chunked kernels form it as ``q . dq - k . dk``, a difference of terms of
order 1 whose rounding is of order ``u`` (``term_scales``). Judged against its own RMS such
a gradient would allow no rounding at all; judged against its terms, it allows what rounding
there produces, and a real error is still orders of magnitude above it. Fixtures without
floors fall back to :data:`DEFAULT_FLOORS`.

Changing a criterion changes this module alone: its limits, its verdict (:meth:`Criterion.
passes`), its words in a report (:meth:`Criterion.facts`) and in a picture
(:meth:`Criterion.title`), and its score for the findings (:meth:`Criterion.score`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import numpy as np
from numpy.typing import NDArray

from .._dtypes import UNIT_ROUNDOFF
from .._norms import finite_rms, rms_rows
from .._tables import fmt_float
from ..layout import GRADIENT_NAMES

__all__ = [
    "CALIBRATED_DTYPES",
    "DEFAULT_FLOORS",
    "DEFAULT_TOLERANCES",
    "FLOOR_DTYPES",
    "Criterion",
    "Floors",
    "K",
    "Mode",
    "Tolerance",
    "checked_floors",
    "floor_for",
    "least_precise",
    "per_grad",
    "row_scores",
    "step_scores",
]

#: A gradient's floors by dtype name, then gradient name: ``(rms, max)``.
Floors = Mapping[str, Mapping[str, tuple[float, float]]]
Number = float | np.floating[Any] | np.integer[Any]
#: A tolerance for every gradient, or a mapping from gradient name to its tolerance.
Tolerance = Number | Mapping[str, Number]

#: The dtypes a fixture measures floors for.
FLOOR_DTYPES: Final = ("float32", "float16", "bfloat16")
#: The dtypes the calibrated criterion judges: float64's floors are float32's, scaled.
CALIBRATED_DTYPES: Final = (*FLOOR_DTYPES, "float64")
#: How far above its floor a correct kernel's error may be, by dtype: float32's floor is the
#: error of one order of operations (the spec's, step by step), which another correct order
#: has been measured to exceed 12-fold on a gradient of one element; float16's and bfloat16's
#: are the output's rounding, which every correct kernel shares (measured at most 2x).
#: float64's truth is itself a float64 computation, whose own error adds to the kernel's:
#: over two 264-case suites, the reference against an extended-precision oracle reaches 17.8x
#: the floor and the float64 step-by-step form against the reference 20.3x, both on a dbeta
#: of one element whose floor is the least one; so its factor is 64.
#: benchmarks/README.md has the figures.
K: Final = {"float32": 16.0, "float16": 8.0, "bfloat16": 8.0, "float64": 64.0}
#: Floors for fixtures that carry none: ``(rms, max)`` for every gradient, the largest measured
#: over the first four regimes of the standard suite (float32 inputs), rounded up, when floors
#: came from the chunked form; the step-by-step floors measured since are all below them.
#: float64's are float32's, scaled like measured ones.
DEFAULT_FLOORS: Final = {
    "float32": (6e-5, 2e-4),
    "float16": (1e-3, 1e-2),
    "bfloat16": (4e-3, 5e-2),
    "float64": (6e-5 * 2.0**-29, 2e-4 * 2.0**-29),
}


def checked_floors(
    value: object, where: str, names: tuple[str, ...] = GRADIENT_NAMES
) -> dict[str, dict[str, tuple[float, float]]]:
    """``value`` as floors: ``{dtype: {name: (rms, max)}}`` for tensors among ``names`` (the
    gradients), each figure a finite number >= 0. A floor of inf, or one that is not a number,
    would let any error pass."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where} must be a mapping {{dtype: {{gradient: (rms, max)}}}}, "
            f"got {type(value).__name__}"
        )
    floors: dict[str, dict[str, tuple[float, float]]] = {}
    for dtype, per in value.items():
        if dtype not in FLOOR_DTYPES:
            raise ValueError(f"{where}: unknown dtype {dtype!r}; expected among {FLOOR_DTYPES}")
        if not isinstance(per, Mapping):
            raise TypeError(f"{where}[{dtype!r}] must be a mapping, got {type(per).__name__}")
        parsed = {}
        for grad, pair in per.items():
            if grad not in names or not _is_floor(pair):
                raise ValueError(
                    f"{where}[{dtype!r}][{grad!r}] must be (rms, max) for a tensor among "
                    f"{', '.join(names)}, two finite numbers >= 0; got {pair!r}"
                )
            parsed[grad] = (float(pair[0]), float(pair[1]))
        floors[dtype] = parsed
    return floors


def _is_floor(pair: object) -> bool:
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        return False
    numbers_only = all(
        isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) for x in pair
    )
    return numbers_only and all(math.isfinite(float(x)) and float(x) >= 0 for x in pair)


def floor_for(floors: Floors | None, dtype: str, grad: str) -> tuple[float, float]:
    """The ``(rms, max)`` floor used for gradient ``grad`` judged in ``dtype`` (one of
    :data:`CALIBRATED_DTYPES`): the measured one when ``floors`` has it (for float64, the
    float32 one times ``2**-29``), else :data:`DEFAULT_FLOORS`; never below half the unit
    roundoff."""
    source = "float32" if dtype == "float64" else dtype
    measured = (floors or {}).get(source, {}).get(grad)
    if measured is None:
        rms, peak = DEFAULT_FLOORS[dtype]
    else:
        factor = UNIT_ROUNDOFF[dtype] / UNIT_ROUNDOFF[source]
        rms, peak = measured[0] * factor, measured[1] * factor
    least = UNIT_ROUNDOFF[dtype] / 2
    return (max(rms, least), max(peak, least))


Mode = Literal["elementwise", "rms", "both", "calibrated"]


class _Judged(Protocol):
    """What a criterion reads of a comparison's figures to word its verdict."""

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def passed(self) -> bool: ...
    @property
    def rms_ratio(self) -> float: ...
    @property
    def max_abs_error(self) -> float: ...
    @property
    def mismatches(self) -> int: ...
    @property
    def nonfinite_mismatches(self) -> int: ...
    @property
    def worst(self) -> tuple[int, ...] | None: ...
    @property
    def worst_expected(self) -> float | None: ...
    @property
    def error_floor_ratio(self) -> float | None: ...


@dataclass(frozen=True)
class Criterion:
    """How one gradient is judged: its limits, its verdict, and the words that state them.

    A :class:`~gdn_layout.GradComparison` keeps the one it was judged by as
    :attr:`~gdn_layout.GradComparison.judged_by`; :func:`~gdn_layout.compare` makes it with
    :meth:`tolerances` (``rtol``, ``atol`` or ``max_rms_ratio`` given) or :meth:`calibrated`.

    Attributes
    ----------
    mode : {"elementwise", "rms", "both", "calibrated"}
        Elementwise tolerances, the RMS ratio alone, both, or the calibrated floors.
    rtol, atol : float
        The elementwise tolerances; calibrated: 0 and the largest error of one element allowed.
    max_rms_ratio : float or None
        The largest ``rms(a - e) / rms(e)`` allowed, or None.
    floor : (float, float) or None
        Calibrated: the ``(rms, max)`` floors relative to ``rms(expected)``.
    dtype : str or None
        Calibrated: the dtype the floors are for, the less precise of the two buffers'.
    scale : float
        Calibrated: ``rms(expected)``, the finite values'.
    least : float
        Calibrated: the least error either floor stands for, half the unit roundoff times the
        larger of ``scale`` and the terms' scale.
    term_scale : float or None
        Calibrated: the scale of the gradient's terms, when it set ``least``.

    See Also
    --------
    compare : Judges each gradient by one.
    Fixture : Its floors (``Fixture.floors``).

    Examples
    --------
    >>> import numpy as np
    >>> Criterion.tolerances(1e-4, 1e-6).words
    'rtol=0.0001 atol=1e-06'
    >>> c = Criterion.calibrated(None, "float32", "dq", np.ones(8))
    >>> c.words, c.floor, c.limit
    ('error/floor<=16 (float32)', (6e-05, 0.0002), 16.0)
    >>> c.score(np.ones(8) * (1 + 1e-6), np.ones(8)) < 1  # within the limit
    True
    """

    mode: Mode
    rtol: float = 0.0
    atol: float = 0.0
    max_rms_ratio: float | None = None
    floor: tuple[float, float] | None = None
    dtype: str | None = None
    scale: float = 0.0
    least: float = 0.0
    term_scale: float | None = None

    @classmethod
    def tolerances(
        cls,
        rtol: float,
        atol: float,
        max_rms_ratio: float | None = None,
        *,
        elementwise: bool = True,
    ) -> Criterion:
        """Elementwise tolerances (``numpy.isclose``'s), an RMS ratio, or both."""
        if max_rms_ratio is None:
            mode: Mode = "elementwise"
        else:
            mode = "both" if elementwise else "rms"
        return cls(mode, rtol, atol, max_rms_ratio)

    @classmethod
    def calibrated(
        cls,
        floors: Floors | None,
        judged: str,
        grad: str,
        expected: NDArray[Any],
        term_scale: float | None = None,
    ) -> Criterion:
        """The calibrated criterion of gradient ``grad`` judged in ``judged``: RMS error and
        largest error within :data:`K` times its floors, no floor below half the unit roundoff
        times the larger of rms(expected) and ``term_scale``."""
        scale = finite_rms(expected)
        # A kernel stores float16 or bfloat16 but computes in float32: its terms round so.
        by_scale = UNIT_ROUNDOFF[judged] / 2 * scale
        by_terms = UNIT_ROUNDOFF[_compute_dtype(judged)] / 2 * (term_scale or 0.0)
        floor = floor_for(floors, judged, grad)
        k = K[judged]
        rms_error = max(floor[0] * scale, by_scale, by_terms)
        return cls(
            "calibrated",
            rtol=0.0,
            atol=k * max(floor[1] * scale, by_scale, by_terms),
            max_rms_ratio=k * rms_error / scale if scale > 0 else math.inf,
            floor=floor,
            dtype=judged,
            scale=scale,
            least=max(by_scale, by_terms),
            term_scale=term_scale if by_terms > by_scale else None,
        )

    @property
    def counts_elements(self) -> bool:
        """Whether elements are counted against ``rtol``/``atol``: all but the RMS alone."""
        return self.mode != "rms"

    @property
    def limit(self) -> float:
        """The calibrated bound on ``error_floor_ratio``, :data:`K` of the dtype; else NaN."""
        return K.get(self.dtype or "", math.nan)

    @property
    def errors(self) -> tuple[float, float]:
        """The calibrated floors as errors: ``(rms, max)`` of ``a - e`` that rounding accounts
        for; ``(0, 0)`` for other criteria."""
        if self.floor is None:
            return (0.0, 0.0)
        return (
            max(self.floor[0] * self.scale, self.least),
            max(self.floor[1] * self.scale, self.least),
        )

    def ratio(self, rms_ratio: float, max_abs_error: float) -> float | None:
        """The larger of the RMS error and the largest error, each over its floor; None for a
        criterion that is not calibrated."""
        if self.floor is None:
            return None
        if math.isnan(rms_ratio) or math.isnan(max_abs_error):
            return math.nan
        rms_floor, max_floor = self.errors
        if max_floor == 0:
            return 0.0 if max_abs_error == 0 else math.inf
        by_max = max_abs_error / max_floor
        if self.scale == 0:  # the RMS error is at most the largest one, and the floors agree
            return by_max
        return max(rms_ratio * self.scale / rms_floor, by_max)

    def passes(
        self, rms_ratio: float, max_abs_error: float, mismatches: int, nonfinite: int
    ) -> bool:
        """The verdict on a gradient's figures."""
        passed = nonfinite == 0 and mismatches == 0
        if self.max_rms_ratio is not None:
            passed = passed and rms_ratio <= self.max_rms_ratio
        ratio = self.ratio(rms_ratio, max_abs_error)
        return passed and (ratio is None or ratio <= self.limit)  # calibrated: the ratio's

    @property
    def words(self) -> str:
        """The criterion in words, e.g. ``"rtol=1e-05 atol=1e-08"``."""
        if self.mode == "calibrated":
            return f"error/floor<={self.limit:g} ({self.dtype})"
        tolerances = f"rtol={self.rtol:.3g} atol={self.atol:.3g}"
        if self.max_rms_ratio is None:
            return tolerances
        rms = f"rms ratio<={self.max_rms_ratio:.3g}"
        return f"{tolerances} {rms}" if self.mode == "both" else rms

    def facts(self, grad: _Judged) -> list[str]:
        """Why ``grad`` passes or fails, in the words of a report's line."""
        if self.floor is not None:
            ratio = grad.error_floor_ratio
            verb = "<=" if ratio is not None and ratio <= self.limit else ">"
            terms = (
                ""
                if self.term_scale is None
                else f", none below {UNIT_ROUNDOFF[_compute_dtype(self.dtype or '')] / 2:.3g} x "
                f"{self.term_scale:.3g}, the scale of its terms"
            )
            return [
                f"error/floor {fmt_float(ratio)} {verb} {self.limit:g} "
                f"(floors for {self.dtype}: rms ratio {self.floor[0]:.3g}, "
                f"max error {self.floor[1]:.3g} x rms(expected){terms}); "
                f"{grad.mismatches} of {grad.size} over the max error"
            ]
        facts = []
        if self.counts_elements:
            e = grad.worst_expected
            allowed = self.atol + self.rtol * abs(e) if e is not None and math.isfinite(e) else 0.0
            facts.append(
                f"{grad.mismatches} of {grad.size} out of tolerance "
                f"(|a-e| <= {self.atol:.3g} + {self.rtol:.3g}*|e|; here {allowed:.3g})"
            )
        if self.max_rms_ratio is not None:
            verb = "<=" if grad.rms_ratio <= self.max_rms_ratio else ">"
            facts.append(f"rms ratio {grad.rms_ratio:.3g} {verb} {self.max_rms_ratio:.3g}")
        return facts

    def title(self, grad: _Judged) -> str:
        """The verdict as a picture's title says it, e.g. ``"dk FAIL: 3 of 48 out"``."""
        ratio = f"error/floor {fmt_float(grad.error_floor_ratio)} > {self.limit:g}"
        if grad.passed:
            return f"{grad.name} ok: max |a-e| {fmt_float(grad.max_abs_error)}"
        if self.counts_elements and grad.mismatches:
            head = f"{grad.name} FAIL: {grad.mismatches} of {grad.size} out"
            if grad.worst is not None:
                head += f", worst [{', '.join(map(str, grad.worst))}]"
            return head + (f"\n{ratio}" if self.floor is not None else "")
        if grad.nonfinite_mismatches:
            n = grad.nonfinite_mismatches
            return f"{grad.name} FAIL: {n} NaN/Inf mismatch{'' if n == 1 else 'es'}"
        if self.floor is not None:
            return f"{grad.name} FAIL: {ratio}"
        return f"{grad.name} FAIL: rms ratio {fmt_float(grad.rms_ratio)} > {self.max_rms_ratio:.3g}"

    def score(self, actual: NDArray[Any], expected: NDArray[Any]) -> float:
        """The error of ``actual`` against ``expected`` (any two arrays of one shape: a
        gradient, or a part of one) over what this criterion allows: at most 1 passes.

        Calibrated, the RMS error and the largest error over ``K`` times the floors (as
        errors of the whole gradient); elementwise, the largest ``|a - e|`` over ``atol +
        rtol * |e|``; by RMS ratio, ``rms(a - e) / rms(e)`` over its limit. Non-finite
        values score ``inf``."""
        a = np.asarray(actual, np.float64).reshape(1, -1)
        e = np.asarray(expected, np.float64).reshape(1, -1)
        return float(row_scores(self, a, e)[0])


def row_scores(
    criterion: Criterion, actual: NDArray[np.float64], expected: NDArray[np.float64]
) -> NDArray[np.float64]:
    """:meth:`Criterion.score` of each row of two ``[n, m]`` float64 arrays at once: what
    the findings' per-step scores need, in a few passes rather than ``n`` calls."""
    c = criterion
    n, m = actual.shape
    if m == 0:
        return np.zeros(n)
    with np.errstate(all="ignore"):
        finite = np.isfinite(actual).all(axis=1) & np.isfinite(expected).all(axis=1)
        err = np.abs(actual - expected)
        if c.floor is not None:
            rms_floor, max_floor = c.errors
            peak = err.max(axis=1)
            by_max = _over(peak, c.limit * max_floor)
            scores = np.fmax(by_max, _over(rms_rows(err, peak), c.limit * rms_floor))
        else:
            parts = []
            if c.counts_elements:
                parts.append(np.max(_over(err, c.atol + c.rtol * np.abs(expected)), axis=1))
            if c.max_rms_ratio is not None:
                magnitude = np.abs(expected)
                allowed = c.max_rms_ratio * rms_rows(magnitude, magnitude.max(axis=1))
                parts.append(_over(rms_rows(err, err.max(axis=1)), allowed))
            scores = np.fmax.reduce(parts)
    return np.where(finite, scores, math.inf)


def step_scores(
    criterion: Criterion, actual: NDArray[np.float64], expected: NDArray[np.float64]
) -> NDArray[np.float64]:
    """:meth:`Criterion.score` of each step (index along axis 1) of two arrays of one shape."""
    steps = actual.shape[1]
    return row_scores(
        criterion,
        np.moveaxis(actual, 1, 0).reshape(steps, -1),
        np.moveaxis(expected, 1, 0).reshape(steps, -1),
    )


def _compute_dtype(judged: str) -> str:
    """The dtype a kernel that stores ``judged`` computes its terms in."""
    return "float32" if judged in ("float16", "bfloat16") else judged


def _over(error: NDArray[np.float64], allowed: Any) -> NDArray[np.float64]:
    """``error / allowed``, 0 for no error and ``inf`` for an error where none is allowed."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(error == 0, 0.0, error / allowed)


#: Default (rtol, atol) by the less precise of the two dtypes, as torch.testing.assert_close
#: chooses them; longdouble is judged like float64.
DEFAULT_TOLERANCES: Final = {
    "bfloat16": (1.6e-2, 1e-5),
    "float16": (1e-3, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
}


def least_precise(*dtypes: np.dtype[Any]) -> str:
    """The name of the less precise dtype, the one of largest unit roundoff; any other dtype
    (longdouble, an integer) is taken as float64."""
    names = [d.name if d.name in UNIT_ROUNDOFF else "float64" for d in dtypes]
    return max(names, key=UNIT_ROUNDOFF.__getitem__)


def _number(what: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"compare: {what} must be a float, got {type(value).__name__} {value!r}")
    number = float(value)
    if not number >= 0 or math.isinf(number):
        raise ValueError(f"compare: {what} must be a finite float >= 0, got {value!r}")
    return number


def per_grad(what: str, value: Tolerance | None) -> dict[str, float]:
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

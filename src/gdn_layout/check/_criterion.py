"""The criteria a gradient is judged by, as one type: :class:`Criterion` (docs/criterion.md).
A criterion's limits, verdict, words, JSON and score live here alone."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
from numpy.typing import NDArray

from .._dtypes import DTYPES, PRECISIONS, Precision, default_precision, precision_of
from .._floors import Floors
from .._norms import finite_rms, rms_rows
from ..layout import GRADIENT_NAMES

Number = float | np.floating[Any] | np.integer[Any]
#: A tolerance for every gradient, or a mapping from gradient name to its tolerance.
Tolerance = Number | Mapping[str, Number]

#: How far above its floors a correct kernel's errors may be, by precision class
#: (docs/criterion.md says how each was chosen; float64's truth is itself rounded).
K: Final = {"float64": 64.0, "float32": 16.0, "tf32": 16.0, "bfloat16": 8.0, "float16": 8.0}
#: Floors for fixtures that carry none, by class: ``(rms, max)`` for every gradient.
DEFAULT_FLOORS: Final = {p.name: p.default_floors for p in PRECISIONS.values()}
#: Default (rtol, atol) by the less precise of the two dtypes, as torch.testing chooses them.
DEFAULT_TOLERANCES: Final = {d.name: d.tolerances for d in DTYPES.values()}


def _floor_for(floors: Floors | None, precision: Precision, grad: str) -> tuple[float, ...]:
    """``(rms, max[, reach])`` of ``grad`` in ``precision``: measured (float64's are
    float32's times ``2**-29``), else the defaults; never below half the unit roundoff."""
    source = "float32" if precision.name == "float64" else precision.name
    measured = (floors or {}).get(source, {}).get(grad)
    least = precision.unit_roundoff / 2
    if measured is None:
        rms, peak = precision.default_floors
        return (max(rms, least), max(peak, least))
    factor = precision.unit_roundoff / PRECISIONS[source].unit_roundoff
    return (max(measured[0] * factor, least), max(measured[1] * factor, least), *measured[2:])


@dataclass(frozen=True)
class Criterion:
    """How one gradient is judged (``mode`` elementwise, rms, both or calibrated): its
    limits, its verdict and the words that state them; docs/criterion.md defines each.
    Calibrated, ``atol`` is the largest error of one element allowed, ``floor`` the
    ``(rms, max)`` floors over ``scale = rms(expected)``, ``least`` the least error a floor
    stands for, ``reach`` the correct forms' rounding over the step-by-step form's.

    Examples
    --------
    >>> import numpy as np
    >>> Criterion.tolerances(1e-4, 1e-6).words
    'rtol=0.0001 atol=1e-06'
    >>> c = Criterion.calibrated(None, "float32", "dq", np.ones(8))
    >>> c.precision_name, c.floor, c.limit == K[c.precision.name]  # K of its class
    ('float32', (3e-05, 0.0005), True)
    >>> c.score(np.ones(8) * (1 + 1e-6), np.ones(8)) < 1  # within the limit
    True
    """

    mode: Literal["elementwise", "rms", "both", "calibrated"]
    rtol: float = 0.0
    atol: float = 0.0
    max_rms_ratio: float | None = None
    floor: tuple[float, float] | None = None
    precision: Precision | None = None
    reach: float | None = None
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
            return cls("elementwise", rtol, atol)
        return cls("both" if elementwise else "rms", rtol, atol, max_rms_ratio)

    @classmethod
    def calibrated(
        cls,
        floors: Floors | None,
        precision: Precision | str,
        grad: str,
        expected: NDArray[Any],
        term_scale: float | None = None,
    ) -> Criterion:
        """The calibrated criterion of ``grad`` judged in ``precision`` (a class or its name)."""
        if isinstance(precision, str):
            precision = precision_of(precision, "Criterion.calibrated: precision")
        scale = finite_rms(expected)
        by_scale = precision.unit_roundoff / 2 * scale
        by_terms = precision.compute_roundoff / 2 * (term_scale or 0.0)
        floor = _floor_for(floors, precision, grad)
        rms_error = max(floor[0] * scale, by_scale, by_terms)
        return cls(
            "calibrated",
            atol=K[precision.name] * max(floor[1] * scale, by_scale, by_terms),
            max_rms_ratio=K[precision.name] * rms_error / scale if scale > 0 else math.inf,
            floor=(floor[0], floor[1]),
            precision=precision,
            reach=floor[2] if len(floor) > 2 else None,
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
        """The calibrated bound on ``error_floor_ratio``, :data:`K` of the class; else NaN."""
        return math.nan if self.precision is None else K[self.precision.name]

    @property
    def precision_name(self) -> str | None:
        return None if self.precision is None else self.precision.name

    @property
    def errors(self) -> tuple[float, float]:
        """The calibrated floors as errors, ``(rms, max)`` of ``a - e``; else ``(0, 0)``."""
        if self.floor is None:
            return (0.0, 0.0)
        return (
            max(self.floor[0] * self.scale, self.least),
            max(self.floor[1] * self.scale, self.least),
        )

    def ratio(self, rms_ratio: float, max_abs_error: float) -> float | None:
        """The larger of the RMS error and the largest error over its floor; None uncalibrated."""
        if self.floor is None:
            return None
        if math.isnan(rms_ratio) or math.isnan(max_abs_error):
            return math.nan
        rms_floor, max_floor = self.errors
        if max_floor == 0:
            return 0.0 if max_abs_error == 0 else math.inf
        if self.scale == 0:  # the RMS error is at most the largest one, and the floors agree
            return max_abs_error / max_floor
        return max(rms_ratio * self.scale / rms_floor, max_abs_error / max_floor)

    def passes(
        self, rms_ratio: float, max_abs_error: float, mismatches: int, nonfinite: int
    ) -> bool:
        """The verdict on a gradient's figures."""
        passed = nonfinite == 0 and mismatches == 0
        if self.max_rms_ratio is not None:
            passed = passed and rms_ratio <= self.max_rms_ratio
        ratio = self.ratio(rms_ratio, max_abs_error)
        return passed and (ratio is None or ratio <= self.limit)

    @property
    def words(self) -> str:
        """The criterion in words, e.g. ``"rtol=1e-05 atol=1e-08"``."""
        if self.mode == "calibrated":
            return f"error/floor<={self.limit:g} ({self.precision_name})"
        tolerances = f"rtol={self.rtol:.3g} atol={self.atol:.3g}"
        if self.max_rms_ratio is None:
            return tolerances
        rms = f"rms ratio<={self.max_rms_ratio:.3g}"
        return rms if self.mode == "rms" else f"{tolerances} {rms}"

    def floor_words(self) -> str:
        """The calibrated floors as a report's line states them; ``""`` for other criteria."""
        if self.floor is None or self.precision is None:
            return ""
        words = (
            f"floors for {self.precision.name}: rms ratio {self.floor[0]:.3g}, "
            f"max error {self.floor[1]:.3g} x rms(expected)"
        )
        if self.term_scale is not None:
            words += (
                f", none below {self.precision.compute_roundoff / 2:.3g} x "
                f"{self.term_scale:.3g}, the scale of its terms"
            )
        if self.reach is not None and self.reach > 1.5:
            words += (
                f"; a correct {self.precision.name} kernel reaches {self.reach:.3g}x the "
                "step-by-step form's rounding here"
            )
        return words

    @property
    def bound_words(self) -> str:
        """The error one element may have, as a formula: ``|a-e| <= 0.001 + 0.01*|e|``."""
        return f"|a-e| <= {self.atol:.3g} + {self.rtol:.3g}*|e|"

    def allowed(self, expected: float | None) -> float:
        """The error one element whose expected value is ``expected`` may have (0 if not finite)."""
        if expected is None or not math.isfinite(expected):
            return 0.0
        return float(self.allowances(np.array([abs(expected)]))[0])

    def allowances(self, magnitude: NDArray[np.float64]) -> NDArray[np.float64]:
        """``atol + rtol * |expected|`` of each element: the one place the bound is written."""
        allowed: NDArray[np.float64] = self.atol + self.rtol * magnitude
        return allowed

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields, a non-finite float as ``"inf"``/``"nan"``."""
        return {
            "mode": self.mode,
            "rtol": json_float(self.rtol),
            "atol": json_float(self.atol),
            "max_rms_ratio": json_float(self.max_rms_ratio),
            "elementwise": self.counts_elements,
            "floor": None if self.floor is None else [json_float(f) for f in self.floor],
            "precision": self.precision_name,
            "term_scale": json_float(self.term_scale),
        }

    def score(self, actual: NDArray[Any], expected: NDArray[Any]) -> float:
        """The error of ``actual`` against ``expected`` (two arrays of one shape) over what
        this criterion allows: at most 1 passes; non-finite values score ``inf``."""
        a = np.asarray(actual, np.float64).reshape(1, -1)
        e = np.asarray(expected, np.float64).reshape(1, -1)
        return float(row_scores(self, a, e)[0])


def row_scores(
    criterion: Criterion, actual: NDArray[np.float64], expected: NDArray[np.float64]
) -> NDArray[np.float64]:
    """:meth:`Criterion.score` of each row of two ``[n, m]`` float64 arrays at once."""
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
                parts.append(np.max(_over(err, c.allowances(np.abs(expected))), axis=1))
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


def json_float(x: float | None) -> float | str | None:
    """``x`` as strict JSON takes it: a non-finite float as ``"inf"``, ``"-inf"`` or ``"nan"``."""
    return x if x is None or math.isfinite(x) else str(float(x))


def _over(error: NDArray[np.float64], allowed: Any) -> NDArray[np.float64]:
    """``error / allowed``, 0 for no error and ``inf`` for an error where none is allowed."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(error == 0, 0.0, error / allowed)


def judged_precision(precision: object, func: str, *dtypes: np.dtype[Any]) -> Precision:
    """The class ``precision`` names (None: the less precise dtype's), not finer than those."""
    buffers = default_precision(*dtypes)
    if precision is None:
        return buffers
    chosen = precision_of(precision, f"{func}: precision")
    if chosen.unit_roundoff < buffers.unit_roundoff:
        raise ValueError(
            f"{func}: precision {chosen.name!r} judges {chosen.buffer} buffers, got "
            f"{buffers.buffer} ones, whose rounding alone exceeds its floors; pass "
            f"precision={buffers.name!r} or a coarser class"
        )
    return chosen


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
    if not isinstance(value, Mapping):
        return dict.fromkeys(GRADIENT_NAMES, _number(what, value))
    unknown = sorted(str(k) for k in value if k not in GRADIENT_NAMES)
    if unknown:
        raise ValueError(
            f"compare: {what} has unknown gradient names {unknown}; "
            f"expected names among {', '.join(GRADIENT_NAMES)}"
        )
    return {name: _number(f"{what}[{name!r}]", value[name]) for name in value}


class Scores:
    """Each gradient's criterion as the findings' score (with its per-step ``steps``); a
    gradient of another layout is judged calibrated in ``judged`` against ``floors``."""

    def __init__(
        self, criteria: Mapping[str, Criterion], floors: Floors | None, judged: Precision
    ) -> None:
        self.criteria, self.floors, self.judged = dict(criteria), floors, judged

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

    def against(
        self,
        name: str,
        values: NDArray[np.float64],
        term: float | None,
        least: tuple[float, float] | None,
    ) -> Criterion:
        """``name``'s criterion made again against a re-run's ``values``, its floors at least
        ``least`` (the re-run's rounding), its term scale ``term``; tolerances stay."""
        given = self.criteria[name]
        if given.mode != "calibrated":
            return given
        merged = self.floors
        if least is not None:
            source = PRECISIONS["float32"] if self.judged.name == "float64" else self.judged
            base = _floor_for(self.floors, source, name)
            merged = {source.name: {name: (max(base[0], least[0]), max(base[1], least[1]))}}
        return Criterion.calibrated(merged, self.judged, name, values, term)

"""What failed across a suite's cases, read together (README.md, *Quickstart*, on pytest's
summary): which gradients fail, the case dimensions that separate failing cases from passing
ones, the likely causes counted over cases, and the precision class that passes failures with
no structure. A :class:`CaseResult` is small and JSON-safe, to cross from pytest-xdist's
workers.

>>> import numpy as np
>>> from gdn_layout import GdnBackwardLayout, unpack
>>> from gdn_layout.reference import backward
>>> from gdn_layout.suites import make_case
>>> results = []
>>> for seq in (1, 3):
...     for carry in (False, True):
...         case = make_case(GdnBackwardLayout(1, seq, 2, 4, carry_state=carry), regime="mild")
...         out = backward(*case.inputs, dtype=np.float32)
...         if carry:
...             unpack(out, case.layout).dstate[...] *= 2  # a bug: dstate doubled
...         results.append((case, case.compare(out)))
>>> print(summarize(results))  # doctest: +ELLIPSIS
2 of 4 cases failed: dstate 2; dq, dk, dv, dg, dbeta never fail
  fails only with a carried state
  likely cause in 2 cases (dstate, scale): dstate is 2.000 x expected ...
  failing cases: b1s1h2n4-scalar-state-mild-seed0, b1s3h2n4-scalar-state-mild-seed0
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from ._dtypes import PRECISIONS, UNIT_ROUNDOFF
from .check._criterion import Criterion, json_float
from .check._records import Comparison
from .generate import CHUNK_SIZES
from .layout import GRADIENT_NAMES

if TYPE_CHECKING:
    from .suites import Case

__all__ = ["COMMANDS", "CaseResult", "GradResult", "Summary", "case_result", "summarize"]

#: How the summary names a precision class and a float64 suite to the reader: from Python,
#: from pytest's options, or from the command line's.
COMMANDS: Final = {
    "python": ("precision={!r}", "cases made with dtype=np.float64"),
    "pytest": ("--gdn-precision {}", "--gdn-dtype float64"),
    "cli": ("--precision {}", "a suite made with gdn-layout fixture --suite DIR --dtype float64"),
}
#: What a kernel that passes only in a coarser class likely does, by that class.
_PRECISION_CAUSES: Final = {
    "float64": "computed in float64 from coarser buffers?",
    "float32": "computed in float32?",
    "tf32": "matrix products on TF32 operands?",
    "bfloat16": "products or arithmetic in bfloat16?",
    "float16": "products or arithmetic in float16?",
}
#: The most causes and failing case names a summary lists.
_SHOWN: Final = 6


@dataclass(frozen=True)
class GradResult:
    """One gradient's verdict in one case, extracted from a
    :class:`~gdn_layout.GradComparison`; ``passes_as`` names the other precision classes (of
    those the buffers allow) whose calibrated criterion passes its figures.

    See Also
    --------
    summary.CaseResult : The case's record that holds it.
    """

    name: str
    passed: bool
    error_floor_ratio: float | None
    rms_ratio: float
    max_abs_error: float
    precision: str | None
    passes_as: tuple[str, ...] = ()


@dataclass(frozen=True)
class CaseResult:
    """One case's result as :func:`summarize` reads it: its labels, its gradients' verdicts
    and figures, and its findings (``(kind, gradient, text)``); :meth:`to_dict` and
    :meth:`from_dict` carry it as JSON across pytest-xdist's workers.

    See Also
    --------
    summary.case_result : What makes one.
    summary.summarize : What reads them.
    """

    name: str
    batch: int
    seq: int
    heads: int
    state_size: int
    per_channel: bool
    carry_state: bool
    regime: str | None
    dtype: str
    grads: tuple[GradResult, ...]
    findings: tuple[tuple[str, str | None, str], ...] = ()

    @property
    def passed(self) -> bool:
        """Whether every gradient passed."""
        return all(g.passed for g in self.grads)

    @property
    def failed(self) -> tuple[str, ...]:
        """The gradients that failed, in packing order."""
        return tuple(g.name for g in self.grads if not g.passed)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (``json.dumps(..., allow_nan=False)`` accepts it)."""
        data = dataclasses.asdict(self)
        for grad in data["grads"]:
            grad.update((key, json_float(grad[key])) for key in _FIGURES)
        return data

    @classmethod
    def from_dict(cls, data: object) -> CaseResult:
        """The record :meth:`to_dict` made.

        Raises
        ------
        ValueError
            ``data`` is not such a record.
        """
        where = "CaseResult.from_dict"
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
        try:
            grads = tuple(
                GradResult(
                    **{
                        **g,
                        **{k: None if g[k] is None else float(g[k]) for k in _FIGURES},
                        "passes_as": tuple(g["passes_as"]),
                    }
                )
                for g in data["grads"]
            )
            findings = tuple((kind, grad, text) for kind, grad, text in data["findings"])
            return cls(**{**data, "grads": grads, "findings": findings})
        except KeyError as err:
            raise ValueError(f"{where}: the record has no key {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None


#: A gradient's figures, which JSON carries as :func:`json_float` writes them.
_FIGURES: Final = ("error_floor_ratio", "rms_ratio", "max_abs_error")


def case_result(case: Case, comparison: Comparison) -> CaseResult:
    """The :class:`CaseResult` of ``case`` judged by ``comparison`` (what its
    :meth:`~gdn_layout.suites.Case.compare` returned); the other precision classes that pass
    a gradient are judged from its figures and the fixture's floors, not the buffers.

    Raises
    ------
    TypeError
        ``case`` is not a :class:`~gdn_layout.suites.Case` or ``comparison`` not a
        :class:`~gdn_layout.check.Comparison`.

    See Also
    --------
    summary.summarize : Reads them.
    """
    from .suites import Case

    if not isinstance(case, Case):
        raise TypeError(f"case_result: case must be a Case, got {type(case).__name__}")
    if not isinstance(comparison, Comparison):
        raise TypeError(
            f"case_result: comparison must be a Comparison, got {type(comparison).__name__}"
        )
    grads = []
    for g in comparison.grads:
        passes_as: tuple[str, ...] = ()
        c = g.criterion
        if not g.passed and c.mode == "calibrated" and c.precision is not None:
            coarsest = max(UNIT_ROUNDOFF.get(d, 0.0) for d in (g.actual_dtype, g.expected_dtype))
            passes_as = tuple(
                p.name
                for p in PRECISIONS.values()
                if p.name != c.precision.name
                and p.unit_roundoff >= coarsest
                and Criterion.calibrated(
                    case.fixture.floors, p, g.name, np.array([c.scale]), c.term_scale
                ).passes(g.rms_ratio, g.max_abs_error, 0, g.nonfinite_mismatches)
            )
        figures = (g.error_floor_ratio, g.rms_ratio, g.max_abs_error, c.precision_name)
        grads.append(GradResult(g.name, g.passed, *figures, passes_as))
    layout = case.layout
    return CaseResult(
        case.name,
        layout.batch,
        layout.seq,
        layout.heads,
        layout.state_size,
        layout.gate_per_channel,
        layout.carry_state,
        case.regime,
        case.fixture.dtype.name,
        tuple(grads),
        tuple((f.kind, f.gradient, f.text) for f in comparison.findings),
    )


@dataclass(frozen=True)
class Summary:
    """What failed across cases; ``str()`` is the summary, its most telling lines first.

    ``total`` cases judged; the names of those ``failed``, in the order given; ``failures``:
    how many cases each gradient failed in; ``never``: the gradients that never failed;
    ``statements`` that separate failing cases from passing ones; the misreadings
    ``verified`` by a re-run and the other likely ``causes``, counted over cases; the
    ``precision_hint`` for failures with no structure, and the ``precision_class`` that
    passes them all, if one does; the ``note`` the line saying every case passed adds.

    See Also
    --------
    summary.summarize : What makes one.
    """

    total: int
    failed: tuple[str, ...]
    failures: Mapping[str, int]
    never: tuple[str, ...]
    statements: tuple[str, ...]
    verified: tuple[str, ...]
    causes: tuple[str, ...]
    precision_hint: str | None
    precision_class: str | None = None
    note: str | None = None

    @property
    def passed(self) -> bool:
        """Whether every case passed."""
        return not self.failed

    def lines(self) -> list[str]:
        """The summary's lines: the counts, the statements, the verified causes, the
        precision hint, the other causes, then the failing cases."""
        if self.passed:
            return [f"all {self.total} cases passed" + (f"; {self.note}" if self.note else "")]
        counts = ", ".join(f"{name} {n}" for name, n in self.failures.items())
        never = f"; {', '.join(self.never)} never fail" if self.never else ""
        head = f"{len(self.failed)} of {self.total} cases failed: {counts}{never}"
        hint = [] if self.precision_hint is None else [self.precision_hint]
        found, not_found = (hint, []) if self.precision_class else ([], hint)
        body = [*self.statements, *self.verified, *found, *self.causes, *not_found]
        body.append(f"failing cases: {_names(self.failed)}")
        return [head, *(f"  {line}" for line in body)]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _names(names: Sequence[str]) -> str:
    """The first :data:`_SHOWN` of ``names``, and how many more."""
    more = f", and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def summarize(
    results: Iterable[CaseResult | tuple[Case, Comparison]], *, command: str = "python"
) -> Summary:
    """What failed across ``results``: per gradient, the dimensions that separate failing
    cases from passing ones, the likely causes and a verified precision hint (see the module).

    Parameters
    ----------
    results : iterable of CaseResult or (Case, Comparison)
        Each case's result: a :class:`CaseResult`, or a case and the comparison its
        :meth:`~gdn_layout.suites.Case.compare` or :meth:`~gdn_layout.suites.Case.check`
        returned.
    command : {"python", "pytest", "cli"}
        How the hints name a precision class and a float64 suite (:data:`COMMANDS`):
        ``precision='tf32'``, ``--gdn-precision tf32`` or ``--precision tf32``.

    Raises
    ------
    TypeError
        An item of ``results`` is neither.
    ValueError
        ``command`` is unknown.

    See Also
    --------
    summary.case_result : One case's record.
    suites.Case.compare : What judges a case.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout
    >>> from gdn_layout.reference import backward
    >>> from gdn_layout.suites import make_case
    >>> case = make_case(GdnBackwardLayout(1, 3, 2, 4), regime="mild")
    >>> print(summarize([(case, case.compare(backward(*case.inputs, dtype=np.float32)))]))
    ... # doctest: +ELLIPSIS
    all 1 cases passed; a bug whose effect is below a correct kernel's rounding here ...
    """
    if command not in COMMANDS:
        raise ValueError(
            f"summarize: command must be one of {', '.join(COMMANDS)}, got {command!r}"
        )
    records = [_record(item, i) for i, item in enumerate(results)]
    precision_words, float64_words = COMMANDS[command]
    failing = [r for r in records if not r.passed]
    present = [n for n in GRADIENT_NAMES if any(g.name == n for r in records for g in r.grads)]
    failures = {n: k for n in present if (k := sum(n in r.failed for r in records))}
    if not failing:
        note = None
        if records and any(r.dtype != "float64" for r in records):
            note = (
                "a bug whose effect is below a correct kernel's rounding here (a state dropped "
                f"under extreme decay) is the float64 suite's to catch: {float64_words}, for "
                "kernels that can run it"
            )
        return Summary(len(records), (), {}, tuple(present), (), (), (), None, note=note)
    statements = _statements(records, lambda r: not r.passed)
    for name in failures:
        having = [r for r in records if any(g.name == name for g in r.grads)]
        for line in _statements(having, lambda r, name=name: name in r.failed):  # type: ignore[misc]
            if line not in statements and f"{name} {line}" not in statements:
                statements.append(f"{name} {line}")
    causes = _causes(failing)
    hint, passing_class = _precision_hint(failing, precision_words)
    return Summary(
        total=len(records),
        failed=tuple(r.name for r in failing),
        failures=failures,
        never=tuple(n for n in present if n not in failures),
        statements=tuple(statements),
        verified=tuple(line for line in causes if line.startswith(_VERIFIED)),
        causes=tuple(line for line in causes if not line.startswith(_VERIFIED)),
        precision_hint=hint,
        precision_class=passing_class,
    )


def _record(item: object, index: int) -> CaseResult:
    if isinstance(item, CaseResult):
        return item
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Comparison):
        return case_result(item[0], item[1])
    raise TypeError(
        f"summarize: results[{index}] must be a CaseResult or a (Case, Comparison) pair, "
        f"got {type(item).__name__}"
    )


# -- the separating statements -----------------------------------------------------------------

#: The categorical labels, and how a statement names one value: "fails only with ..." and
#: "never ...".
_CATEGORIES: Final[dict[str, Callable[[Any], str]]] = {
    "carry_state": lambda v: "with a carried state" if v else "without a carried state",
    "per_channel": lambda v: "with per-channel gates" if v else "with per-head gates",
    "regime": lambda v: f"the {v} regime",
    "dtype": lambda v: f"in {v}",
}
#: What a regime's absence from the failures says.
_NEVER_UNDER: Final = {"zero": ": the gate's path (g = 0 hides it)"}


def _statements(records: list[CaseResult], fails: Callable[[CaseResult], bool]) -> list[str]:
    """Every statement about the labels that separates the records ``fails`` holds for from
    the others, those that set apart the most passing records first."""
    bad = [r for r in records if fails(r)]
    good = [r for r in records if not fails(r)]
    if not bad or not good:
        return []
    said: list[tuple[int, str]] = []  # (passing records set apart, the statement)
    for label, symbol in (("seq", "S"), ("batch", "B"), ("heads", "H"), ("state_size", "N")):
        values = sorted({getattr(r, label) for r in records})
        cuts = (1, *CHUNK_SIZES) if label == "seq" else tuple(values[:-1])
        worst = [getattr(r, label) for r in bad]
        fine = [getattr(r, label) for r in good]
        above = [t for t in cuts if min(worst) > t and min(fine) <= t]
        if above:  # the largest: every failing record past it
            t = max(above)
            apart = sum(v <= t for v in fine)
            if label == "seq" and t == 1:
                said.append((apart, "passes every case of one step"))
            else:
                why = f": a chunk hand-over (past a {t}-step chunk)" if label == "seq" else ""
                said.append((apart, f"fails only with {symbol} > {t}{why}"))
        below = [t for t in cuts if max(worst) <= t and max(fine) > t]
        if below:  # the smallest: every failing record within it
            t = min(below)
            apart = sum(v > t for v in fine)
            words = "in cases of one step" if label == "seq" and t == 1 else f"with {symbol} <= {t}"
            said.append((apart, f"fails only {words}"))
    for label, name in _CATEGORIES.items():
        seen = {getattr(r, label) for r in records}
        failing = {getattr(r, label) for r in bad}
        if failing == seen or None in seen:
            continue
        apart = sum(getattr(r, label) not in failing for r in good)
        spared = sorted(seen - failing)
        if len(failing) == 1 and (label != "regime" or len(spared) > 1):
            (value,) = failing
            verb = "under" if label == "regime" else ""
            said.append((apart, " ".join(filter(None, ("fails only", verb, name(value))))))
        elif label == "regime":  # the fewer regimes said: those that hide the bug
            why = _NEVER_UNDER.get(spared[0], "") if len(spared) == 1 else ""
            plural = "s" if len(spared) > 1 else ""
            said.append((apart, f"never fails under the {', '.join(spared)} regime{plural}{why}"))
        else:
            said.append((apart, f"never fails {', '.join(name(v) for v in spared)}"))
    return [line for _, line in sorted(said, key=lambda item: -item[0])]


# -- causes and the precision hint -------------------------------------------------------------


def _causes(failing: list[CaseResult]) -> list[str]:
    """One line per kind of finding (and gradient), counted over the cases it appears in, by
    count; a misreading's line begins with :data:`_VERIFIED`."""
    cases: Counter[tuple[str, str | None]] = Counter()
    texts: dict[tuple[str, str | None], Counter[str]] = {}
    unexplained = 0
    for r in failing:
        keys = {(kind, gradient) for kind, gradient, _ in r.findings}
        cases.update(keys)
        for kind, gradient, text in r.findings:
            texts.setdefault((kind, gradient), Counter())[text] += 1
        unexplained += not r.findings
    ranked = sorted(cases, key=lambda key: -cases[key])  # the misreadings are split off after
    lines = []
    for key in ranked[:_SHOWN]:
        kind, gradient = key
        n = cases[key]
        example = texts[key].most_common(1)[0][0]
        if kind == "misreading":
            lines.append(f"{_VERIFIED} in {_cases(n)}: {example}")
        else:
            what = kind if gradient is None else f"{gradient}, {kind}"
            lines.append(f"likely cause in {_cases(n)} ({what}): {example}")
    if len(ranked) > _SHOWN:
        lines.append(f"and {len(ranked) - _SHOWN} more kinds of finding")
    if unexplained:
        lines.append(f"no finding in {_cases(unexplained)}")
    return lines


#: How a misreading's line begins.
_VERIFIED: Final = "verified by a re-run"


def _cases(n: int) -> str:
    return f"{n} case{'' if n == 1 else 's'}"


def _precision_hint(failing: list[CaseResult], words: str) -> tuple[str | None, str | None]:
    """For the failing cases with no structure (only ``rounding`` findings, or none): the
    finest precision class whose criterion passes every failing gradient of each, or that none
    does, and that class. Nothing when every failing case has a structural finding, nor that
    no class passes them when some have one."""
    plain = [r for r in failing if all(kind == "rounding" for kind, _, _ in r.findings)]
    judged = {g.precision for r in plain for g in r.grads if not g.passed}
    if not plain or None in judged:  # explicit tolerances: no class to judge again in
        return None, None
    which = (
        "every failing case"
        if len(plain) == len(failing)
        else f"each of the {_cases(len(plain))} that fail with no structure"
    )
    for p in PRECISIONS:
        if all(p in g.passes_as for r in plain for g in r.grads if not g.passed):
            return f"{which} passes as {p}: {_PRECISION_CAUSES[p]} use {words.format(p)}", p
    if len(plain) < len(failing):  # the others' bug, on too few elements to identify it?
        return None, None
    return (
        f"{which} fails in every other precision class the buffers allow: not rounding alone",
        None,
    )

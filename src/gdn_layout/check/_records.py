"""The records a comparison returns, their text, HTML and JSON views, and its failure text
(docs/criterion.md)."""

from __future__ import annotations

import html
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from numpy.typing import NDArray

from .._tables import fmt_float, html_table, text_table
from ..layout import GdnBackwardLayout, gradient_axes, layout_caption
from ._criterion import Criterion, json_float
from ._findings import Finding

if TYPE_CHECKING:
    from .._picture import Picture

#: ``field`` metadata of what ``to_dict`` leaves out: the maps (for plots) and the verdict.
_NOT_JSON: Final = {"json": False}


@dataclass(frozen=True)
class GradComparison:
    """How one gradient of an actual buffer compares with the expected one: the figures
    measured, the :class:`~gdn_layout.check.Criterion` it was judged by, the verdict, the
    ``findings`` that explain a failure, and read-only maps for plots. Error figures are over
    the pairs both finite (NaN or Inf at a non-finite mismatch); ``worst`` indexes the
    element furthest out, in :attr:`axes` order. The maps: the largest ``|a - e|`` per
    ``[S, H]`` cell (``[N, H]`` for ``dstate``), per batch element, the mismatches per cell,
    binned past 2**20 cells (docs/memory.md); a failing gradient's signed error and
    ``<a, e> / <e, e>`` per cell (``dstate``'s ``[H, N, N]``); docs/criterion.md lists each.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout, compare, unpack
    >>> layout = GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=3)
    >>> expected = np.linspace(-1, 1, layout.total_elems)
    >>> actual = expected.copy()
    >>> unpack(actual, layout).dv[0, 1, 0, 2] += 0.5
    >>> dv = compare(actual, expected, layout, rtol=1e-3)["dv"]
    >>> dv.passed, dv.mismatches, dv.criterion.words
    (False, 1, 'rtol=0.001 atol=1e-07')
    >>> print(dv)  # doctest: +ELLIPSIS
    FAIL dv[0, 1, 0, 2]: actual 0.787356 expected 0.287356; 1 of 24 out of tolerance (...
    >>> dv.to_dict()["worst"], dv.to_dict()["rtol"]
    ([0, 1, 0, 2], 0.001)
    """

    name: str
    shape: tuple[int, ...]
    actual_dtype: str
    expected_dtype: str
    size: int
    criterion: Criterion
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
    passed: bool = field(init=False, metadata=_NOT_JSON)
    error_floor_ratio: float | None = field(init=False, metadata=_NOT_JSON)
    error_map: NDArray[np.float64] = field(compare=False, repr=False, metadata=_NOT_JSON)
    batch_error_map: NDArray[np.float64] = field(compare=False, repr=False, metadata=_NOT_JSON)
    mismatch_map: NDArray[np.int64] = field(compare=False, repr=False, metadata=_NOT_JSON)
    error_map_bins: tuple[int, int] = field(
        default=(1, 1), compare=False, repr=False, metadata=_NOT_JSON
    )
    batch_bins: int = field(default=1, compare=False, repr=False, metadata=_NOT_JSON)
    findings: tuple[Finding, ...] = field(default=(), compare=False)
    signed_error_map: NDArray[np.float64] | None = field(
        default=None, compare=False, repr=False, metadata=_NOT_JSON
    )
    ratio_map: NDArray[np.float64] | None = field(
        default=None, compare=False, repr=False, metadata=_NOT_JSON
    )

    def __post_init__(self) -> None:
        c, rms, peak = self.criterion, self.rms_ratio, self.max_abs_error  # the verdict, once
        verdict = c.passes(rms, peak, self.mismatches, self.nonfinite_mismatches)
        object.__setattr__(self, "passed", verdict)
        object.__setattr__(self, "error_floor_ratio", c.ratio(rms, peak))

    @property
    def axes(self) -> tuple[str, ...]:
        """The names of the axes ``worst`` indexes, e.g. ``("b", "s", "h", "n")``."""
        return gradient_axes(self.name, len(self.shape))

    @property
    def exact(self) -> bool:
        """Every element equal, or both non-finite in the same way: no element is "worst"."""
        return self.max_abs_error == 0 and self.nonfinite_mismatches == 0

    def where(self) -> str:
        """The worst element as an index expression, e.g. ``"dk[0, 17, 3, 5]"``."""
        return f"{self.name}[{', '.join(map(str, self.worst or ()))}]"

    def __str__(self) -> str:
        return f"{'ok' if self.passed else 'FAIL'} {self.summary()}"

    def summary(self) -> str:
        """One line: the worst element, its values and why the gradient passes or fails."""
        if self.worst is None:
            return f"{self.name}: empty"
        c, n, out = self.criterion, self.nonfinite_mismatches, f"{self.mismatches} of {self.size}"
        facts = [f"{self.where()}: actual {_value(self.worst_actual)} expected "
                 f"{_value(self.worst_expected)}"]  # fmt: skip
        if c.mode == "calibrated":
            facts.append(
                f"error/floor {self._ratio()} ({c.floor_words()}); {out} over the max error"
            )
        elif c.counts_elements:
            here = c.allowed(self.worst_expected)
            facts.append(f"{out} out of tolerance ({c.bound_words}; here {here:.3g})")
        if c.mode in ("rms", "both"):
            facts.append(self._rms())
        if n:
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
        return "; ".join(facts)

    def title(self) -> str:
        """The verdict as a picture's title says it, e.g. ``"dk FAIL: 3 of 48 out"``."""
        c, n = self.criterion, self.nonfinite_mismatches
        if self.passed:
            return f"{self.name} ok: max |a-e| {fmt_float(self.max_abs_error)}"
        if c.counts_elements and self.mismatches:
            head = f"{self.name} FAIL: {self.mismatches} of {self.size} out"
            if self.worst is not None:
                head += f", worst [{', '.join(map(str, self.worst))}]"
            return head + (f"\nerror/floor {self._ratio()}" if c.floor else "")
        if n:
            return f"{self.name} FAIL: {n} NaN/Inf mismatch{'' if n == 1 else 'es'}"
        return f"{self.name} FAIL: " + (f"error/floor {self._ratio()}" if c.floor else self._rms())

    def _ratio(self) -> str:
        ratio, limit = self.error_floor_ratio, self.criterion.limit
        return (
            f"{fmt_float(ratio)} {'<=' if ratio is not None and ratio <= limit else '>'} {limit:g}"
        )

    def _rms(self) -> str:
        limit = self.criterion.max_rms_ratio or 0.0
        return (
            f"rms ratio {self.rms_ratio:.3g} {'<=' if self.rms_ratio <= limit else '>'} {limit:.3g}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe facts (no maps), the criterion's fields among them, then ``axes`` and
        the verdict; a non-finite float becomes ``"inf"``/``"nan"``."""
        data: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Criterion):  # its keys sit beside the figures
                data.update(value.to_dict())
            elif f.metadata.get("json", True):
                data[f.name] = _json(value)
        data.update(
            axes=list(self.axes),
            error_floor_ratio=json_float(self.error_floor_ratio),
            passed=self.passed,
        )
        return data


@dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare`: one :class:`GradComparison` per gradient, in order,
    indexed by name (``comparison["dk"]``); ``str`` is a fixed-width table, ``_repr_html_`` an
    HTML one and ``to_dict()`` a JSON-safe dict."""

    layout: GdnBackwardLayout
    grads: tuple[GradComparison, ...]
    #: What explains the packed buffer as a whole: another layout, or segments exchanged.
    buffer_findings: tuple[Finding, ...] = field(default=(), compare=False)
    #: The device ``actual`` was copied from (``"cuda:0"``); None for host memory.
    device: str | None = field(default=None, compare=False)
    #: The names of the gradients that failed, in packing order.
    failed: tuple[str, ...] = field(init=False)
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        failed = tuple(g.name for g in self.grads if not g.passed)
        object.__setattr__(self, "failed", failed)  # the frozen record's derived fields
        object.__setattr__(self, "passed", not failed)

    @property
    def findings(self) -> tuple[Finding, ...]:
        """Every finding: the buffer's first, then each gradient's in packing order."""
        return (*self.buffer_findings, *(f for g in self.grads for f in g.findings))

    def causes(self, width: int = 0) -> list[str]:
        """One ``"likely cause: ..."`` line per finding, wrapped to a positive ``width``."""
        lines = [f"likely cause: {f.text}" for f in self.findings]
        if width <= 0:
            return lines
        return [
            part for line in lines for part in textwrap.wrap(line, width, subsequent_indent="  ")
        ]

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
            "findings": [f.to_dict() for f in self.findings],
        }

    def _title(self) -> str:
        verdict = "passed" if self.passed else f"FAILED ({', '.join(self.failed)})"
        return f"compare {verdict}: {layout_caption(self.layout)}{read_from(self.device)}"

    def _columns(self) -> list[tuple[str, str, list[str]]]:
        """Every column: header, alignment and one cell per gradient."""
        gs = self.grads
        return [
            ("grad", "l", [g.name for g in gs]),
            ("shape", "l", [str(g.shape) for g in gs]),
            ("dtypes", "l", [f"{g.actual_dtype}/{g.expected_dtype}" for g in gs]),
            ("max abs", "r", [fmt_float(g.max_abs_error) for g in gs]),
            ("max rel", "r", [fmt_float(g.max_rel_error) for g in gs]),
            ("rms ratio", "r", [fmt_float(g.rms_ratio) for g in gs]),
            ("error/floor", "r", [fmt_float(g.error_floor_ratio) for g in gs]),
            ("out/size", "r", [f"{g.mismatches}/{g.size}" for g in gs]),
            ("nan a/e", "r", [f"{g.nan_actual}/{g.nan_expected}" for g in gs]),
            ("inf a/e", "r", [f"{g.inf_actual}/{g.inf_expected}" for g in gs]),
            ("worst", "l", ["-" if g.exact or g.worst is None else str(list(g.worst)) for g in gs]),
            ("criterion", "l", [g.criterion.words for g in gs]),
            ("result", "l", ["ok" if g.passed else "FAIL" for g in gs]),
        ]

    def table(self, *, wide: bool = False, width: int = 100, causes: bool = True) -> str:
        """The report as text: a title, the dtypes and criterion every gradient shares, the
        table and, with ``causes``, the likely causes. Unless ``wide``, columns that say
        nothing are left out, then the least useful until lines fit ``width``; a last line
        names those left out."""
        columns = self._columns()
        lines = [self._title()]
        if wide:
            lines.append(_render(columns))
        else:
            cells = {header: cells for header, _, cells in columns}
            shared = [h for h in ("dtypes", "criterion") if self.grads and len(set(cells[h])) == 1]
            if shared:
                lines.append("; ".join(cells[h][0].replace("/", " against ") if h == "dtypes"
                                       else cells[h][0] for h in shared))  # fmt: skip
            skip = set(shared)
            if all(g.error_floor_ratio is None for g in self.grads):
                skip.add("error/floor")
            skip |= {h for h in ("nan a/e", "inf a/e") if set(cells[h]) <= {"0/0"}}
            kept = [c for c in columns if c[0] not in skip]
            dropped = []
            for header in _DROP_ORDER:
                if max(map(len, _render(kept).splitlines())) <= width:
                    break
                if header in {c[0] for c in kept}:
                    kept = [c for c in kept if c[0] != header]
                    dropped.append(header)
            lines.append(_render(kept))
            if dropped:
                lines.append(
                    f"(left out to fit {width} columns: {', '.join(dropped)}; wide shows all)"
                )
        if causes:
            lines.extend(self.causes(0 if wide else width))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        columns = self._columns()
        table = html_table(
            [c[0] for c in columns],
            [list(row) for row in zip(*(c[2] for c in columns), strict=True)],
            align="".join(c[1] for c in columns),
            caption=self._title(),
            row_styles=["" if g.passed else "background:#fdd" for g in self.grads],
        )
        if not self.findings:
            return table
        items = "".join(f"<li>{html.escape(line)}</li>" for line in self.causes())
        return f"{table}\n<ul>{items}</ul>"

    def plot(self, **options: Any) -> Picture:
        """:func:`gdn_layout.plot.plot_errors` of this comparison (needs ``gdn-layout[plot]``)."""
        from ..plot import plot_errors  # deferred: plot builds on this module

        return plot_errors(self, **options)


def failure_message(
    heading: str,
    comparison: Comparison,
    *,
    table: bool = False,
    located: bool = False,
    notes: Iterable[str] = (),
) -> str:
    """The text of every AssertionError a failed comparison raises (assert_close, Case.check,
    so the pytest plugin, Case.check_states): ``heading``, each likely cause, with ``table``
    the report, each failing record's summary (with ``located``, its worst element's axes
    named), then ``notes``."""
    lines = [heading, *(f"  {line}" for line in comparison.causes())]
    if table:
        lines.extend(["", comparison.table(causes=False), ""])
    for grad in comparison.grads:
        if grad.passed:
            continue
        lines.append(f"  {grad.summary()}")
        if located and grad.worst is not None:
            named = ", ".join(f"{a}={i}" for a, i in zip(grad.axes, grad.worst, strict=True))
            lines.append(f"    worst at {named}")
    lines.extend(notes)
    return "\n".join(lines)


def read_from(device: str | None) -> str:
    """The words that say a buffer was copied from ``device``; none for host memory."""
    return "" if device is None else f" (read from {device})"


#: The columns a narrow table leaves out first, in that order.
_DROP_ORDER = ("shape", "max rel", "dtypes", "criterion", "inf a/e", "nan a/e", "max abs")


def _render(columns: list[tuple[str, str, list[str]]]) -> str:
    rows = [list(row) for row in zip(*(c[2] for c in columns), strict=True)]
    return text_table([c[0] for c in columns], rows, align="".join(c[1] for c in columns))


def _value(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _json(value: Any) -> Any:
    """A field's value as JSON takes it: tuples as lists, non-finite floats as strings."""
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, Finding):
        return value.to_dict()
    return value

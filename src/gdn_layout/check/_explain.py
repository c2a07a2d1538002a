"""The second stage of a comparison: what explains the gradients that failed.

:func:`~gdn_layout.compare` measures each gradient once and keeps its figures and verdict in a
:class:`~gdn_layout.GradComparison` (:mod:`~gdn_layout.check._scan`). :func:`explain` takes
those records and the two buffers, unpacked once (:class:`Evidence`), and asks the entries of
:data:`EXPLAINERS` in order. Each entry is one kind of explanation with its own policy:

``gradient``
    every failing gradient on its own values (:func:`~gdn_layout.check._findings.
    grad_findings`: a scale, a permutation, a shift, ...). Its kinds in :data:`ALONE`, found
    without a fitted factor, explain a gradient failing alone: nothing is re-run for it.
``misreading``
    (with a fixture's inputs) the op re-run under the ways a port misreads its inputs
    (:mod:`~gdn_layout.check._misreadings`); skipped when one gradient fails alone and its own
    values explain it. A reading found explains every gradient: the gradients' own findings go.
``overflow``
    (with a fixture's inputs) non-finite gradients in chunks whose log-decay spans more than
    ``exp`` takes.
``backward``
    where ``dq`` passes (it reads the forward's states alone) and no reading holds: a step
    where the other gradients' error starts or stops is worded for the backward sweep (the
    state's cotangent handed to the chunk before), and ``dstate`` failing alone with nothing
    found is that sweep's end.
``layout``
    gradients found at other offsets of the packed buffer; only when nothing above explains
    the buffer as a whole.
``rows``
    (with a fixture's inputs) batch rows that hold identical inputs, whose gradients differ
    from the first row's.

An entry reads the records (each gradient's criterion scores the hypotheses, through
:meth:`Evidence.score`), never calls back into the comparison, and adding one is one entry.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from .._dtypes import Precision
from .._floors import Floors
from ..layout import GdnBackwardLayout
from ..packing import GdnGrads
from ._criterion import Scores
from ._findings import Finding, buffer_findings, grad_findings
from ._misreadings import misreading_findings, overflow_finding
from ._records import GradComparison

__all__ = ["ALONE", "EXPLAINERS", "Evidence", "Explainer", "explain"]


@dataclass(frozen=True)
class Evidence:
    """What every explainer reads: the records of the first stage, the buffers flat and
    unpacked (views, made once), the case's inputs when a fixture brought them, and the
    floors and class the gradients were judged in."""

    layout: GdnBackwardLayout
    records: tuple[GradComparison, ...]
    actual: NDArray[Any]
    expected: NDArray[Any]
    mine: GdnGrads
    theirs: GdnGrads
    inputs: Sequence[NDArray[Any] | None] | None
    floors: Floors | None
    judged: Precision

    @functools.cached_property
    def failing(self) -> tuple[GradComparison, ...]:
        """The records that failed, in packing order."""
        return tuple(r for r in self.records if not r.passed)

    @functools.cached_property
    def score(self) -> Scores:
        """The findings' score: each gradient by its record's criterion."""
        return Scores({r.name: r.criterion for r in self.records}, self.floors, self.judged)


@dataclass(frozen=True)
class Explained:
    """What the explainers found so far: each gradient's findings, and the buffer's."""

    grads: dict[str, tuple[Finding, ...]]
    whole: tuple[Finding, ...] = ()


@dataclass(frozen=True)
class Explainer:
    """One entry of :data:`EXPLAINERS`: a kind of explanation and its policy."""

    name: str
    #: Whether it needs the case's inputs (a fixture, not bare buffers).
    needs_inputs: bool
    #: Whether it runs, given what the entries before it found.
    runs: Callable[[Evidence, Explained], bool]
    #: What it finds, given what the entries before it found: the new state.
    find: Callable[[Evidence, Explained], Explained]


#: The kinds of a gradient's own findings that explain it failing alone by the op's values as
#: they are (moved, not written, not finite): no reading is re-run for it.
ALONE: Final = frozenset({"unwritten", "nonfinite", "axes", "transpose", "heads", "batch", "shift"})


def _explained_alone(finding: Finding) -> bool:
    """Whether ``finding`` explains its gradient by the op's own values. One that needs a
    fitted factor (a ``scale``, a shift scaled by 95 on a 3-step case) does not: a reading may
    scale one gradient alone (``dv`` without ``beta``), which a re-run shows."""
    return finding.kind in ALONE and finding.details.get("factor", 1.0) == 1.0


def _own_values(evidence: Evidence, so_far: Explained) -> Explained:
    grads = {
        r.name: grad_findings(r.name, *_pair(evidence, r.name), evidence.layout, evidence.score)
        for r in evidence.failing
    }
    return dataclasses.replace(so_far, grads=grads)


def _pair(evidence: Evidence, name: str) -> tuple[NDArray[Any], NDArray[Any]]:
    return getattr(evidence.mine, name), getattr(evidence.theirs, name)


def _re_run_needed(evidence: Evidence, so_far: Explained) -> bool:
    failing = evidence.failing
    if len(failing) > 1:
        return True
    return not any(_explained_alone(f) for f in so_far.grads.get(failing[0].name, ()))


def _misreading(evidence: Evidence, so_far: Explained) -> Explained:
    assert evidence.inputs is not None
    names = evidence.layout.names
    found = misreading_findings(
        {n: getattr(evidence.mine, n) for n in names},
        {n: getattr(evidence.theirs, n) for n in names},
        tuple(evidence.inputs),
        evidence.layout,
        evidence.score,
    )
    if not found:
        return so_far
    # A reading explains every gradient, but the one it names as formed otherwise.
    kept = {f.details.get("but") for f in found}
    grads = {n: so_far.grads[n] if n in kept else () for n in so_far.grads}
    return Explained(grads, (*so_far.whole, *found))


def _overflow(evidence: Evidence, so_far: Explained) -> Explained:
    assert evidence.inputs is not None
    nonfinite = {
        name: getattr(evidence.mine, name)
        for name, found in so_far.grads.items()
        if any(f.kind == "nonfinite" for f in found)
    }
    finding = overflow_finding(nonfinite, np.asarray(evidence.inputs[3]), evidence.actual.dtype)
    if finding is None:
        return so_far
    return dataclasses.replace(so_far, whole=(finding, *so_far.whole))


def _forward_right(evidence: Evidence, so_far: Explained) -> bool:
    """Whether ``dq`` passes (it reads the forward's states alone: they are right) and no
    reading explains the case."""
    dq = next((r for r in evidence.records if r.name == "dq"), None)
    read = any(f.kind == "misreading" for f in so_far.whole)
    return dq is not None and dq.passed and evidence.layout.seq > 1 and not read


#: What a step found where the forward is right says: the backward's hand-over.
_HANDED = (
    "the state's cotangent dS handed back across step {step} in the backward sweep (to the "
    "chunk before it) wrong? (dq passes: the forward's states are right)"
)


def _handed_back(evidence: Evidence, so_far: Explained) -> Explained:
    """Where ``dq`` passes, a step where the other gradients' error starts or stops is the
    backward sweep's, not a state the forward failed to carry: the cotangent ``dS`` handed
    to the chunk before. ``dstate`` failing alone with nothing found is the same sweep's
    end."""
    carried = evidence.layout.carry_state
    grads = {
        name: tuple(_backward_words(f, carried) for f in found)
        for name, found in so_far.grads.items()
    }
    if [r.name for r in evidence.failing] == ["dstate"] and not grads.get("dstate"):
        text = (
            "only dstate fails, and dq passes (the forward's states are right): the state's "
            "cotangent dS is wrong only where the backward sweep ends: its last hand-over or "
            "decay (dS handed to the chunk before with another chunk's decay?), or how dstate "
            "is written"
        )
        grads["dstate"] = (Finding("boundary", "dstate", text, {"step": None, "side": "end"}),)
    return Explained(grads, so_far.whole)


def _backward_words(finding: Finding, carried: bool) -> Finding:
    """``finding`` worded for the backward sweep where it is the backward's: wrong before a
    step (a run of steps ending at one) is what a wrong cotangent handed back across it does;
    an error fading from the first step is the initial state as the backward reads it, where
    one is ``carried`` (else it is what one made in the first steps does, as it says)."""
    details = finding.details
    step, side, last = details.get("step"), details.get("side"), details.get("last")
    ends = side == "window" and isinstance(last, int) and step == last + 1
    handed = isinstance(step, int) and (side == "before" or ends)
    if finding.kind != "boundary" or not (handed or (side == "fades" and carried)):
        return finding
    what = details.get("seen")
    assert isinstance(what, str)  # a boundary with a side says what it saw
    if handed:
        why = _HANDED.format(step=step)
    else:
        why = (
            "the initial state as the backward sweep reads it (the states it recomputes) "
            "wrong? (dq passes: the forward's states are right)"
        )
    return Finding(finding.kind, finding.gradient, f"{what}: {why}", details)


def _layout(evidence: Evidence, so_far: Explained) -> Explained:
    found = buffer_findings(evidence.actual, evidence.expected, evidence.layout, evidence.score)
    return dataclasses.replace(so_far, whole=(*so_far.whole, *found))


def _rows(evidence: Evidence, so_far: Explained) -> Explained:
    """Where every batch row holds the same inputs, and some rows of a failing gradient pass
    its criterion while others fail: the rows that fail, a kernel wrong in those rows alone
    (past the first, or in the first)."""
    assert evidence.inputs is not None
    batch = evidence.layout.batch
    same = all(
        a is None or all(np.array_equal(a[0], a[b]) for b in range(1, batch))
        for a in evidence.inputs
    )
    if batch < 2 or not same:
        return so_far
    failing = set()
    for record in evidence.failing:
        a, e = (np.asarray(g, np.float64) for g in _pair(evidence, record.name))
        failing |= {b for b in range(batch) if record.criterion.score(a[b], e[b]) > 1.0}
    if not failing or len(failing) == batch:
        return so_far
    rows = tuple(sorted(failing))
    where = "the rows after the first" if 0 not in rows else "those rows"
    finding = Finding(
        "rows",
        None,
        f"batch rows hold identical inputs, but row(s) {', '.join(map(str, rows))} fail where "
        f"the others pass: a bug in {where}?",
        {"rows": rows},
    )
    return dataclasses.replace(so_far, whole=(*so_far.whole, finding))


def _always(evidence: Evidence, so_far: Explained) -> bool:
    return True


#: The explainers, in the order they run; see the module docstring for each one's policy.
EXPLAINERS: Final = (
    Explainer("gradient", False, _always, _own_values),
    Explainer("misreading", True, _re_run_needed, _misreading),
    Explainer("overflow", True, _always, _overflow),
    Explainer("backward", False, _forward_right, _handed_back),
    Explainer("layout", False, lambda evidence, so_far: not so_far.whole, _layout),
    Explainer("rows", True, _always, _rows),
)


def explain(evidence: Evidence) -> tuple[tuple[GradComparison, ...], tuple[Finding, ...]]:
    """The records with their findings, and the buffer's findings, for a comparison in which
    some gradient failed."""
    so_far = Explained({})
    for explainer in EXPLAINERS:
        if explainer.needs_inputs and evidence.inputs is None:
            continue
        if explainer.runs(evidence, so_far):
            so_far = explainer.find(evidence, so_far)
    records = tuple(
        dataclasses.replace(r, findings=so_far.grads[r.name]) if r.name in so_far.grads else r
        for r in evidence.records
    )
    return records, so_far.whole

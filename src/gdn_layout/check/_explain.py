"""The second stage of a comparison: what explains the gradients that failed (docs/findings.md).

:func:`explain` takes the first stage's records and the buffers, unpacked once
(:class:`Evidence`), and asks in order: each failing gradient's own values
(:func:`~gdn_layout.check._findings.grad_findings`); with a fixture's inputs, the misreadings
(skipped when one gradient fails alone and a finding of :data:`~gdn_layout.check._findings.ALONE`
explains it; a reading found drops the gradients' own findings) and an overflow; where ``dq``
passes, a step where the error starts or stops worded for the backward sweep; the buffer's
other offsets when nothing above explains it as a whole; and batch rows of identical inputs
whose gradients differ.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._dtypes import Precision
from .._floors import Floors
from ..layout import GdnBackwardLayout
from ..packing import GdnGrads
from ._criterion import Scores
from ._findings import ALONE, Finding, buffer_findings, grad_findings
from ._misreadings import misreading_findings, overflow_finding
from ._records import GradComparison


@dataclass(frozen=True)
class Evidence:
    """What the explanations read: the records of the first stage, the buffers flat and
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
        return tuple(r for r in self.records if not r.passed)

    @functools.cached_property
    def score(self) -> Scores:
        """The findings' score: each gradient by its record's criterion."""
        return Scores({r.name: r.criterion for r in self.records}, self.floors, self.judged)

    def pair(self, name: str) -> tuple[NDArray[Any], NDArray[Any]]:
        return getattr(self.mine, name), getattr(self.theirs, name)


def explain(evidence: Evidence) -> tuple[tuple[GradComparison, ...], tuple[Finding, ...]]:
    """The records with their findings, and the buffer's findings, for a comparison in which
    some gradient failed."""
    layout, failing = evidence.layout, evidence.failing
    grads = {
        r.name: grad_findings(r.name, *evidence.pair(r.name), layout, evidence.score)
        for r in failing
    }
    whole: tuple[Finding, ...] = ()
    inputs = evidence.inputs
    if inputs is not None:
        alone = len(failing) == 1 and any(
            f.kind in ALONE and f.details.get("factor", 1.0) == 1.0 for f in grads[failing[0].name]
        )
        if not alone:
            names = layout.names
            whole = misreading_findings(
                {n: getattr(evidence.mine, n) for n in names},
                {n: getattr(evidence.theirs, n) for n in names},
                tuple(inputs),
                layout,
                evidence.score,
            )
            kept = {f.details.get("but") for f in whole}  # the gradient formed otherwise
            grads = (
                {n: found if n in kept else () for n, found in grads.items()} if whole else grads
            )
        nonfinite = {
            n: getattr(evidence.mine, n) for n, found in grads.items()
            if any(f.kind == "nonfinite" for f in found)
        }  # fmt: skip
        overflow = overflow_finding(nonfinite, np.asarray(inputs[3]), evidence.actual.dtype)
        whole = whole if overflow is None else (overflow, *whole)
    dq = next((r for r in evidence.records if r.name == "dq"), None)
    misread = any(f.kind == "misreading" for f in whole)
    if dq is not None and dq.passed and layout.seq > 1 and not misread:
        grads = _handed_back(grads, failing, layout.carry_state)
    if not whole:
        whole = buffer_findings(evidence.actual, evidence.expected, layout, evidence.score)
    if inputs is not None:
        whole += _rows(evidence, inputs)
    records = tuple(
        dataclasses.replace(r, findings=grads[r.name]) if r.name in grads else r
        for r in evidence.records
    )
    return records, whole


def _handed_back(
    grads: dict[str, tuple[Finding, ...]], failing: Sequence[GradComparison], carried: bool
) -> dict[str, tuple[Finding, ...]]:
    """Where ``dq`` passes (it reads the forward's states alone: they are right), a step
    where the other gradients' error stops is the backward sweep's hand-over of the state's
    cotangent, and an error fading from the first step is the initial state as the backward
    reads it (where one is ``carried``). ``dstate`` failing alone with nothing found is that
    sweep's end."""
    out = {}
    for name, found in grads.items():
        out[name] = tuple(_backward_words(f, carried) for f in found)
    if [r.name for r in failing] == ["dstate"] and not out.get("dstate"):
        text = (
            "only dstate fails, and dq passes (the forward's states are right): the state's "
            "cotangent dS is wrong only where the backward sweep ends: its last hand-over or "
            "decay (dS handed to the chunk before with another chunk's decay?), or how dstate "
            "is written"
        )
        out["dstate"] = (Finding("boundary", "dstate", text, {"step": None, "side": "end"}),)
    return out


def _backward_words(finding: Finding, carried: bool) -> Finding:
    details = finding.details
    step, side, last = details.get("step"), details.get("side"), details.get("last")
    # Wrong before a step (a run of steps ending at one) is a wrong cotangent handed back.
    ends = side == "window" and isinstance(last, int) and step == last + 1
    handed = isinstance(step, int) and (side == "before" or ends)
    if finding.kind != "boundary" or not (handed or (side == "fades" and carried)):
        return finding
    if handed:
        why = (
            f"the state's cotangent dS handed back across step {step} in the backward sweep (to "
            "the chunk before it) wrong? (dq passes: the forward's states are right)"
        )
    else:
        why = (
            "the initial state as the backward sweep reads it (the states it recomputes) "
            "wrong? (dq passes: the forward's states are right)"
        )
    return Finding(finding.kind, finding.gradient, f"{details['seen']}: {why}", details)


def _rows(evidence: Evidence, inputs: Sequence[NDArray[Any] | None]) -> tuple[Finding, ...]:
    """``rows``: every batch row holds the same inputs, and some rows of a failing gradient
    pass its criterion while others fail."""
    batch = evidence.layout.batch
    same = all(
        a is None or all(np.array_equal(a[0], a[b]) for b in range(1, batch)) for a in inputs
    )
    if batch < 2 or not same:
        return ()
    failing: set[int] = set()
    for record in evidence.failing:
        a, e = (np.asarray(g, np.float64) for g in evidence.pair(record.name))
        failing |= {b for b in range(batch) if record.criterion.score(a[b], e[b]) > 1.0}
    if not failing or len(failing) == batch:
        return ()
    rows = tuple(sorted(failing))
    where = "the rows after the first" if 0 not in rows else "those rows"
    text = (
        f"batch rows hold identical inputs, but row(s) {', '.join(map(str, rows))} fail where "
        f"the others pass: a bug in {where}?"
    )
    return (Finding("rows", None, text, {"rows": rows}),)

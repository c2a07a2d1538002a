"""The summary across cases (``gdn_layout.summary``): each statement on a panel of real
comparisons where it holds and on one where it does not, the counts, the causes (verified
ones first), the precision hint with a TF32 kernel, and the records' JSON."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gdn_layout import GdnBackwardLayout, GdnGrads, unpack
from gdn_layout.generate import CHUNK_SIZES
from gdn_layout.layout import GRADIENT_NAMES
from gdn_layout.reference import backward
from gdn_layout.suites import Case, make_case
from gdn_layout.summary import CaseResult, GradResult, Summary, case_result, summarize

#: The longest sequence of the panel: a few steps past a chunk boundary of the suite's.
LONG = CHUNK_SIZES[2] + 6
#: The boundary a bug past it is said to follow: the largest chunk size the sequence passes.
PASSED = max(c for c in CHUNK_SIZES if c < LONG)
SHAPES = ((1, 1, 1, 4), (2, 5, 2, 4), (1, LONG, 1, 4))
REGIMES = ("zero", "mild")

Bug = Callable[[Case, GdnGrads], None]


@pytest.fixture(scope="module")
def panel() -> list[tuple[Case, np.ndarray[Any, Any]]]:
    """Small cases of every gate and state mode, in two regimes, each with the output of a
    correct float32 kernel."""
    cases = [
        make_case(GdnBackwardLayout(*shape, gate_per_channel=ch, carry_state=st), regime=r)
        for shape, ch, st, r in itertools.product(SHAPES, (False, True), (False, True), REGIMES)
    ]
    return [(c, backward(*c.inputs, dtype=np.float32)) for c in cases]


def summary_of(panel: list[tuple[Case, Any]], bug: Bug) -> Summary:
    results = []
    for case, correct in panel:
        out = correct.copy()
        bug(case, unpack(out, case.layout))
        results.append((case, case.compare(out)))
    return summarize(results)


def _scaled(grad: str, by: float, when: Callable[[Case], bool]) -> Bug:
    """A bug: ``grad`` scaled by ``by`` in the cases ``when`` holds for."""

    def bug(case: Case, grads: GdnGrads) -> None:
        if getattr(grads, grad) is not None and when(case):
            getattr(grads, grad)[...] *= by

    return bug


def _dstate(when: Callable[[Case], bool]) -> Bug:
    return _scaled("dstate", 1.5, when)


def _dk(when: Callable[[Case], bool]) -> Bug:
    return _scaled("dk", 0.5, when)


def _dq(when: Callable[[Case], bool]) -> Bug:
    return _scaled("dq", 2, when)


def _always(case: Case) -> bool:
    return True


#: (statement, a bug confined to its dimension, a bug that crosses it)
STATEMENTS = [
    (
        f"fails only with S > {PASSED}: a chunk hand-over",
        _dstate(lambda c: c.layout.seq > PASSED),
        _dstate(_always),
    ),
    (
        "fails only with a carried state",
        _dstate(_always),
        _dq(lambda c: c.layout.carry_state or c.layout.batch > 1),
    ),
    (
        "fails only with per-channel gates",
        _dk(lambda c: c.layout.gate_per_channel),
        _dk(lambda c: c.layout.gate_per_channel or c.layout.batch > 1),
    ),
    (
        "fails only with B > 1",
        _dq(lambda c: c.layout.batch > 1),
        _dq(lambda c: c.layout.batch > 1 or c.layout.seq == 1),
    ),
    (
        "never fails under the zero regime: the gate's path",
        _dq(lambda c: c.regime != "zero" and c.layout.gate_per_channel),
        _dq(lambda c: c.layout.gate_per_channel),
    ),
    ("passes every case of one step", _dq(lambda c: c.layout.seq > 1), _dq(_always)),
]


@pytest.mark.parametrize(
    ("statement", "holds", "crossed"), STATEMENTS, ids=[s[0] for s in STATEMENTS]
)
def test_a_statement_is_made_where_it_holds_and_only_there(
    panel: list[tuple[Case, Any]], statement: str, holds: Bug, crossed: Bug
) -> None:
    said = summary_of(panel, holds)
    assert any(line.startswith(statement) for line in said.statements), said
    assert statement in "\n".join(str(said).splitlines()[:3])  # among the first lines
    other = summary_of(panel, crossed)
    assert not other.passed
    assert not any(line.startswith(statement) for line in other.statements), other


def test_the_counts_name_each_failing_gradient_and_those_that_never_fail(
    panel: list[tuple[Case, Any]],
) -> None:
    summary = summary_of(panel, _dk(lambda c: c.layout.gate_per_channel))
    channel = sum(c.layout.gate_per_channel for c, _ in panel)
    assert summary.failures == {"dk": channel}
    assert len(summary.failed) == channel
    assert summary.total == len(panel)
    assert summary.never == tuple(n for n in GRADIENT_NAMES if n != "dk")
    head = str(summary).splitlines()[0]
    assert head == (
        f"{channel} of {len(panel)} cases failed: dk {channel}; "
        f"{', '.join(summary.never)} never fail"
    )
    # Without a passing case of one step, nothing is said of the steps.
    longer = [(case, out) for case, out in panel if case.layout.seq > 1]
    summary = summary_of(longer, _dq(lambda c: c.layout.gate_per_channel))
    assert "fails only with per-channel gates" in summary.statements
    assert not any(" S " in line or "one step" in line for line in summary.statements), summary


def test_a_gradient_s_own_statement_where_it_separates_better(
    panel: list[tuple[Case, Any]],
) -> None:
    dstate = _dstate(lambda c: c.layout.seq > PASSED)
    dq = _dq(lambda c: c.layout.gate_per_channel and not c.layout.carry_state)

    def both(case: Case, grads: GdnGrads) -> None:
        dstate(case, grads)
        dq(case, grads)

    summary = summary_of(panel, both)
    assert f"dstate fails only with S > {PASSED}: a chunk hand-over" in "\n".join(
        summary.statements
    )
    assert not any(s.startswith("fails only with S") for s in summary.statements)
    # Without the second bug, the statement is the cases' own, said once.
    alone = summary_of(panel, dstate)
    assert not any(s.startswith("dstate ") for s in alone.statements)


def test_every_case_passing_is_one_line_with_the_float64_suite_s_note(
    panel: list[tuple[Case, Any]],
) -> None:
    summary = summary_of(panel, lambda c, g: None)
    lines = str(summary).splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"all {len(panel)} cases passed; ")
    assert "float64" in lines[0]
    case = make_case(GdnBackwardLayout(1, 3, 2, 4), dtype=np.float64)
    alone = summarize([(case, case.compare(backward(*case.inputs)))])
    assert str(alone) == "all 1 cases passed"


def test_a_verified_misreading_comes_before_the_other_causes() -> None:
    panel_kernels = pytest.importorskip("panel")
    pytest.importorskip("torch")
    cases = [
        make_case(GdnBackwardLayout(1, s, 2, 4, carry_state=st), regime="mild")
        for s in (3, 5)
        for st in (False, True)
    ]
    results = []
    for case in cases:
        if case.layout.carry_state:
            out = panel_kernels.misread(case.fixture, "state_transposed")
        else:
            out = np.array(case.expected)
            unpack(out, case.layout).dq[...] *= 2
        results.append((case, case.compare(out)))
    summary = summarize(results)
    lines = str(summary).splitlines()
    verified = next(i for i, line in enumerate(lines) if "verified by a re-run" in line)
    other = next(i for i, line in enumerate(lines) if "likely cause" in line)
    assert verified < other
    assert "in 2 cases" in lines[verified]
    assert "read transposed" in lines[verified]
    assert summary.verified
    assert len(summary.verified) == 1


@pytest.mark.slow
def test_the_precision_hint_names_tf32_for_a_tf32_kernel_and_none_for_a_float32_one() -> None:
    panel_kernels = pytest.importorskip("panel")
    pytest.importorskip("torch")
    cases = [
        make_case(GdnBackwardLayout(1, s, 2, 16, carry_state=st), regime="mild")
        for s in (8, 20)
        for st in (False, True)
    ]
    tf32 = summarize(
        [(c, c.compare(panel_kernels.chunked(c.fixture, "tf32", chunk=16))) for c in cases],
        command="pytest",
    )
    assert not tf32.passed
    assert tf32.precision_class == "tf32"
    assert tf32.precision_hint is not None
    assert tf32.precision_hint.endswith("use --gdn-precision tf32")
    assert "every failing case passes as tf32" in "\n".join(str(tf32).splitlines()[:2])
    # Judged as tf32, the same outputs pass.
    assert all(
        c.compare(panel_kernels.chunked(c.fixture, "tf32", chunk=16), precision="tf32").passed
        for c in cases
    )
    exact = summarize([(c, c.compare(panel_kernels.chunked(c.fixture, chunk=16))) for c in cases])
    assert exact.passed
    assert exact.precision_hint is None


def test_failures_with_structure_get_no_precision_hint(panel: list[tuple[Case, Any]]) -> None:
    summary = summary_of(panel, _dstate(lambda c: c.layout.seq > PASSED))
    assert summary.precision_hint is None
    # Some cases too small for a finding beside others with one: their bug, not rounding.
    small = summary_of(panel, _dk(lambda c: c.layout.gate_per_channel))
    assert any(line.startswith("no finding in") for line in small.causes)
    assert any("(dk, scale)" in line for line in small.causes)
    assert small.precision_hint is None
    # An unexplained error no class accounts for is said to be more than rounding.
    unexplained = summary_of(panel, _dq(lambda c: c.layout.seq == 1))
    assert unexplained.precision_class is None
    assert unexplained.precision_hint is not None
    assert "not rounding alone" in str(unexplained)


_NAMES = st.text(min_size=1, max_size=8)
_FIGURES = st.floats()
_GRADS = st.builds(
    GradResult,
    name=st.sampled_from(GRADIENT_NAMES),
    passed=st.booleans(),
    error_floor_ratio=st.none() | _FIGURES,
    rms_ratio=_FIGURES,
    max_abs_error=_FIGURES,
    precision=st.none() | st.sampled_from(("float32", "tf32")),
    passes_as=st.lists(st.sampled_from(("tf32", "bfloat16")), max_size=2).map(tuple),
)
_RESULTS = st.builds(
    CaseResult,
    name=_NAMES,
    batch=st.integers(0, 9),
    seq=st.integers(0, 600),
    heads=st.integers(0, 9),
    state_size=st.integers(0, 200),
    per_channel=st.booleans(),
    carry_state=st.booleans(),
    regime=st.none() | st.sampled_from(("zero", "mild")),
    dtype=st.sampled_from(("float32", "float64")),
    grads=st.lists(_GRADS, max_size=6).map(tuple),
    findings=st.lists(
        st.tuples(st.sampled_from(("scale", "rounding")), st.none() | _NAMES, _NAMES), max_size=3
    ).map(tuple),
)


@given(_RESULTS)
def test_every_case_result_survives_json(record: CaseResult) -> None:
    back = CaseResult.from_dict(json.loads(json.dumps(record.to_dict(), allow_nan=False)))
    assert str(back) == str(record)  # NaN is not equal to itself: compared as text
    assert str(summarize([back])) == str(summarize([record]))


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match=r"summarize: results\[0\] must be a CaseResult .* got int"):
        summarize([1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="summarize: command must be one of python, pytest, cli"):
        summarize([], command="make")
    with pytest.raises(ValueError, match=r"CaseResult\.from_dict: the record has no key 'grads'"):
        CaseResult.from_dict({"name": "x"})
    with pytest.raises(ValueError, match=r"CaseResult\.from_dict: expected a mapping, got list"):
        CaseResult.from_dict([])
    case = make_case(GdnBackwardLayout(1, 2, 1, 2))
    with pytest.raises(TypeError, match="case_result: comparison must be a Comparison, got str"):
        case_result(case, "no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="case_result: case must be a Case, got str"):
        case_result("no", case.compare(case.expected))  # type: ignore[arg-type]
    first = case.compare(case.expected)
    assert case.last_comparison is first  # what the plugin's summary reads

"""The standard suite reaches every chunk boundary a kernel is likely to use, and a kernel that
drops its state at a boundary past the first suite's sequences fails it."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, compare, unpack
from gdn_layout.files import Fixture
from gdn_layout.reference import backward
from gdn_layout.regimes import REGIMES
from gdn_layout.suites import Case, make_case

generate = importlib.import_module("gdn_layout.generate")
CASES = list(generate._suite_cases())


@pytest.mark.parametrize("chunk", generate.CHUNK_SIZES)
@pytest.mark.parametrize("regime", REGIMES)
def test_every_regime_crosses_two_boundaries_of_every_chunk_size(chunk: int, regime: str) -> None:
    layouts = [c.layout for c in CASES if c.regime == regime]
    assert max(layout.seq for layout in layouts) > 2 * chunk
    for per_channel in (False, True):
        for carry in (False, True):
            assert any(
                (layout.seq - 1) // chunk >= 2
                and (layout.gate_per_channel, layout.carry_state) == (per_channel, carry)
                for layout in layouts
            )


@pytest.mark.parametrize("chunk", generate.CHUNK_SIZES)
def test_a_last_chunk_of_one_step_and_one_short_of_full(chunk: int) -> None:
    seqs = {c.layout.seq for c in CASES}
    assert any(seq % chunk == 1 for seq in seqs if seq > chunk)
    assert any(seq % chunk == chunk - 1 for seq in seqs)


def test_n128_reaches_256_steps_and_identical_rows_are_there() -> None:
    assert any(c.layout.state_size == 128 and c.layout.seq >= 256 for c in CASES)
    twins = [c for c in CASES if c.identical_rows]
    assert {c.regime for c in twins} == set(REGIMES)
    assert all(c.layout.batch >= 2 and c.layout.seq > 128 for c in twins)


def test_identical_rows_hold_the_same_inputs_and_gradients() -> None:
    case = next(c for c in CASES if c.identical_rows and c.layout.carry_state)
    fixture = generate._identical_rows_fixture(case.layout, np.dtype(np.float32), "mixed", 5)
    for name, array in fixture.tensors().items():
        rows = unpack(array, case.layout) if name == "packed" else [array]
        for part in rows:
            if part is not None:
                assert all(np.array_equal(part[0], part[b]) for b in range(1, len(part))), name


def test_the_manifest_records_the_boundaries_each_case_crosses() -> None:
    assert generate.boundaries_crossed(513) == {16: 32, 32: 16, 64: 8, 128: 4, 256: 2}
    assert generate.boundaries_crossed(256) == {16: 15, 32: 7, 64: 3, 128: 1, 256: 0}
    assert generate.boundaries_crossed(1) == dict.fromkeys(generate.CHUNK_SIZES, 0)
    assert generate.boundaries_crossed(0) == dict.fromkeys(generate.CHUNK_SIZES, 0)


def _dropped_state(fixture: Fixture, t: int, dtype: Any) -> NDArray[Any]:
    """A chunked kernel that forgets the state at step ``t``: two independent scans."""
    x, layout = fixture.inputs, fixture.layout
    q, k, v, g, beta, dy = x[:6]
    head = backward(
        q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], dy[:, :t], x.state, dtype=dtype
    )
    tail = backward(q[:, t:], k[:, t:], v[:, t:], g[:, t:], beta[:, t:], dy[:, t:], dtype=dtype)
    first = unpack(head, GdnBackwardLayout.from_inputs(x.q[:, :t], x.g[:, :t], x.state))
    second = unpack(tail, GdnBackwardLayout.from_inputs(x.q[:, t:], x.g[:, t:]))
    out = np.empty(layout.total_elems, dtype)
    grads = unpack(out, layout)
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        getattr(grads, name)[:, :t] = getattr(first, name)
        getattr(grads, name)[:, t:] = getattr(second, name)
    if grads.dstate is not None:
        grads.dstate[...] = first.dstate
    return out


@pytest.mark.slow
@pytest.mark.parametrize("t", [48, 128, 256])
@pytest.mark.parametrize("regime", REGIMES)
def test_a_state_dropped_past_the_first_suites_sequences_fails(t: int, regime: str) -> None:
    # The first suite's longest sequence was 100: a state dropped at 128 or 256 passed it.
    # The chunk-boundary shapes, in two of their gate and state modes.
    cases = [
        c
        for c in CASES
        if c.regime == regime
        and c.layout.seq > t
        and c.name.startswith(("s255", "s513"))
        and c.layout.gate_per_channel != c.layout.carry_state
    ]
    assert cases
    caught = above_rounding = 0
    for case in cases:
        fixture = generate.make_fixture(case.layout, regime=regime, seed=7)
        truth = np.asarray(fixture.packed, np.float64)
        change = np.abs(_dropped_state(fixture, t, np.float64) - truth).max()
        if change <= 1e-5 * np.sqrt(np.mean(np.square(truth))):
            continue  # the decay erased the state before t: nothing to catch in float32
        above_rounding += 1
        result = compare(
            _dropped_state(fixture, t, np.float32),
            fixture.packed,
            fixture.layout,
            floors=fixture.floors,
        )
        caught += not result.passed
    assert caught == above_rounding
    if regime in ("zero", "mild", "mixed"):  # the state lives past t: the change is there
        assert above_rounding > 0


def test_a_kernel_wrong_past_the_first_row_is_named_on_identical_rows() -> None:
    case = next(c for c in CASES if c.identical_rows and c.regime == "mixed")
    fixture = generate._identical_rows_fixture(case.layout, np.dtype(np.float32), "mixed", 11)
    suite_case = Case(case.name, fixture)
    good = backward(*fixture.inputs, dtype=np.float32)
    suite_case.check(good)
    row_bug = good.copy()
    unpack(row_bug, case.layout).dv[1] *= 1.5  # only the second row is wrong
    with pytest.raises(AssertionError, match=r"row\(s\) 1 differ from row 0's") as info:
        suite_case.check(row_bug)
    assert "dv" in str(info.value)
    everywhere = good.copy()
    unpack(everywhere, case.layout).dv[...] *= 1.5  # every row wrong alike: no such line
    with pytest.raises(AssertionError) as info:
        suite_case.check(everywhere)
    assert "identical inputs" not in str(info.value)
    other = make_case(GdnBackwardLayout(2, 5, 2, 4), seed=1)  # rows of their own
    wrong = backward(*other.inputs, dtype=np.float32)
    unpack(wrong, other.layout).dv[1] *= 1.5
    with pytest.raises(AssertionError) as info:
        other.check(wrong)
    assert "identical inputs" not in str(info.value)

"""``compare`` on inputs that used to fool it: masked arrays, ndarray subclasses that change
their values, and finite values so large that their squares and differences overflow."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.check import compare, error_map

LAYOUT = GdnBackwardLayout(1, 2, 2, 3)


def test_a_masked_array_is_refused() -> None:
    expected = np.zeros(LAYOUT.total_elems)
    for hidden in (np.nan, 1e6):
        actual = np.ma.masked_array(expected.copy(), mask=np.zeros(LAYOUT.total_elems, bool))
        actual[3] = np.ma.masked
        actual.data[3] = hidden
        with pytest.raises(TypeError, match="compare: actual is a masked array"):
            compare(actual, expected, LAYOUT)
        with pytest.raises(TypeError, match="compare: expected is a masked array"):
            compare(expected, actual, LAYOUT)
        with pytest.raises(TypeError, match="error_map: actual is a masked array"):
            error_map(actual, expected, LAYOUT, "dq")


class _Doubled(np.ndarray):
    """Shows every value doubled: its values are not its data."""

    def __getitem__(self, key: Any) -> Any:
        return np.asarray(super().__getitem__(key)) * 2


class _Tagged(np.ndarray):
    """A subclass that changes nothing about its values."""


def test_a_subclass_that_changes_its_values_is_refused() -> None:
    expected = np.ones(LAYOUT.total_elems)
    doubled = expected.copy().view(_Doubled)
    with pytest.raises(TypeError, match="actual is a _Doubled, an ndarray subclass that overri"):
        compare(doubled, expected, LAYOUT)
    assert compare(np.asarray(doubled), expected, LAYOUT).passed


def test_plain_subclasses_and_memory_maps_are_compared(tmp_path: Any) -> None:
    expected = np.ones(LAYOUT.total_elems)
    assert compare(expected.copy().view(_Tagged), expected, LAYOUT).passed
    mapped = np.memmap(tmp_path / "m.bin", np.float64, "w+", shape=expected.shape)
    mapped[:] = expected
    assert compare(mapped, expected, LAYOUT).passed


@pytest.mark.parametrize("count", [1, 48, LAYOUT.shape("dq")[-1] * 4])
def test_rms_ratio_is_exact_up_to_the_largest_finite_values(count: int) -> None:
    expected = np.zeros(LAYOUT.total_elems)
    actual = expected.copy()
    unpack(expected, LAYOUT).dq.reshape(-1)[:count] = 1.7e308
    unpack(actual, LAYOUT).dq.reshape(-1)[:count] = 1e308
    grad = compare(actual, expected, LAYOUT, max_rms_ratio=0.01)["dq"]
    assert grad.rms_ratio == pytest.approx(0.7 / 1.7, rel=1e-12)
    assert not grad.passed
    assert grad.max_rel_error == pytest.approx(0.7 / 1.7, rel=1e-12)


def test_differences_past_the_largest_float() -> None:
    # |a - e| = 3.4e308 overflows; the ratio, 2, does not.
    expected = np.zeros(LAYOUT.total_elems)
    actual = expected.copy()
    unpack(expected, LAYOUT).dk[...] = 1.7e308
    unpack(actual, LAYOUT).dk[...] = -1.7e308
    unpack(expected, LAYOUT).dk[0, 0, 0, 0] = 1.0
    unpack(actual, LAYOUT).dk[0, 0, 0, 0] = 1.0
    grad = compare(actual, expected, LAYOUT, max_rms_ratio=2.5)["dk"]
    assert grad.rms_ratio == pytest.approx(2.0, rel=1e-12)
    assert grad.max_rel_error == pytest.approx(2.0, rel=1e-12)
    assert grad.max_abs_error == np.inf  # past the largest float, which is what it says
    assert grad.passed
    assert grad.mismatches == 0  # judged by the RMS ratio alone: no element is counted
    elementwise = compare(actual, expected, LAYOUT, rtol=0.5)["dk"]
    assert elementwise.mismatches == LAYOUT.segment("dk").length - 1  # all but the equal one

"""compare and assert_close: per-gradient errors, coordinates, criteria, NaN/Inf, reports.

``compare`` on inputs that used to fool it: masked arrays, ndarray subclasses that change
their values, and finite values so large that their squares and differences overflow.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, GdnGrads, unpack
from gdn_layout._stats import grad_stats, grads_html, grads_text
from gdn_layout._tables import html_table
from gdn_layout.check import Comparison, assert_close, compare, error_map
from gdn_layout.generate import make_fixture
from gdn_layout.layout import layout_caption, layout_html, layout_table, layout_text
from gdn_layout.reference import backward
from support import DeviceArray

FLAGS = [(False, False), (True, False), (False, True), (True, True)]


def _layout(per_channel: bool = False, carry: bool = False) -> GdnBackwardLayout:
    return GdnBackwardLayout(2, 5, 3, 4, gate_per_channel=per_channel, carry_state=carry)


def _reference(layout: GdnBackwardLayout, seed: int = 0) -> NDArray[np.float64]:
    # Values bounded away from zero so that relative errors are finite and well defined.
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], layout.total_elems)
    values: NDArray[np.float64] = signs * rng.uniform(0.5, 2.0, layout.total_elems)
    return values


def _coordinate(shape: tuple[int, ...]) -> tuple[int, ...]:
    # An interior, asymmetric element, so transposed axes would be caught.
    return tuple(d - 1 - (i % 2) if d > 1 else 0 for i, d in enumerate(shape))


# -- agreement and located errors ------------------------------------------------------------


@pytest.mark.parametrize(("per_channel", "carry"), FLAGS)
def test_a_correct_kernel_in_another_order_passes(per_channel: bool, carry: bool) -> None:
    # The chunked float32 form against the float64 truth and the floors of the step-by-step
    # float32 form: not the same bits, and not the computation the floors were measured on.
    fx = make_fixture(_layout(per_channel, carry), dtype=np.float64, regime="mixed", seed=3)
    actual = backward(*fx.inputs, dtype=np.float32)
    result = compare(actual, fx.packed, fx.layout, floors=fx.floors, scales=fx.scales)
    assert result.passed, str(result)
    assert result.failed == ()
    assert result.names == fx.layout.names
    assert any(grad.max_abs_error > 0 for grad in result.grads)
    for grad in result.grads:
        assert grad.mismatches == 0
        assert grad.size == fx.layout.segment(grad.name).length
        assert grad.error_floor_ratio is not None
        assert grad.error_floor_ratio <= grad.criterion.limit
    assert_close(actual, fx.packed, fx.layout, floors=fx.floors, scales=fx.scales)


@pytest.mark.parametrize(("per_channel", "carry"), FLAGS)
def test_injected_error_is_located_in_each_gradient(per_channel: bool, carry: bool) -> None:
    layout = _layout(per_channel, carry)
    expected = _reference(layout)
    for name in layout.names:
        actual = expected.copy()
        view = getattr(unpack(actual, layout), name)
        where = _coordinate(view.shape)
        before = float(view[where])
        view[where] += 0.25
        result = compare(actual, expected, layout)
        assert result.failed == (name,)
        grad = result[name]
        assert grad.worst == where
        assert grad.mismatches == 1
        assert grad.worst_actual == pytest.approx(before + 0.25)
        assert grad.worst_expected == before
        assert grad.max_abs_error == pytest.approx(0.25)
        assert grad.max_rel_error == pytest.approx(0.25 / abs(before))
        assert len(grad.axes) == len(grad.shape)
        emap = grad.error_map
        peak = tuple(int(i) for i in np.unravel_index(int(np.argmax(emap)), emap.shape))
        if name == "dstate":
            _, h, i, _ = where
            assert emap.shape == (layout.state_size, layout.heads)
            assert peak == (i, h)
        else:
            assert emap.shape == (layout.seq, layout.heads)
            assert peak == (where[1], where[2])
        # The map by hand: the one error at its (s, h), or (i, h) for dstate; zero elsewhere.
        by_hand = np.zeros_like(emap)
        by_hand[peak] = abs(float(view[where]) - before)
        np.testing.assert_array_equal(emap, by_hand)
        np.testing.assert_array_equal(error_map(actual, expected, layout, name), by_hand)
        assert not emap.flags.writeable


def test_axes_name_the_coordinates() -> None:
    full = _reference(_layout(True, True))
    result = compare(full, full, _layout(True, True))
    assert result["dq"].axes == ("b", "s", "h", "n")
    assert result["dg"].axes == ("b", "s", "h", "n")
    assert result["dbeta"].axes == ("b", "s", "h")
    assert result["dstate"].axes == ("b", "h", "i", "j")
    plain = _reference(_layout())
    assert compare(plain, plain, _layout())["dg"].axes == ("b", "s", "h")


def test_mismatch_count_and_worst_is_furthest_out_of_tolerance() -> None:
    layout = _layout()
    expected = np.full(layout.total_elems, 1.0)
    actual = expected.copy()
    dv = unpack(actual, layout).dv
    dv[0, 0, 0, 0] += 1e-3
    dv[1, 4, 2, 3] += 5e-3
    dv[1, 2, 1, 1] += 1e-9  # within tolerance: counted nowhere
    grad = compare(actual, expected, layout, rtol=0.0, atol=1e-6)["dv"]
    assert grad.mismatches == 2
    assert grad.worst == (1, 4, 2, 3)


def test_worst_elementwise_prefers_the_element_beyond_tolerance() -> None:
    # The largest absolute error sits on a large value and is within rtol; the small one is
    # not: the report must point at the failing element.
    layout = _layout()
    expected = np.full(layout.total_elems, 1.0)
    dk = unpack(expected, layout).dk
    dk[0, 1, 1, 1] = 1000.0
    actual = expected.copy()
    unpack(actual, layout).dk[0, 1, 1, 1] += 0.5
    unpack(actual, layout).dk[1, 3, 0, 2] += 0.01
    grad = compare(actual, expected, layout, rtol=1e-3, atol=0.0)["dk"]
    assert grad.mismatches == 1
    assert grad.worst == (1, 3, 0, 2)
    assert grad.max_abs_error == pytest.approx(0.5)
    rms = compare(actual, expected, layout, max_rms_ratio=1.0)["dk"]
    assert rms.worst == (0, 1, 1, 1)  # RMS mode: the largest |a - e|


# -- criteria -------------------------------------------------------------------------------


def test_rms_ratio_passes_uniform_bf16_noise_that_fails_elementwise() -> None:
    layout = GdnBackwardLayout(2, 16, 4, 16, gate_per_channel=True, carry_state=True)
    rng = np.random.default_rng(1)
    expected = rng.standard_normal(layout.total_elems)
    # Relative noise about bf16's rounding error, applied uniformly to every element.
    actual = expected * (1 + 4e-3 * rng.standard_normal(expected.size))
    elementwise = compare(actual, expected, layout, rtol=1e-4, atol=1e-6)
    assert set(elementwise.failed) == set(layout.names)
    by_rms = compare(actual, expected, layout, max_rms_ratio=1e-2)
    assert by_rms.passed
    for grad in by_rms.grads:
        assert grad.criterion.mode == "rms"
        assert 2e-3 < grad.rms_ratio < 6e-3
        assert grad.mismatches == 0  # out/size counts what the RMS criterion counts
    assert not compare(actual, expected, layout, max_rms_ratio=1e-3).passed
    # rtol/atol given with max_rms_ratio: both apply.
    both = compare(actual, expected, layout, rtol=1e-4, atol=1e-6, max_rms_ratio=1e-2)
    assert set(both.failed) == set(layout.names)
    assert all(g.criterion.mode == "both" and g.mismatches > 0 for g in both.grads)
    assert both["dq"].criterion.words == "rtol=0.0001 atol=1e-06 rms ratio<=0.01"


def test_rms_ratio_definition() -> None:
    layout = GdnBackwardLayout(1, 1, 1, 2)  # dq, dk, dv of 2, dg, dbeta of 1
    expected = np.array([3.0, 4.0] * 3 + [1.0, 1.0])
    actual = expected.copy()
    actual[0:2] = [3.3, 3.6]  # diff (0.3, -0.4): rms 0.3536, rms(e) 3.5355
    grad = compare(actual, expected, layout, max_rms_ratio=0.2)["dq"]
    assert grad.rms_ratio == pytest.approx(0.1)
    assert grad.passed
    assert not compare(actual, expected, layout, max_rms_ratio=0.09)["dq"].passed


@pytest.mark.parametrize("magnitude", [1.5e154, 1e300, 1e-160, 1e-300])
def test_rms_ratio_neither_overflows_nor_underflows(magnitude: float) -> None:
    # Squares of these values leave float64's range; the ratio must not.
    layout = GdnBackwardLayout(1, 3, 2, 2)
    expected = np.full(layout.total_elems, magnitude)
    actual = expected * 1.2  # every element 20% off
    grad = compare(actual, expected, layout, max_rms_ratio=1e-3)["dq"]
    assert grad.rms_ratio == pytest.approx(0.2)
    assert not grad.passed


def test_rms_ratio_across_chunks_of_different_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    chunking = importlib.import_module("gdn_layout.check._scan")
    monkeypatch.setattr(chunking, "CHUNK_ELEMENTS", 4)  # one row of dq per chunk
    layout = GdnBackwardLayout(1, 3, 1, 4)
    expected = np.ones(layout.total_elems)
    expected[:12] = np.repeat([1e-200, 1.0, 1e200], 4)
    actual = expected.copy()
    actual[:12] += np.repeat([1e-201, 0.0, 3e199], 4)
    # sqrt((4e-402 + 4 * 9e398) / (4e-400 + 4 + 4e400)), where only the 1e200 row counts.
    assert compare(actual, expected, layout)["dq"].rms_ratio == pytest.approx(0.3)


def test_zero_reference_rms_ratio() -> None:
    layout = GdnBackwardLayout(1, 2, 1, 2)
    zeros = np.zeros(layout.total_elems)
    assert compare(zeros, zeros, layout, max_rms_ratio=0.0).passed
    actual = zeros.copy()
    actual[0] = 1e-12
    grad = compare(actual, zeros, layout, max_rms_ratio=0.5)["dq"]
    assert grad.rms_ratio == math.inf
    assert grad.max_rel_error == math.inf
    assert not grad.passed


def test_per_gradient_tolerance_mappings() -> None:
    layout = _layout(carry=True)
    expected = _reference(layout)
    actual = expected.copy()
    grads = unpack(actual, layout)
    grads.dg[...] *= 1 + 1e-3
    assert grads.dstate is not None
    grads.dstate[...] *= 1 + 1e-2
    result = compare(actual, expected, layout, rtol={"dg": 2e-3}, max_rms_ratio={"dstate": 0.02})
    assert result.passed
    assert result["dg"].criterion.rtol == 2e-3
    assert result["dstate"].criterion.mode == "rms"
    assert (
        result["dq"].criterion.mode == "calibrated"
    )  # the default for the names a mapping leaves out
    assert compare(actual, expected, layout, rtol={"dg": 2e-3}).failed == ("dstate",)
    assert compare(actual, expected, layout, atol={"dg": 1.0, "dstate": 1.0}).passed
    # dstate may be named for a layout without it, so one mapping fits every flag combination.
    stateless = _reference(_layout())
    assert compare(stateless, stateless, _layout(), atol={"dstate": 1.0}).passed


def test_default_tolerances_follow_the_less_precise_dtype() -> None:
    layout = _layout()
    expected = _reference(layout)
    # Given one of rtol and atol, the other defaults by the less precise dtype.
    f32 = expected.astype(np.float32)
    assert compare(f32, expected, layout, atol=1e-5)["dq"].criterion.rtol == 1.3e-6
    assert (
        compare(expected, expected.astype(np.float16), layout, atol=0)["dq"].criterion.rtol == 1e-3
    )
    bf16 = expected.astype(ml_dtypes.bfloat16)
    assert compare(bf16, expected.astype(np.float16), layout, atol=0)["dq"].criterion.rtol == 1.6e-2
    assert compare(expected, expected, layout, rtol=0)["dq"].criterion.atol == 1e-7
    # Given neither, every dtype is judged against its floors (longdouble as float64).
    assert compare(expected, expected, layout)["dq"].criterion.precision_name == "float64"
    wide = expected.astype(np.longdouble)
    assert compare(wide, wide, layout)["dq"].criterion.words == "error/floor<=64 (float64)"
    assert compare(f32, expected, layout)["dq"].criterion.mode == "calibrated"
    assert compare(f32, expected, layout)["dq"].criterion.precision_name == "float32"
    assert (
        compare(bf16, expected.astype(np.float16), layout)["dq"].criterion.precision_name
        == "bfloat16"
    )


# -- NaN and Inf ----------------------------------------------------------------------------


def test_nan_and_inf_counts_and_judgement() -> None:
    layout = _layout()
    expected = _reference(layout)
    actual = expected.copy()
    a, e = unpack(actual, layout), unpack(expected, layout)
    a.dq[0, 1, 2, 3] = np.nan  # NaN where expected is finite: fails
    a.dk[1, 1, 1, 1] = np.inf  # inf where expected is finite: fails
    a.dv[0, 0, 0, 0] = e.dv[0, 0, 0, 0] = np.inf  # equal infinities: match
    a.dg[1, 4, 2] = np.inf
    e.dg[1, 4, 2] = -np.inf  # opposite infinities: fail
    a.dbeta[0, 2, 1] = e.dbeta[0, 2, 1] = np.nan  # NaN both sides: fails unless equal_nan
    result = compare(actual, expected, layout)
    assert result.failed == ("dq", "dk", "dg", "dbeta")
    dq = result["dq"]
    assert (dq.nan_actual, dq.nan_expected, dq.inf_actual, dq.inf_expected) == (1, 0, 0, 0)
    assert dq.worst == (0, 1, 2, 3)
    assert math.isnan(dq.worst_actual or 0.0)
    assert dq.mismatches == dq.nonfinite_mismatches == 1
    # A NaN mismatch makes the error figures NaN, an Inf mismatch makes them Inf.
    assert math.isnan(dq.max_abs_error)
    assert math.isnan(dq.rms_ratio)
    assert re.search(r"^dq\s.*  nan  ", str(result), re.MULTILINE)
    assert result["dk"].max_abs_error == math.inf
    assert dq.error_map[1, 2] == math.inf
    dk = result["dk"]
    assert (dk.inf_actual, dk.inf_expected, dk.worst) == (1, 0, (1, 1, 1, 1))
    dv = result["dv"]
    assert dv.passed
    assert (dv.inf_actual, dv.inf_expected, dv.mismatches) == (1, 1, 0)
    assert dv.error_map[0, 0] == 0.0
    assert result["dg"].nonfinite_mismatches == 1
    dbeta = result["dbeta"]
    assert (dbeta.nan_actual, dbeta.nan_expected, dbeta.mismatches) == (1, 1, 1)
    with_equal_nan = compare(actual, expected, layout, equal_nan=True)
    assert with_equal_nan.failed == ("dq", "dk", "dg")
    assert with_equal_nan["dbeta"].error_map[2, 1] == 0.0


def test_nonfinite_mismatch_fails_rms_mode() -> None:
    layout = _layout()
    expected = _reference(layout)
    actual = expected.copy()
    unpack(actual, layout).dv[0, 3, 1, 2] = np.nan
    grad = compare(actual, expected, layout, max_rms_ratio=10.0)["dv"]
    assert math.isnan(grad.rms_ratio)
    assert grad.mismatches == 1
    assert not grad.passed
    assert grad.worst == (0, 3, 1, 2)


# -- dtypes ---------------------------------------------------------------------------------


def test_float32_against_float64() -> None:
    layout = _layout(True, True)
    expected = _reference(layout)
    actual = expected.astype(np.float32)
    result = compare(actual, expected, layout)
    assert result.passed
    assert result["dq"].actual_dtype == "float32"
    assert result["dq"].expected_dtype == "float64"
    assert 0 < result["dq"].max_rel_error < 2**-24 * 1.01
    unpack(actual, layout).dv[1, 2, 0, 3] += np.float32(1e-3)
    assert compare(actual, expected, layout)["dv"].worst == (1, 2, 0, 3)


def test_bfloat16_against_float64() -> None:
    layout = _layout(False, True)
    expected = _reference(layout)
    actual = expected.astype(ml_dtypes.bfloat16)
    result = compare(actual, expected, layout)
    assert result.passed  # bf16 rounding is within the bf16 default rtol
    assert result["dk"].actual_dtype == "bfloat16"
    assert 0 < result["dk"].max_rel_error <= 2**-8
    assert not compare(actual, expected, layout, rtol=1e-5).passed
    assert compare(actual, expected, layout, max_rms_ratio=5e-3).passed
    assert not compare(actual, expected, layout, rtol=1e-5, max_rms_ratio=5e-3).passed


def test_float16_both_sides() -> None:
    layout = _layout()
    expected = _reference(layout).astype(np.float16)
    actual = expected.copy()
    unpack(actual, layout).dbeta[1, 0, 2] += np.float16(0.5)
    result = compare(actual, expected, layout)
    assert result.failed == ("dbeta",)
    assert result["dbeta"].worst == (1, 0, 2)


def test_empty_layout() -> None:
    layout = GdnBackwardLayout(2, 0, 3, 4, carry_state=True)
    flat = np.zeros(layout.total_elems)
    result = compare(flat, flat, layout)
    assert result.passed
    assert result["dq"].worst is None
    assert result["dq"].error_map.shape == (0, 3)
    assert result["dstate"].error_map.shape == (4, 3)
    json.dumps(result.to_dict(), allow_nan=False)


def test_large_gradient_is_compared_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    chunking = importlib.import_module("gdn_layout.check._scan")

    layout = _layout(True, True)
    expected = _reference(layout)
    actual = expected.copy()
    for where in [(1, 3, 2, 0), (0, 1, 0, 0)]:  # the same error twice: ties go to the first
        unpack(expected, layout).dk[where] = 1.0
        unpack(actual, layout).dk[where] = 1.5
    whole = compare(actual, expected, layout)
    monkeypatch.setattr(chunking, "CHUNK_ELEMENTS", 7)  # smaller than one row
    chunked = compare(actual, expected, layout)
    for a, b in zip(chunked.grads, whole.grads, strict=True):  # sums in another order
        assert a.rms_ratio == pytest.approx(b.rms_ratio, rel=1e-14, abs=0)
        # the ratio to the floors is the RMS figure's where that is the larger
        assert a.error_floor_ratio == pytest.approx(b.error_floor_ratio, rel=1e-14, abs=0)
        same = dataclasses.replace(a, rms_ratio=b.rms_ratio)  # the ratio is derived from it
        assert same == b
    assert chunked["dk"].worst == (0, 1, 0, 0)
    for a, b in zip(chunked.grads, whole.grads, strict=True):
        np.testing.assert_array_equal(a.error_map, b.error_map)


# -- validation -----------------------------------------------------------------------------


def test_validation_errors() -> None:
    layout = _layout()
    good = _reference(layout)
    with pytest.raises(TypeError, match=r"compare: actual must be an array .*, got list"):
        compare(list(good), good, layout)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"compare: layout must be a GdnBackwardLayout, got dict"):
        compare(good, good, {"batch": 1})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=rf"compare: expected must be 1-D with layout.total_elems = {good.size} "
        rf"elements, got shape \({good.size - 1},\)",
    ):
        compare(good, good[:-1], layout)
    with pytest.raises(ValueError, match=r"actual must be 1-D .* got shape \(1, \d+\)"):
        compare(good[None], good, layout)
    with pytest.raises(TypeError, match=r"expected must have a float dtype .* got int64"):
        compare(good, good.astype(np.int64), layout)
    with pytest.raises(TypeError, match=r"actual must have a float dtype .* got complex128"):
        compare(good.astype(np.complex128), good, layout)
    with pytest.raises(TypeError, match=r"compare: rtol must be a float, got str '1e-3'"):
        compare(good, good, layout, rtol="1e-3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"atol must be a float, got bool"):
        compare(good, good, layout, atol=True)
    with pytest.raises(ValueError, match=r"max_rms_ratio\['dg'\] must be a finite float >= 0"):
        compare(good, good, layout, max_rms_ratio={"dg": -1.0})
    with pytest.raises(ValueError, match=r"rtol must be a finite float >= 0, got nan"):
        compare(good, good, layout, rtol=float("nan"))
    with pytest.raises(ValueError, match=r"rtol has unknown gradient names \['dx'\]"):
        compare(good, good, layout, rtol={"dx": 1.0})
    with pytest.raises(TypeError, match=r"equal_nan must be a bool"):
        compare(good, good, layout, equal_nan=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"error_map: actual must be an array"):
        error_map(None, good, layout, "dq")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"no gradient 'dstate'"):
        error_map(good, good, layout, "dstate")
    with pytest.raises(KeyError, match=r"no gradient 'dstate' in this comparison"):
        compare(good, good, layout)["dstate"]


def test_numpy_scalar_tolerances_are_accepted() -> None:
    layout = _layout()
    good = _reference(layout)
    assert compare(good, good, layout, rtol=np.float32(1e-3), atol=np.int64(0)).passed


# -- reports --------------------------------------------------------------------------------


def _failing() -> tuple[Comparison, NDArray[Any], NDArray[Any], GdnBackwardLayout]:
    layout = _layout(True, True)
    expected = _reference(layout)
    actual = expected.copy()
    grads = unpack(actual, layout)
    grads.dk[0, 4, 1, 3] = 0.51
    unpack(expected, layout).dk[0, 4, 1, 3] = 0.5
    assert grads.dstate is not None
    grads.dstate[1, 2, 0, 3] = np.nan
    return compare(actual, expected, layout, rtol=1e-7, atol=1e-7), actual, expected, layout


def test_assert_close_message() -> None:
    _, actual, expected, layout = _failing()
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, layout)
    message = str(info.value)
    lines = message.splitlines()
    assert lines[0] == (
        "gradients differ: dk, dstate (2 of 6 failed) for "
        "B=2 S=5 H=3 N=4, per-channel gate, carried state"
    )
    # The findings lead: one wrong element has no structural cause; the NaN is named.
    assert lines[1] == (
        "  likely cause: dstate has 1 NaN or Inf where the expected values are finite, "
        "first at [1, 2, 0, 3]"
    )
    # float64 is judged against its floors: float32's times 2**-29, as error over rms(expected).
    assert lines[2].startswith("  dk[0, 4, 1, 3]: actual 0.51 expected 0.5; error/floor ")
    assert "> 64 (floors for float64: " in lines[2]
    assert "1 of 120 over the max error" in lines[2]
    assert lines[3].startswith("  dstate[1, 2, 0, 3]: actual nan expected ")
    assert "1 non-finite mismatch;" in lines[3]
    assert "nan 1/0" in lines[3]
    assert len(lines) == 4
    assert "dq" not in message


def test_assert_close_rms_message_and_return() -> None:
    layout = _layout()
    expected = _reference(layout)
    actual = expected * 1.1
    with pytest.raises(AssertionError, match=r"rms ratio 0\.1 > 0\.05"):
        assert_close(actual, expected, layout, max_rms_ratio=0.05)
    result = assert_close(actual, expected, layout, max_rms_ratio=0.2)
    assert isinstance(result, Comparison)
    assert result.passed


def test_to_dict_is_json() -> None:
    result, *_ = _failing()
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["passed"] is False
    assert data["failed"] == ["dk", "dstate"]
    assert data["layout"] == _layout(True, True).to_dict()
    dstate = data["grads"][5]
    assert dstate["name"] == "dstate"
    assert dstate["worst"] == [1, 2, 0, 3]
    assert dstate["worst_actual"] == "nan"
    assert dstate["nan_actual"] == 1
    assert dstate["max_rms_ratio"] is None
    # The JSON's keys are a public format: the figures, the criterion's fields, no maps.
    assert set(dstate) == {
        *("name", "shape", "axes", "actual_dtype", "expected_dtype", "size", "mode"),
        *("rtol", "atol", "max_rms_ratio", "max_abs_error", "max_rel_error", "rms_ratio"),
        *("mismatches", "nonfinite_mismatches", "nan_actual", "inf_actual", "nan_expected"),
        *("inf_expected", "worst", "worst_actual", "worst_expected", "elementwise", "floor"),
        *("precision", "error_floor_ratio", "term_scale", "passed", "findings"),
    }


def test_str_and_html_reports() -> None:
    result, *_ = _failing()
    text = str(result)
    lines = text.splitlines()
    assert (
        lines[0] == "compare FAILED (dk, dstate): B=2 S=5 H=3 N=4, per-channel gate, carried state"
    )
    assert lines[1] == "float64 against float64; rtol=1e-07 atol=1e-07"
    # Title, shared line, header and rule, six rows, then the one finding (the NaN in dstate).
    assert len(lines) == 2 + 2 + 6 + 1
    assert lines[-1].startswith("likely cause: dstate has 1 NaN or Inf")
    assert len({len(line) for line in lines[2:4]}) == 1  # header and rule line up
    assert max(len(line) for line in lines) <= 100
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dstate"):
        assert re.search(rf"^{name}\s", text, re.MULTILINE)
    assert re.search(r"^dk\s.*\[0, 4, 1, 3\].*FAIL$", text, re.MULTILINE)
    assert re.search(r"^dq\s.*ok$", text, re.MULTILINE)
    page = result._repr_html_()
    assert page.startswith("<table")
    assert page.endswith(
        "</table>\n<ul><li>likely cause: dstate has 1 NaN or Inf where the "
        "expected values are finite, first at [1, 2, 0, 3]</li></ul>"
    )
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dstate"):
        assert f">{name}</td>" in page
    assert "<script" not in page
    assert "<link" not in page
    assert "http" not in page


def test_reports_are_frozen() -> None:
    result, *_ = _failing()
    with pytest.raises(AttributeError):
        result.grads = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        result["dk"].passed = True  # type: ignore[misc]


# -- _render ---------------------------------------------------------------------------------


def test_layout_table_and_text() -> None:
    layout = _layout(False, True)
    rows = layout_table(layout, np.float64)
    assert [r.name for r in rows] == list(layout.names)
    assert [(r.offset, r.length) for r in rows] == layout.slices()
    assert all(r.nbytes == 8 * r.length for r in rows)
    assert rows[5].shape == (2, 3, 4, 4)
    text = layout_text(layout, np.float16)
    assert text.splitlines()[0] == "B=2 S=5 H=3 N=4, per-head gate, carried state; float16"
    assert text.splitlines()[-1].split() == [
        "total",
        str(layout.total_elems),
        str(layout.nbytes(np.float16)),
    ]
    page = layout_html(layout)
    assert page.count("<tr>") + page.count("<tr ") == 1 + 6 + 1
    with pytest.raises(TypeError, match="layout must be a GdnBackwardLayout, got str"):
        layout_table("dq")  # type: ignore[arg-type]


def test_grad_stats_finite_only_and_empty() -> None:
    grads = GdnGrads(
        dq=np.array([[1.0, np.nan], [np.inf, -3.0]], dtype=np.float32),
        dk=np.zeros((0, 3)),
        dv=np.array([np.nan, -np.inf]),
        dg=np.array([2.0, 2.0], dtype=ml_dtypes.bfloat16),
        dbeta=np.array([3.0, 4.0]),
    )
    rows = grad_stats(grads)
    assert [r.name for r in rows] == ["dq", "dk", "dv", "dg", "dbeta"]  # dstate None skipped
    dq = rows[0]
    assert (dq.min, dq.max, dq.mean, dq.nan, dq.inf) == (-3.0, 1.0, -1.0, 1, 1)
    assert dq.rms == pytest.approx(math.sqrt(5))
    assert dq.dtype == "float32"
    assert dq.shape == (2, 2)
    assert rows[1].min is None
    assert rows[1].rms is None
    assert rows[1].nan == 0
    assert (rows[2].mean, rows[2].nan, rows[2].inf) == (None, 1, 1)
    assert rows[3].dtype == "bfloat16"
    assert rows[3].mean == 2.0
    assert rows[4].rms == pytest.approx(math.sqrt(12.5))
    text = grads_text(grads)
    assert re.search(r"^dk\s+\(0, 3\)\s+float64\s+-\s+-\s+-\s+-\s+0\s+0$", text, re.MULTILINE)
    page = grads_html(grads)
    assert ">bfloat16</td>" in page
    assert "background:#fdd" in page


def test_grad_stats_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    render = importlib.import_module("gdn_layout._stats")

    values = np.arange(-50, 51, dtype=np.float64)
    whole = grad_stats({"dq": values})[0]
    monkeypatch.setattr(render, "CHUNK_ELEMENTS", 7)
    assert grad_stats({"dq": values})[0] == whole
    assert (whole.min, whole.max, whole.mean) == (-50.0, 50.0, 0.0)


def test_grad_stats_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="grads must be a GdnGrads or a mapping"):
        grad_stats([np.zeros(2)])


def test_html_is_escaped() -> None:
    page = html_table(
        ["<b>name</b>"], [["<script>alert('x')</script> & co"]], caption='"quoted" <caption>'
    )
    assert "<script>" not in page
    assert "<b>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; co" in page
    assert "&quot;quoted&quot; &lt;caption&gt;" in page
    page = grads_html({"<dq>": np.zeros(2)})
    assert "&lt;dq&gt;" in page
    assert "<dq>" not in page


def test_an_exact_gradient_has_no_worst_element_in_the_table() -> None:
    layout = GdnBackwardLayout(1, 2, 1, 2)
    expected = np.arange(1.0, layout.total_elems + 1)
    actual = expected.copy()
    unpack(actual, layout).dv[0, 1, 0, 1] += 1.0
    report = compare(actual, expected, layout)
    assert report["dq"].exact
    assert not report["dv"].exact
    rows = {line.split()[0]: line for line in str(report).splitlines()[3:]}
    assert "[" not in rows["dq"].split(")", 1)[1]
    assert "[0, 1, 0, 1]" in rows["dv"]


def test_a_buffer_of_another_layouts_size_names_that_layout() -> None:
    layout = _layout(True, True)
    without = GdnBackwardLayout(
        layout.batch, layout.seq, layout.heads, layout.state_size, gate_per_channel=True
    )
    short = np.zeros(without.total_elems)
    with pytest.raises(ValueError, match=r"the layout without dstate \(carry_state=False\)"):
        compare(short, np.zeros(layout.total_elems), layout)


def test_findings_are_in_the_json() -> None:
    layout = _layout(True, True)
    expected = _reference(layout)
    actual = expected.copy()
    unpack(actual, layout).dq[...] *= 4.0
    result = compare(actual, expected, layout)
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert [f["kind"] for f in data["findings"]] == ["scale"]
    assert data["grads"][0]["findings"] == data["findings"]
    assert data["findings"][0]["gradient"] == "dq"
    assert result["dq"].findings[0].details["factor"] == pytest.approx(4.0)


def test_findings_lead_a_cases_failure() -> None:
    from gdn_layout.suites import make_case

    case = make_case(_layout(True, True), seed=1)
    actual = np.array(case.fixture.packed, np.float32)
    grads = unpack(actual, case.layout)
    assert grads.dstate is not None
    grads.dstate[...] = grads.dstate.swapaxes(-1, -2).copy()
    with pytest.raises(AssertionError) as info:
        case.check(actual)
    lines = str(info.value).splitlines()
    assert lines[0].endswith("gradient(s) dstate differ")
    assert lines[1].startswith("  likely cause: dstate holds its transpose")


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


def test_the_report_names_the_device_the_actual_buffer_was_read_from() -> None:
    layout = _layout()
    expected = _reference(layout)
    actual = expected.copy()
    actual[layout.segment("dk").offset] += 1.0
    on_device: Any = DeviceArray(actual)  # CUDA device 0, as DLPack numbers it
    result = compare(on_device, expected, layout, rtol=1e-6)
    assert len(on_device.copies) == 1
    assert result.failed == ("dk",)
    title = str(result).splitlines()[0]
    assert title == f"compare FAILED (dk): {layout_caption(layout)} (read from cuda:0)"
    assert "(read from cuda:0)" in result._repr_html_()
    with pytest.raises(AssertionError, match=r"^gradients differ: dk .* \(read from cuda:0\)\n"):
        assert_close(on_device, expected, layout, rtol=1e-6)
    # From host memory, nothing is said.
    assert "read from" not in str(compare(actual, expected, layout, rtol=1e-6))
    assert compare(actual, expected, layout, rtol=1e-6).device is None


def test_a_failing_compare_runs_one_way_through_the_check() -> None:
    """The check's stages hand records forward: no module is entered again while a call of it
    is still on the stack below (a callback), and the kernel's buffer is unpacked once. The
    reference's thread pool runs the work it is given: a map, not a stage calling back."""
    import sys

    layout = GdnBackwardLayout(2, 70, 3, 16, carry_state=True)
    fx = make_fixture(layout, regime="mild")
    actual = backward(*fx.inputs, dtype=np.float32)
    unpack(actual, layout).dk[:, 30:] *= 1.01  # wrong from step 30 on: every stage runs
    stack: list[str | None] = []
    callbacks: set[tuple[str, str]] = set()
    unpacked = 0

    def profile(frame: Any, event: str, _: object) -> None:
        nonlocal unpacked
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if not module.startswith("gdn_layout."):
                stack.append(None)
                return
            live = [m for m in stack if m is not None]
            if live and live[-1] != module and module in live:
                callbacks.add((live[-1], module))
            if (module, frame.f_code.co_name) == ("gdn_layout.packing", "unpack"):
                unpacked += next(iter(frame.f_locals.values())) is actual
            stack.append(module)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        result = compare(actual, fx)
    finally:
        sys.setprofile(None)
    assert result.failed == ("dk",)
    assert any(f.kind == "boundary" for f in result["dk"].findings)
    assert callbacks <= {("gdn_layout.reference._threads", "gdn_layout.reference._inputs")}
    assert unpacked == 1

"""compare, assert_close and error_map: located errors, criteria, NaN/Inf, dtypes, the errors
compare documents, reports, and the maps of the one pass over a gradient (binned when large,
a failing gradient's cause maps against a brute-force oracle cell by cell)."""

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
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, GdnGrads, unpack
from gdn_layout._stats import grad_stats, grads_html, grads_text
from gdn_layout._tables import html_table
from gdn_layout.check import Comparison, GradComparison, assert_close, compare, error_map
from gdn_layout.generate import make_fixture
from gdn_layout.layout import layout_caption, layout_html, layout_table, layout_text
from gdn_layout.reference import backward
from support import DeviceArray

FLAGS = [(False, False), (True, False), (False, True), (True, True)]
_COMPARE = importlib.import_module("gdn_layout.check._compare")
_NORMS = importlib.import_module("gdn_layout._norms")


def _layout(per_channel: bool = False, carry: bool = False) -> GdnBackwardLayout:
    return GdnBackwardLayout(2, 5, 3, 4, gate_per_channel=per_channel, carry_state=carry)


def _reference(layout: GdnBackwardLayout, seed: int = 0) -> NDArray[np.float64]:
    # Values bounded away from zero so that relative errors are finite and well defined.
    rng = np.random.default_rng(seed)
    values: NDArray[np.float64] = rng.choice([-1.0, 1.0], layout.total_elems)
    return values * rng.uniform(0.5, 2.0, layout.total_elems)


@pytest.mark.parametrize(("per_channel", "carry"), FLAGS)
def test_a_correct_kernel_in_another_order_passes(per_channel: bool, carry: bool) -> None:
    # The chunked float32 form against the float64 truth and the step-by-step form's floors.
    fx = make_fixture(_layout(per_channel, carry), dtype=np.float64, regime="mixed", seed=3)
    actual = backward(*fx.inputs, dtype=np.float32)
    result = compare(actual, fx.packed, fx.layout, floors=fx.floors, scales=fx.scales)
    assert result.passed, str(result)
    assert (result.failed, result.names) == ((), fx.layout.names)
    assert any(grad.max_abs_error > 0 for grad in result.grads)
    for grad in result.grads:
        assert grad.mismatches == 0
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
        # An interior, asymmetric element, so transposed axes would be caught.
        where = tuple(d - 1 - (i % 2) if d > 1 else 0 for i, d in enumerate(view.shape))
        before = float(view[where])
        view[where] += 0.25
        result = compare(actual, expected, layout)
        grad = result[name]
        assert result.failed == (name,)
        assert (grad.worst, grad.mismatches, grad.worst_expected) == (where, 1, before)
        assert grad.worst_actual == pytest.approx(before + 0.25)
        assert grad.max_abs_error == pytest.approx(0.25)
        assert grad.max_rel_error == pytest.approx(0.25 / abs(before))
        assert grad.axes == {"dbeta": ("b", "s", "h"), "dstate": ("b", "h", "i", "j")}.get(
            name, ("b", "s", "h") if name == "dg" and not per_channel else ("b", "s", "h", "n")
        )
        emap = grad.error_map
        # The map by hand: the one error at its (s, h), or (i, h) for dstate; zero elsewhere.
        by_hand = np.zeros((layout.state_size if name == "dstate" else layout.seq, layout.heads))
        by_hand[(where[2], where[1]) if name == "dstate" else (where[1], where[2])] = 0.25
        np.testing.assert_allclose(emap, by_hand, rtol=1e-12, atol=0)
        np.testing.assert_array_equal(error_map(actual, expected, layout, name), emap)
        assert not emap.flags.writeable


def test_the_worst_element_is_the_one_furthest_out_of_tolerance() -> None:
    layout = _layout()
    expected = np.full(layout.total_elems, 1.0)
    unpack(expected, layout).dk[0, 1, 1, 1] = 1000.0
    actual = expected.copy()
    dk = unpack(actual, layout).dk
    dk[0, 1, 1, 1] += 0.5  # the largest |a - e|, within rtol on its large value
    dk[1, 3, 0, 2] += 0.01
    dk[1, 2, 1, 1] += 1e-9  # within tolerance: counted nowhere
    grad = compare(actual, expected, layout, rtol=1e-3, atol=0.0)["dk"]
    assert (grad.mismatches, grad.worst, grad.max_abs_error) == (1, (1, 3, 0, 2), 0.5)
    assert compare(actual, expected, layout, max_rms_ratio=1.0)["dk"].worst == (0, 1, 1, 1)


def test_rms_ratio_passes_uniform_bf16_noise_that_fails_elementwise() -> None:
    layout = GdnBackwardLayout(2, 16, 4, 16, gate_per_channel=True, carry_state=True)
    rng = np.random.default_rng(1)
    expected = rng.standard_normal(layout.total_elems)
    actual = expected * (1 + 4e-3 * rng.standard_normal(expected.size))  # bf16-like noise
    assert set(compare(actual, expected, layout, rtol=1e-4, atol=1e-6).failed) == set(layout.names)
    by_rms = compare(actual, expected, layout, max_rms_ratio=1e-2)
    assert by_rms.passed
    for grad in by_rms.grads:
        assert grad.criterion.mode == "rms"
        assert 2e-3 < grad.rms_ratio < 6e-3
        assert grad.mismatches == 0  # out/size counts what the RMS criterion counts
    assert not compare(actual, expected, layout, max_rms_ratio=1e-3).passed
    both = compare(actual, expected, layout, rtol=1e-4, atol=1e-6, max_rms_ratio=1e-2)
    assert all(g.criterion.mode == "both" and g.mismatches > 0 for g in both.grads)
    assert both["dq"].criterion.words == "rtol=0.0001 atol=1e-06 rms ratio<=0.01"
    small = GdnBackwardLayout(1, 1, 1, 2)  # the definition: diff (0.3, -0.4) against (3, 4)
    e = np.array([3.0, 4.0] * 3 + [1.0, 1.0])
    a = e.copy()
    a[0:2] = [3.3, 3.6]
    assert compare(a, e, small, max_rms_ratio=0.2)["dq"].rms_ratio == pytest.approx(0.1)
    assert not compare(a, e, small, max_rms_ratio=0.09)["dq"].passed


@pytest.mark.parametrize("magnitude", [1.5e154, 1e300, 1e-160, 1e-300])
def test_rms_ratio_neither_overflows_nor_underflows(magnitude: float) -> None:
    # Squares of these float64 values leave float64's range; the ratio must not.
    layout = GdnBackwardLayout(1, 3, 2, 2)
    expected = np.full(layout.total_elems, magnitude)
    grad = compare(expected * 1.2, expected, layout, max_rms_ratio=1e-3)["dq"]
    assert grad.rms_ratio == pytest.approx(0.2)
    assert not grad.passed


def test_rms_ratio_across_chunks_of_different_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_NORMS, "CHUNK_ELEMENTS", 4)  # one row of dq per chunk
    layout = GdnBackwardLayout(1, 3, 1, 4)
    expected = np.ones(layout.total_elems)
    expected[:12] = np.repeat([1e-200, 1.0, 1e200], 4)
    actual = expected.copy()
    actual[:12] += np.repeat([1e-201, 0.0, 3e199], 4)
    # sqrt((4e-402 + 4 * 9e398) / (4e-400 + 4 + 4e400)), where only the 1e200 row counts.
    assert compare(actual, expected, layout)["dq"].rms_ratio == pytest.approx(0.3)


@pytest.mark.parametrize("count", [1, 48, 24])
def test_rms_ratio_is_exact_up_to_the_largest_finite_values(count: int) -> None:
    layout = GdnBackwardLayout(1, 2, 2, 3)
    expected = np.zeros(layout.total_elems)
    actual = expected.copy()
    unpack(expected, layout).dq.reshape(-1)[:count] = 1.7e308
    unpack(actual, layout).dq.reshape(-1)[:count] = 1e308
    grad = compare(actual, expected, layout, max_rms_ratio=0.01)["dq"]
    assert grad.rms_ratio == pytest.approx(0.7 / 1.7, rel=1e-12)
    assert grad.max_rel_error == pytest.approx(0.7 / 1.7, rel=1e-12)
    assert not grad.passed


def test_zero_reference_rms_ratio() -> None:
    layout = GdnBackwardLayout(1, 2, 1, 2)
    zeros = np.zeros(layout.total_elems)
    assert compare(zeros, zeros, layout, max_rms_ratio=0.0).passed
    actual = zeros.copy()
    actual[0] = 1e-12
    grad = compare(actual, zeros, layout, max_rms_ratio=0.5)["dq"]
    assert (grad.rms_ratio, grad.max_rel_error, grad.passed) == (math.inf, math.inf, False)


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
    assert result["dq"].criterion.mode == "calibrated"  # for the names a mapping leaves out
    assert compare(actual, expected, layout, rtol={"dg": 2e-3}).failed == ("dstate",)
    assert compare(actual, expected, layout, atol={"dg": 1.0, "dstate": 1.0}).passed
    # dstate may be named for a layout without it, so one mapping fits every flag combination.
    stateless = _reference(_layout())
    assert compare(stateless, stateless, _layout(), atol={"dstate": 1.0}).passed
    assert compare(stateless, stateless, _layout(), rtol=np.float32(1e-3), atol=np.int64(0)).passed


def test_default_tolerances_follow_the_less_precise_dtype() -> None:
    layout = _layout()
    e = _reference(layout)
    f32, f16, bf16 = e.astype(np.float32), e.astype(np.float16), e.astype(ml_dtypes.bfloat16)

    def criterion(a: NDArray[Any], b: NDArray[Any], **judging: Any) -> Any:
        return compare(a, b, layout, **judging)["dq"].criterion

    # Given one of rtol and atol, the other defaults by the less precise dtype.
    assert criterion(f32, e, atol=1e-5).rtol == 1.3e-6
    assert criterion(e, f16, atol=0).rtol == 1e-3
    assert criterion(bf16, f16, atol=0).rtol == 1.6e-2
    assert criterion(e, e, rtol=0).atol == 1e-7
    # Given neither, every dtype is judged against its floors (longdouble as float64).
    assert criterion(e.astype(np.longdouble), e).words == "error/floor<=64 (float64)"
    assert [criterion(a, e).precision_name for a in (e, f32)] == ["float64", "float32"]
    assert criterion(bf16, f16).precision_name == "bfloat16"


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
    assert dq.error_map[1, 2] == math.inf
    dk = result["dk"]
    assert (dk.inf_actual, dk.inf_expected, dk.worst, dk.max_abs_error) == (
        1, 0, (1, 1, 1, 1), math.inf,
    )  # fmt: skip
    dv = result["dv"]
    assert (dv.passed, dv.inf_actual, dv.inf_expected, dv.mismatches) == (True, 1, 1, 0)
    assert dv.error_map[0, 0] == 0.0
    assert result["dg"].nonfinite_mismatches == 1
    dbeta = result["dbeta"]
    assert (dbeta.nan_actual, dbeta.nan_expected, dbeta.mismatches) == (1, 1, 1)
    with_equal_nan = compare(actual, expected, layout, equal_nan=True)
    assert with_equal_nan.failed == ("dq", "dk", "dg")
    assert with_equal_nan["dbeta"].error_map[2, 1] == 0.0
    # A non-finite mismatch fails a gradient judged by the RMS ratio too.
    by_rms = compare(actual, expected, layout, max_rms_ratio=10.0)["dq"]
    assert math.isnan(by_rms.rms_ratio)
    assert (by_rms.mismatches, by_rms.passed, by_rms.worst) == (1, False, (0, 1, 2, 3))


def test_narrow_dtypes_against_float64_and_each_other() -> None:
    layout = _layout(True, True)
    expected = _reference(layout)
    f32 = expected.astype(np.float32)
    result = compare(f32, expected, layout)
    assert result.passed
    assert (result["dq"].actual_dtype, result["dq"].expected_dtype) == ("float32", "float64")
    assert 0 < result["dq"].max_rel_error < 2**-24 * 1.01
    unpack(f32, layout).dv[1, 2, 0, 3] += np.float32(1e-3)
    assert compare(f32, expected, layout)["dv"].worst == (1, 2, 0, 3)
    bf16 = expected.astype(ml_dtypes.bfloat16)
    assert compare(bf16, expected, layout).passed  # bf16 rounding, judged as bfloat16
    assert 0 < compare(bf16, expected, layout)["dk"].max_rel_error <= 2**-8
    assert not compare(bf16, expected, layout, rtol=1e-5).passed
    assert compare(bf16, expected, layout, max_rms_ratio=5e-3).passed
    assert not compare(bf16, expected, layout, rtol=1e-5, max_rms_ratio=5e-3).passed
    f16 = expected.astype(np.float16)
    wrong = f16.copy()
    unpack(wrong, layout).dbeta[1, 0, 2] += np.float16(0.5)
    assert compare(wrong, f16, layout)["dbeta"].worst == (1, 0, 2)
    assert compare(wrong, f16, layout).failed == ("dbeta",)


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
    layout = _layout(True, True)
    expected = _reference(layout)
    actual = expected.copy()
    for where in [(1, 3, 2, 0), (0, 1, 0, 0)]:  # the same error twice: ties go to the first
        unpack(expected, layout).dk[where] = 1.0
        unpack(actual, layout).dk[where] = 1.5
    whole = compare(actual, expected, layout)
    monkeypatch.setattr(_NORMS, "CHUNK_ELEMENTS", 7)  # smaller than one row
    chunked = compare(actual, expected, layout)
    for a, b in zip(chunked.grads, whole.grads, strict=True):  # sums in another order
        assert a.rms_ratio == pytest.approx(b.rms_ratio, rel=1e-14, abs=0)
        assert a.error_floor_ratio == pytest.approx(b.error_floor_ratio, rel=1e-14, abs=0)
        # The criterion's rms(expected) is summed in chunks too.
        assert dataclasses.replace(a, rms_ratio=b.rms_ratio, criterion=b.criterion) == b
        np.testing.assert_array_equal(a.error_map, b.error_map)
    assert chunked["dk"].worst == (0, 1, 0, 0)


# -- the errors compare documents ------------------------------------------------------------


_GOOD = np.ones(_layout().total_elems)
_SAME = {"actual": _GOOD, "expected": _GOOD, "layout": _layout()}
#: (what the call changes, the error and its message): the errors compare documents.
REFUSED = [
    ({"actual": list(_GOOD)}, TypeError, r"compare: actual must be an array .*, got list"),
    ({"layout": {}}, TypeError, r"compare: layout must be a GdnBackwardLayout, got dict"),
    ({"layout": None}, TypeError, r"compare: layout is required when expected is an array"),
    (
        {"expected": _GOOD[:-1]},
        ValueError,
        rf"compare: expected must be 1-D with layout.total_elems = {_GOOD.size} elements, "
        rf"got shape \({_GOOD.size - 1},\)",
    ),
    ({"actual": _GOOD[None]}, ValueError, r"actual must be 1-D .* got shape \(1, \d+\)"),
    ({"expected": _GOOD.astype(int)}, TypeError, r"expected must have a float dtype .* got int64"),
    (
        {"actual": _GOOD.astype(complex)},
        TypeError,
        r"actual must have a float dtype .* got complex",
    ),
    ({"rtol": "1e-3"}, TypeError, r"compare: rtol must be a float, got str '1e-3'"),
    ({"atol": True}, TypeError, r"atol must be a float, got bool"),
    (
        {"max_rms_ratio": {"dg": -1}},
        ValueError,
        r"max_rms_ratio\['dg'\] must be a finite float >= 0",
    ),
    ({"rtol": math.nan}, ValueError, r"rtol must be a finite float >= 0, got nan"),
    ({"rtol": {"dx": 1.0}}, ValueError, r"rtol has unknown gradient names \['dx'\]"),
    ({"equal_nan": 1}, TypeError, r"equal_nan must be a bool"),
    ({"rtl": 1.0}, TypeError, r"compare\(\) got an unexpected keyword argument 'rtl'"),
    (
        {"actual": _GOOD.astype(np.float32), "precision": "float64"},
        ValueError,
        r"compare: precision 'float64' judges float64 buffers, got float32 ones",
    ),
]


@pytest.mark.parametrize(("change", "kind", "message"), REFUSED)
def test_validation_errors(change: dict[str, Any], kind: type[Exception], message: str) -> None:
    with pytest.raises(kind, match=message):
        compare(**{**_SAME, **change})


def test_fixture_and_name_errors() -> None:
    layout = _layout()
    good = _reference(layout)
    fixture = make_fixture(layout, regime="mild")
    with pytest.raises(ValueError, match=r"compare: layout .* is not the fixture's"):
        compare(good, fixture, _layout(True))
    with pytest.raises(TypeError, match=r"compare: floors and scales come with the fixture"):
        compare(good, fixture, scales=1)
    with pytest.raises(TypeError, match=r"error_map: actual must be an array"):
        error_map(None, good, layout, "dq")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"no gradient 'dstate'"):
        error_map(good, good, layout, "dstate")
    with pytest.raises(KeyError, match=r"no gradient 'dstate' in this comparison"):
        compare(good, good, layout)["dstate"]
    full, without = _layout(True, True), GdnBackwardLayout(2, 5, 3, 4, gate_per_channel=True)
    with pytest.raises(ValueError, match=r"the layout without dstate \(carry_state=False\)"):
        compare(np.zeros(without.total_elems), np.zeros(full.total_elems), full)


def test_a_masked_array_is_refused() -> None:
    layout = GdnBackwardLayout(1, 2, 2, 3)
    expected = np.zeros(layout.total_elems)
    for hidden in (np.nan, 1e6):
        actual = np.ma.masked_array(expected.copy(), mask=np.zeros(layout.total_elems, bool))
        actual[3] = np.ma.masked
        actual.data[3] = hidden
        with pytest.raises(TypeError, match="compare: actual is a masked array"):
            compare(actual, expected, layout)
        with pytest.raises(TypeError, match="compare: expected is a masked array"):
            compare(expected, actual, layout)
        with pytest.raises(TypeError, match="error_map: actual is a masked array"):
            error_map(actual, expected, layout, "dq")


class _Doubled(np.ndarray):
    """Shows every value doubled: its values are not its data."""

    def __getitem__(self, key: Any) -> Any:
        return np.asarray(super().__getitem__(key)) * 2


class _Tagged(np.ndarray):
    """A subclass that changes nothing about its values."""


def test_a_subclass_is_compared_only_if_its_values_are_its_data(tmp_path: Any) -> None:
    layout = GdnBackwardLayout(1, 2, 2, 3)
    expected = np.ones(layout.total_elems)
    doubled = expected.copy().view(_Doubled)
    with pytest.raises(TypeError, match="actual is a _Doubled, an ndarray subclass that overri"):
        compare(doubled, expected, layout)
    assert compare(np.asarray(doubled), expected, layout).passed
    assert compare(expected.copy().view(_Tagged), expected, layout).passed
    mapped = np.memmap(tmp_path / "m.bin", np.float64, "w+", shape=expected.shape)
    mapped[:] = expected
    assert compare(mapped, expected, layout).passed


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
    lines = str(info.value).splitlines()
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
    layout = _layout()
    expected = _reference(layout)
    with pytest.raises(AssertionError, match=r"rms ratio 0\.1 > 0\.05"):
        assert_close(expected * 1.1, expected, layout, max_rms_ratio=0.05)
    result = assert_close(expected * 1.1, expected, layout, max_rms_ratio=0.2)
    assert isinstance(result, Comparison)
    assert result.passed


def test_to_dict_is_json() -> None:
    result, *_ = _failing()
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert (data["passed"], data["failed"]) == (False, ["dk", "dstate"])
    assert data["layout"] == _layout(True, True).to_dict()
    dstate = data["grads"][5]
    assert (dstate["name"], dstate["worst"], dstate["worst_actual"]) == (
        "dstate",
        [1, 2, 0, 3],
        "nan",
    )
    assert (dstate["nan_actual"], dstate["max_rms_ratio"], dstate["max_abs_error"]) == (
        1,
        None,
        "nan",
    )
    # The JSON's keys are a public format: the figures, the criterion's fields, no maps.
    assert set(dstate) == {
        *("name", "shape", "axes", "actual_dtype", "expected_dtype", "size", "mode"),
        *("rtol", "atol", "max_rms_ratio", "max_abs_error", "max_rel_error", "rms_ratio"),
        *("mismatches", "nonfinite_mismatches", "nan_actual", "inf_actual", "nan_expected"),
        *("inf_expected", "worst", "worst_actual", "worst_expected", "elementwise", "floor"),
        *("precision", "error_floor_ratio", "term_scale", "passed", "findings"),
    }
    layout = _layout(True, True)
    expected = _reference(layout)
    actual = expected.copy()
    unpack(actual, layout).dq[...] *= 4.0
    scaled = compare(actual, expected, layout)
    data = json.loads(json.dumps(scaled.to_dict(), allow_nan=False))
    assert [f["kind"] for f in data["findings"]] == ["scale"]
    assert data["grads"][0]["findings"] == data["findings"]
    assert scaled["dq"].findings[0].details["factor"] == pytest.approx(4.0)


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
    assert re.search(r"^dk\s.*\[0, 4, 1, 3\].*FAIL$", text, re.MULTILINE)
    assert re.search(r"^dq\s.*ok$", text, re.MULTILINE)
    page = result._repr_html_()
    assert page.startswith("<table")
    assert page.endswith(
        "</table>\n<ul><li>likely cause: dstate has 1 NaN or Inf where the "
        "expected values are finite, first at [1, 2, 0, 3]</li></ul>"
    )
    assert all(f">{name}</td>" in page for name in result.names)
    assert not any(word in page for word in ("<script", "<link", "http"))
    with pytest.raises(AttributeError):
        result["dk"].passed = True  # type: ignore[misc]
    # An exact gradient has no worst element in the table.
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
    from_host = compare(actual, expected, layout, rtol=1e-6)  # from host memory, nothing said
    assert "read from" not in str(from_host)
    assert from_host.device is None


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


# -- other modules' views, shown beside a comparison -------------------------------------------


def test_layout_table_and_text() -> None:
    layout = _layout(False, True)
    rows = layout_table(layout, np.float64)
    assert [r.name for r in rows] == list(layout.names)
    assert [(r.offset, r.length) for r in rows] == layout.slices()
    assert all(r.nbytes == 8 * r.length for r in rows)
    assert rows[5].shape == (2, 3, 4, 4)
    text = layout_text(layout, np.float16).splitlines()
    assert text[0] == "B=2 S=5 H=3 N=4, per-head gate, carried state; float16"
    assert text[-1].split() == ["total", str(layout.total_elems), str(layout.nbytes(np.float16))]
    page = layout_html(layout)
    assert page.count("<tr>") + page.count("<tr ") == 1 + 6 + 1
    with pytest.raises(TypeError, match="layout must be a GdnBackwardLayout, got str"):
        layout_table("dq")  # type: ignore[arg-type]


def test_grad_stats_finite_only_empty_and_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
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
    assert (dq.min, dq.max, dq.mean, dq.nan, dq.inf, dq.dtype, dq.shape) == (
        -3.0, 1.0, -1.0, 1, 1, "float32", (2, 2),
    )  # fmt: skip
    assert dq.rms == pytest.approx(math.sqrt(5))
    assert (rows[1].min, rows[1].rms, rows[1].nan) == (None, None, 0)
    assert (rows[2].mean, rows[2].nan, rows[2].inf) == (None, 1, 1)
    assert (rows[3].dtype, rows[3].mean) == ("bfloat16", 2.0)
    assert rows[4].rms == pytest.approx(math.sqrt(12.5))
    text = grads_text(grads)
    assert re.search(r"^dk\s+\(0, 3\)\s+float64\s+-\s+-\s+-\s+-\s+0\s+0$", text, re.MULTILINE)
    assert ">bfloat16</td>" in grads_html(grads)
    assert "background:#fdd" in grads_html(grads)
    with pytest.raises(TypeError, match="grads must be a GdnGrads or a mapping"):
        grad_stats([np.zeros(2)])
    values = np.arange(-50, 51, dtype=np.float64)
    whole = grad_stats({"dq": values})[0]
    monkeypatch.setattr(importlib.import_module("gdn_layout._stats"), "CHUNK_ELEMENTS", 7)
    assert grad_stats({"dq": values})[0] == whole
    assert (whole.min, whole.max, whole.mean) == (-50.0, 50.0, 0.0)


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


# -- the maps: binned when large, a failing gradient's cause maps ------------------------------


def _assert_consistent(result: Comparison) -> None:
    for grad in result.grads:
        assert grad.batch_error_map.size <= _COMPARE.MAP_CELLS
        assert grad.mismatch_map.shape == grad.batch_error_map.shape
        assert grad.batch_error_map.shape[1:] == grad.error_map.shape
        assert not grad.batch_error_map.flags.writeable
        assert not grad.mismatch_map.flags.writeable
        np.testing.assert_array_equal(grad.batch_error_map.max(axis=0, initial=0.0), grad.error_map)
        assert int(grad.mismatch_map.sum()) == grad.mismatches


def test_binned_maps_keep_each_blocks_largest_error_and_count_and_are_drawn_on_their_cells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 2 * 8 * 3 = 48 cells, twice the limit: positions binned in pairs along s.
    monkeypatch.setattr(_COMPARE, "MAP_CELLS", 24)
    layout = GdnBackwardLayout(2, 8, 3, 2)
    actual = np.zeros(layout.total_elems)
    dk = unpack(actual, layout).dk
    dk[0, 1, 0, 0] = dk[0, 2, 0, 1] = dk[1, 4, 2, 0] = 1.0
    dk[0, 5, 1, 0] = 1e-4  # within atol
    result = compare(actual, np.zeros_like(actual), layout, rtol=0.0, atol=1e-3)
    grad = result["dk"]
    assert (grad.error_map_bins, grad.batch_error_map.shape) == ((2, 1), (2, 4, 3))
    assert grad.mismatch_map[0].tolist() == [[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert (grad.mismatch_map[1, 2, 2], grad.batch_error_map[0, 2, 1]) == (1, 1e-4)
    _assert_consistent(result)
    pytest.importorskip("matplotlib")
    from matplotlib.collections import LineCollection

    def panel(**kwargs: Any) -> Any:
        (ax,) = [ax for ax in result.plot(names=["dk"], **kwargs).axes if ax.images]
        return ax

    def outlined(ax: Any) -> set[tuple[float, ...]]:
        lines = [c for c in ax.collections if isinstance(c, LineCollection)]
        (outline,) = [c for c in lines if c.get_label() == "out of tolerance"]
        return {tuple(np.asarray(s).ravel().tolist()) for s in outline.get_segments()}

    ax = panel()
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("sequence position s / 2 (binned)", "head h")
    assert ax.images[0].get_array().shape == (3, 4)
    assert {x for seg in outlined(ax) for x in seg[::2]} == {-0.5, 0.5, 1.5, 2.5}
    assert outlined(panel(batch=1)) == {
        (1.5, 1.5, 2.5, 1.5), (1.5, 2.5, 2.5, 2.5), (1.5, 1.5, 1.5, 2.5), (2.5, 1.5, 2.5, 2.5),
    }  # fmt: skip
    # A boundary every 4 positions is every 2 cells; one every position is finer than a cell.
    (lines,) = [c for c in panel(chunk=4).collections if c.get_label() != "out of tolerance"]
    assert sorted({float(s[0][0]) for s in lines.get_segments()}) == [1.5]
    assert [c.get_label() for c in panel(chunk=1).collections] == ["out of tolerance"]
    # The batch binned: the panel names the batch elements a map covers.
    monkeypatch.setattr(_COMPARE, "MAP_CELLS", 8)
    layout = GdnBackwardLayout(20, 2, 1, 1)
    actual = np.zeros(layout.total_elems)
    unpack(actual, layout).dq[10, 1, 0, 0] = 1.0
    result = compare(actual, np.zeros_like(actual), layout)
    dq = result["dq"]
    assert (dq.batch_bins, dq.error_map_bins, dq.batch_error_map.shape) == (3, (2, 1), (7, 1, 1))
    assert dq.batch_error_map[3, 0, 0] == 1.0
    _assert_consistent(result)
    (ax,) = [ax for ax in result.plot(names=["dq"], batch=10).axes if ax.images]
    assert "b=9..11 (binned)" in ax.get_title()
    assert np.asarray(ax.images[0].get_array()).tolist() == [[1.0]]
    last = next(ax for ax in result.plot(names=["dq"], batch=19).axes if ax.images)
    assert "b=18..19 (binned)" in last.get_title()


def _assert_maps(grad: GradComparison, a: NDArray[Any], e: NDArray[Any], fold: int) -> None:
    """Each cell's signed error of largest magnitude (NaN for a non-finite mismatch) and
    sum(a e) / sum(e e) over its finite pairs, by brute force over the cell's elements."""
    assert grad.signed_error_map is not None
    assert grad.ratio_map is not None
    assert not grad.signed_error_map.flags.writeable
    assert not grad.ratio_map.flags.writeable
    index = np.indices(a.shape)
    if grad.name == "dstate":  # [H, N, N] over the batch, i and j folded
        cells = (index[1], index[2] // fold, index[3] // fold)
    else:
        bins = (grad.batch_bins, *grad.error_map_bins)
        cells = tuple(index[k] // bins[k] for k in range(3))
    assert grad.signed_error_map.shape == tuple(int(c.max()) + 1 for c in cells)
    with np.errstate(all="ignore"):
        d, ae, ee = np.where(a == e, 0.0, a - e), a * e, e * e
    both = np.isfinite(a) & np.isfinite(e)
    for cell in np.ndindex(grad.signed_error_map.shape):
        inside = np.logical_and.reduce([c == i for c, i in zip(cells, cell, strict=True)])
        di, norm = d[inside], float(np.sum(ee[inside & both]))
        worst = di[np.argmax(np.where(np.isfinite(di), np.abs(di), np.inf))]
        want = worst if np.isfinite(worst) else np.nan
        np.testing.assert_equal(grad.signed_error_map[cell], want)
        ratio = float(np.sum(ae[inside & both])) / norm if norm > 0 else math.nan
        np.testing.assert_allclose(grad.ratio_map[cell], ratio, rtol=1e-12, equal_nan=True)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    dims=st.tuples(*(st.integers(1, 4) for _ in range(4))),
    state=st.booleans(),
    map_cells=st.sampled_from([1 << 20, 12, 8]),
    chunk=st.sampled_from([1 << 20, 3]),  # 3: a line of N elements folded in pieces
    seed=st.integers(0, 2**16),
    nonfinite=st.booleans(),
)
def test_cause_maps_equal_the_oracle_cell_by_cell(
    dims: tuple[int, int, int, int],
    state: bool,
    map_cells: int,
    chunk: int,
    seed: int,
    nonfinite: bool,
) -> None:
    # Tiny map budgets bin the sequence, the heads, the batch and dstate's i and j.
    layout = GdnBackwardLayout(*dims, carry_state=state)
    rng = np.random.default_rng(seed)
    expected = rng.standard_normal(layout.total_elems)
    expected[rng.random(expected.size) < 0.2] = 0.0  # cells whose expected values are all zero
    actual = expected * rng.choice([1.0, -2.0, 3.0], expected.size)
    actual += 1e-3 * rng.standard_normal(actual.size)
    if nonfinite:
        actual[rng.integers(actual.size)] = np.nan
        actual[rng.integers(actual.size)] = np.inf
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_COMPARE, "MAP_CELLS", map_cells)
        patch.setattr(_NORMS, "CHUNK_ELEMENTS", chunk)
        result = compare(actual, expected, layout, rtol=1e-9, atol=0.0)
    for seg, grad in zip(layout.segments(), result.grads, strict=True):
        a = actual[seg.offset : seg.offset + seg.length].reshape(seg.shape)
        e = expected[seg.offset : seg.offset + seg.length].reshape(seg.shape)
        if grad.passed:
            assert (grad.signed_error_map, grad.ratio_map) == (None, None)
        else:
            heads, n = seg.shape[1:3]
            _assert_maps(grad, a, e, max(1, math.ceil(math.sqrt(heads * n * n / map_cells))))


@pytest.fixture(scope="module")
def fixture_and_bugs() -> tuple[Any, Any, NDArray[np.float32]]:
    layout = GdnBackwardLayout(batch=2, seq=40, heads=4, state_size=6, carry_state=True)
    fixture = make_fixture(layout, dtype=np.float32, seed=0)
    actual = fixture.packed.copy()
    grads = unpack(actual, layout)
    grads.dq[...] *= -1.0  # a sign flip
    assert grads.dstate is not None
    grads.dstate[...] = np.swapaxes(grads.dstate, -1, -2).copy()
    grads.dv[:, :, [0, 3]] = grads.dv[:, :, [3, 0]]
    return layout, fixture, actual


def _panels(fig: Any) -> dict[str, Any]:
    return {ax.get_title().split()[0]: ax for ax in fig.axes if ax.get_title()}


def test_the_cause_maps_show_a_scale_as_one_colour_and_a_transpose_mirrored(
    fixture_and_bugs: Any,
) -> None:
    pytest.importorskip("matplotlib")
    layout, fixture, actual = fixture_and_bugs
    result = compare(actual, fixture.packed, layout, floors=fixture.floors)
    assert [g.name for g in result.grads if g.ratio_map is not None] == ["dq", "dv", "dstate"]
    panels = _panels(result.plot(kind="ratio"))
    assert set(panels) == {"dq", "dv", "dstate"}
    cells = np.ma.getdata(panels["dq"].images[0].get_array())
    np.testing.assert_allclose(cells, -1.0, rtol=1e-6)  # a sign flip: -1 everywhere
    assert panels["dq"].get_title().endswith("\n<a,e>/<e,e> over b, n")
    # dv: heads 1 and 2 are right (ratio 1); the exchanged heads 0 and 3 are not.
    dv = np.ma.getdata(panels["dv"].images[0].get_array())
    np.testing.assert_allclose(dv[[1, 2]], 1.0, rtol=1e-6)
    assert np.abs(np.nanmedian(dv[[0, 3]], axis=1) - 1).min() > 0.1
    assert any(f.kind == "transpose" for f in result["dstate"].findings)
    panel = _panels(result.plot(kind="signed", names=["dstate"]))["dstate"]
    assert [t.get_text() for t in panel.texts] == [f"h={h}" for h in range(layout.heads)]
    assert "a tile of i x j per head" in panel.get_title()
    for image in panel.images:  # one i x j tile per head
        tile = np.ma.getdata(image.get_array())
        assert tile.shape == (layout.state_size, layout.state_size)
        # a - e of a transpose is antisymmetric, zero on the diagonal: a mirrored pattern.
        np.testing.assert_allclose(tile, -tile.T, rtol=1e-6, atol=0)
        assert not np.diagonal(tile).any()
        assert np.abs(tile).max() > 0
    passing = _panels(result.plot(kind="ratio", names=["dk", "dq"]))
    assert not passing["dk"].images
    assert passing["dq"].images
    assert [t.get_text() for t in passing["dk"].texts] == [
        "passed: no ratio map\n(kept for failing gradients)"
    ]
    for kind in ("errors", None):
        with pytest.raises(
            ValueError,
            match=rf"plot_errors: kind must be one of 'error', 'signed', 'ratio', got {kind!r}",
        ):
            result.plot(kind=kind)

"""The precision floors: measured at fixture time, stored, and judged against."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, compare, load_fixture, save_fixture, unpack
from gdn_layout._floors import decode_floors, encode_floors, precisions_of, sampled_pairs
from gdn_layout.check._criterion import DEFAULT_FLOORS, K
from gdn_layout.files import Fixture, FixtureError
from gdn_layout.generate import _suite_cases, make_fixture
from gdn_layout.reference import backward

LAYOUT = GdnBackwardLayout(2, 9, 3, 8, gate_per_channel=True, carry_state=True)


@pytest.fixture(scope="module")
def fixture() -> Fixture:
    return make_fixture(LAYOUT, regime="mixed", seed=7, precisions="all")


def _rms(x: NDArray[np.float64]) -> float:
    return math.sqrt(float(np.mean(np.square(x))))


def _figures_of(low: NDArray[Any], truth: NDArray[np.float64]) -> dict[str, tuple[float, float]]:
    figures = {}
    for seg in LAYOUT.segments():
        span = slice(seg.offset, seg.offset + seg.length)
        err = low[span].astype(np.float64) - truth[span]
        scale = _rms(truth[span])
        figures[seg.name] = (_rms(err) / scale, float(np.abs(err).max()) / scale)
    return figures


def test_floors_are_the_worst_of_each_class_s_correct_forms(fixture: Fixture) -> None:
    assert fixture.floors is not None
    assert tuple(fixture.floors) == precisions_of(np.dtype(np.float32), "all")
    q, k, v, g, beta, dy = (np.asarray(a, np.float64) for a in fixture.inputs[:6])
    truth = backward(q, k, v, g, beta, dy, np.asarray(fixture.state, np.float64))
    step = _figures_of(backward(*fixture.inputs, dtype=np.float32, method="recurrent"), truth)
    for name in LAYOUT.names:
        f32, tf32 = fixture.floors["float32"][name], fixture.floors["tf32"][name]
        for i in (0, 1):  # each class's floor covers the step-by-step form (rounded up)
            assert f32[i] >= step[name][i]
            assert tf32[i] >= f32[i]
        # The reach: how far the class's correct forms go beyond the step-by-step form.
        assert f32[2] == pytest.approx(max(f32[:2]) / max(step[name]), rel=1e-2)
    # TF32's operands round at 2**-11: its floors are far above float32's.
    assert fixture.floors["tf32"]["dq"][0] > 100 * fixture.floors["float32"]["dq"][0]
    assert fixture.floors["float16"]["dq"][0] >= fixture.floors["tf32"]["dq"][0]


def test_a_fixture_records_its_buffers_class_unless_asked() -> None:
    layout = GdnBackwardLayout(1, 3, 1, 4)
    for dtype, recorded in (("float32", "float32"), ("float64", "float32"), ("float16", "float16")):
        assert tuple(make_fixture(layout, dtype=dtype).floors or ()) == (recorded,)
    assert tuple(make_fixture(layout, dtype=ml_dtypes.bfloat16).floors or ()) == ("bfloat16",)
    every = make_fixture(layout, precisions="all").floors or {}
    assert tuple(every) == ("float32", "tf32", "float16")


def test_a_class_s_floors_are_measured_when_asked() -> None:
    fx = make_fixture(GdnBackwardLayout(1, 20, 2, 8), regime="mild", precisions=("bfloat16",))
    assert fx.floors is not None
    assert tuple(fx.floors) == ("bfloat16",)
    assert 1e-3 < fx.floors["bfloat16"]["dq"][0] < 1
    with pytest.raises(ValueError, match="make_fixture: precisions must be one of float64, "):
        make_fixture(GdnBackwardLayout(1, 2, 1, 4), precisions=("fp8",))
    with pytest.raises(TypeError, match="make_fixture: precisions must be 'all' or a sequence"):
        make_fixture(GdnBackwardLayout(1, 2, 1, 4), precisions="tf32")


def test_floors_round_trip_through_the_file(tmp_path: Path, fixture: Fixture) -> None:
    path = save_fixture(tmp_path / "f.safetensors", fixture)
    assert load_fixture(path).floors == fixture.floors
    assert decode_floors(encode_floors(fixture.floors or {})) == fixture.floors
    # A fixture without floors writes no floors key and loads with floors None.
    plain = Fixture(*fixture.inputs, y=fixture.y, packed=fixture.packed)
    assert "floors" not in plain.metadata()
    assert load_fixture(save_fixture(tmp_path / "plain.safetensors", plain)).floors is None


@pytest.mark.parametrize(
    "text",
    [
        '{"float32": {"dq": [1]}}',
        '{"float8": {}}',
        "[1]",
        "{",
        '{"float32": {"dx": [0, 0]}}',
        '{"float32": {"dq": [Infinity, 1e-5]}}',  # would let any error pass
        '{"float32": {"dq": [true, false]}}',
    ],
)
def test_malformed_floors_are_a_fixture_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValueError, match="floors"):
        decode_floors(text)
    fx = make_fixture(GdnBackwardLayout(1, 2, 1, 2), calibrate=False)
    assert fx.floors is None
    path = save_fixture(tmp_path / "f.safetensors", fx)
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header["__metadata__"]["floors"] = text
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length :])
    with pytest.raises(FixtureError, match="floors"):
        load_fixture(path)


def _f32(fx: Fixture) -> NDArray[np.float32]:
    return backward(*fx.inputs, dtype=np.float32)


def test_correct_kernels_pass_in_every_dtype(fixture: Fixture) -> None:
    for out in (
        _f32(fixture),
        backward(*fixture.inputs, dtype=np.float32, method="recurrent"),
        _f32(fixture).astype(np.float16),
        _f32(fixture).astype(ml_dtypes.bfloat16),
    ):
        result = compare(out, fixture.packed, LAYOUT, floors=fixture.floors)
        assert result.passed, result
        judged = result["dq"].criterion.precision_name
        assert judged == out.dtype.name
        for grad in result.grads:
            assert grad.criterion.mode == "calibrated"
            assert grad.criterion.floor is not None
            # A class the fixture did not record (bfloat16, for a float32 one) has defaults.
            recorded = fixture.floors.get(judged, {}).get(grad.name)  # type: ignore[union-attr]
            assert grad.criterion.floor[0] >= (recorded or DEFAULT_FLOORS[judged])[0]
            assert grad.error_floor_ratio is not None
            assert grad.error_floor_ratio <= K[judged]
            assert grad.mismatches == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_injected_bugs_fail_the_gradients_they_touch(fixture: Fixture, dtype: str) -> None:
    if dtype == "bfloat16":  # judged against bfloat16's floors, measured when asked
        fixture = make_fixture(LAYOUT, regime="mixed", seed=7, precisions=("bfloat16",))

    def judged(out: NDArray[np.float32]) -> tuple[str, ...]:
        cast = out.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else out
        return compare(cast, fixture.packed, LAYOUT, floors=fixture.floors).failed

    one = _f32(fixture)
    dk = unpack(one, LAYOUT).dk
    dk[1, 4, 2, 5] += np.float32(_rms(dk.astype(np.float64)))  # one wrong element
    assert judged(one) == ("dk",)
    swapped = _f32(fixture)
    dv = unpack(swapped, LAYOUT).dv
    dv[:, :, [0, 1]] = dv[:, :, [1, 0]]
    assert judged(swapped) == ("dv",)


def test_without_floors_the_defaults_apply(fixture: Fixture) -> None:
    result = compare(_f32(fixture), fixture.packed, LAYOUT)
    assert result.passed
    for dtype in ("float32", "float16", "bfloat16"):
        out = _f32(fixture).astype(dtype if dtype != "bfloat16" else ml_dtypes.bfloat16)
        grad = compare(out, fixture.packed, LAYOUT)["dk"]
        assert grad.criterion.floor == DEFAULT_FLOORS[dtype]
        assert grad.passed
    # float64's defaults are float32's, scaled to its unit roundoff.
    wide = fixture.packed.astype(np.float64)
    assert compare(wide, wide, LAYOUT)["dq"].criterion.floor == tuple(
        f * 2.0**-29 for f in DEFAULT_FLOORS["float32"]
    )


def test_an_all_zero_gradient_passes_only_when_exact() -> None:
    layout = GdnBackwardLayout(1, 2, 1, 2)
    expected = np.zeros(layout.total_elems, np.float32)
    assert compare(expected, expected, layout).passed
    actual = expected.copy()
    actual[0] = 1e-30
    result = compare(actual, expected, layout)
    assert result.failed == ("dq",)
    assert result["dq"].error_floor_ratio == math.inf


@pytest.mark.parametrize(
    ("floors", "error", "message"),
    [
        ("x", TypeError, r"compare: floors must be a mapping \{precision: \{gradient: \(rms, max"),
        ({"float8": {}}, ValueError, r"compare: floors: unknown precision class 'float8'"),
        ({"float32": [1.0]}, TypeError, r"compare: floors\['float32'\] must be a mapping, got"),
        ({"float32": {"dq": (1.0,)}}, ValueError, r"compare: floors\['float32'\]\['dq'\] must be"),
        ({"float32": {"dq": (-1.0, "x")}}, ValueError, r"finite numbers >= 0; got \(-1.0, 'x'\)"),
        ({"float32": {"dq": (float("inf"), 1.0)}}, ValueError, r"got \(inf, 1.0\)"),
    ],
)
def test_bad_floors_are_refused_by_compare(
    floors: object, error: type[Exception], message: str
) -> None:
    layout = GdnBackwardLayout(1, 2, 1, 2)
    buffer = np.zeros(layout.total_elems, np.float32)
    with pytest.raises(error, match=message):
        compare(buffer, buffer.astype(np.float64), layout, floors=floors)  # type: ignore[arg-type]


# -- precision classes -----------------------------------------------------------------------


def test_the_class_is_the_fixture_s_unless_precision_names_another(fixture: Fixture) -> None:
    out = _f32(fixture)
    assert compare(out, fixture)["dq"].criterion.precision_name == "float32"
    assert compare(out, fixture, precision="TF32")["dq"].criterion.precision_name == "tf32"
    assert compare(out.astype(np.float64), fixture)["dq"].criterion.precision_name == "float32"
    half = out.astype(ml_dtypes.bfloat16)
    assert compare(half, fixture, precision="bf16")["dq"].criterion.precision_name == "bfloat16"
    assert compare(out, fixture).passed
    assert compare(out, fixture, precision="tf32").passed
    # Bare buffers are judged in the class of the less precise.
    result = compare(half, fixture.packed, fixture.layout, floors=fixture.floors)
    assert result["dq"].criterion.precision_name == "bfloat16"
    assert result.passed
    # A class is checked only where a gradient is calibrated.
    judged = compare(half, fixture, precision="float32", rtol=1e-1, atol=1e-1)
    assert {g.criterion.mode for g in judged.grads} == {"elementwise"}


def test_an_output_coarser_than_its_fixture_names_precision(fixture: Fixture) -> None:
    # A float32 kernel whose output is cast to bfloat16 would pass as bfloat16: a stray cast
    # is refused, naming the keyword and options that judge a bfloat16 kernel.
    half = _f32(fixture).astype(ml_dtypes.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"compare: the fixture is float32, so the kernel is judged as float32, but its "
        r"output is bfloat16, coarser: a stray cast\? A kernel that computes in bfloat16 is "
        r"judged with precision='bfloat16' \(--precision bfloat16 on the command line, "
        r"--gdn-precision bfloat16 with pytest\)",
    ):
        compare(half, fixture)
    assert compare(half, fixture, precision="bfloat16").passed


def test_a_tf32_kernel_passes_as_tf32_and_fails_as_float32(fixture: Fixture) -> None:
    # The chunked form with its products on TF32 operands: a correct kernel of that class.
    from gdn_layout.reference._fused import fused_backward

    low = fused_backward(*fixture.inputs, bits=10, length=32)[0]  # not the floors' own run
    assert compare(low, fixture, precision="tf32").passed
    assert not compare(low, fixture).passed


def test_bad_precisions_are_refused(fixture: Fixture) -> None:
    out = _f32(fixture)
    with pytest.raises(
        ValueError,
        match=r"compare: precision must be one of float64, float32, "
        r"tf32, bfloat16, float16, got 'fp8'",
    ):
        compare(out, fixture, precision="fp8")
    with pytest.raises(ValueError, match=r"compare: precision must be one of .*, got 3"):
        compare(out, fixture, precision=3)  # type: ignore[arg-type]
    # A class finer than the buffers: their rounding alone would fail it.
    with pytest.raises(
        ValueError,
        match=r"compare: precision 'float32' judges float32 buffers, got bfloat16 ones, whose "
        r"rounding alone exceeds its floors; pass precision='bfloat16' or a coarser class",
    ):
        compare(out.astype(ml_dtypes.bfloat16), fixture, precision="float32")


def test_a_fixture_brings_its_layout_floors_and_scales(fixture: Fixture) -> None:
    out = _f32(fixture)
    whole = compare(out, fixture)
    apart = compare(out, fixture.packed, LAYOUT, floors=fixture.floors, scales=fixture.scales)
    assert whole == apart
    assert compare(out, fixture, LAYOUT) == whole


def test_the_report_says_the_class_and_how_far_correct_forms_reach() -> None:
    fx = make_fixture(GdnBackwardLayout(1, 100, 2, 16), regime="qwen", seed=1)
    assert fx.floors is not None
    reach = fx.floors["float32"]["dg"][2]
    assert reach > 1.5  # under Qwen's gates the chunked form rounds dg far more
    line = compare(backward(*fx.inputs, dtype=np.float32), fx)["dg"].summary()
    assert f"floors for float32: rms ratio {fx.floors['float32']['dg'][0]:.3g}" in line
    assert f"a correct float32 kernel reaches {reach:.3g}x the step-by-step form's" in line


# -- the field's correct kernels, over the standard suite ------------------------------------

#: Each kernel of the panel (tests/panel.py), the class it is judged in, and the suites it runs.
PANEL_KERNELS = {
    "chunked float32": ("float32", None),
    "chunked tf32": ("tf32", None),
    "chunked bfloat16": ("bfloat16", "bfloat16"),
    "step-by-step": ("float32", None),
}


def _panel_kernel(name: str, fx: Fixture) -> NDArray[Any] | None:
    import panel

    if name == "chunked float32":
        return panel.chunked(fx)
    if name == "chunked tf32":
        return panel.chunked(fx, "tf32")
    if name == "chunked bfloat16":
        return panel.chunked(fx, "bfloat16")
    if fx.layout.seq > 130:  # autograd through hundreds of steps: the short cases suffice
        return None
    return panel.step_by_step(fx)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", list(PANEL_KERNELS))
def test_the_field_s_correct_kernels_pass_every_case(
    kernel: str, suite: tuple[Path, list[Path]], suite_bf16: tuple[Path, list[Path]]
) -> None:
    # Written apart from the reference and its floors: transformers' and flash-linear-
    # attention's chunked WY/UT form with autograd, and the step-by-step recurrence summed in
    # torch's order. Each passes every case of the suites its class judges.
    pytest.importorskip("torch")
    precision, dtype = PANEL_KERNELS[kernel]
    paths = suite_bf16[1] if dtype == "bfloat16" else suite[1]
    failed, judged = [], 0
    for path in paths:
        fx = load_fixture(path)
        out = _panel_kernel(kernel, fx)
        if out is None:
            continue
        judged += 1
        result = compare(out, fx, precision=precision)
        if not result.passed:
            failed.append(f"{path.name}: {result.failed} {result['dq'].criterion.precision_name}")
    assert judged >= len(paths) // 2
    assert not failed, failed


@pytest.mark.slow
def test_transformers_chunked_function_passes_every_case(suite: tuple[Path, list[Path]]) -> None:
    # transformers' torch_chunk_gated_delta_rule (Qwen3-Next), under autograd: the public
    # chunked kernel whose rounding the step-by-step floors failed in 26 of 132 cases.
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import panel

    judged = 0
    for path in suite[1]:
        fx = load_fixture(path)
        if fx.layout.gate_per_channel:
            continue  # it takes one gate per head
        judged += 1
        result = compare(panel.transformers_chunked(fx), fx)
        assert result.passed, (path.name, result.failed)
    assert judged == len(suite[1]) // 2


def test_a_sampled_form_s_figures_scale_the_next_form_s_by_their_ratio_on_the_sample() -> None:
    from gdn_layout._floors import SAMPLE_MARGIN, Sample, panel_floors

    rng = np.random.default_rng(1)
    truth = rng.standard_normal(1000)
    part = truth[:100]  # the sample's rows and heads
    chunked = truth * (1 + 1e-6 * rng.standard_normal(1000))
    step = part + 3 * (chunked[:100] - part)  # on the sample, three times the chunked error
    sample = Sample(
        "step-by-step",
        {"dq": part},
        {"step-by-step": {"dq": step}, "chunked": {"dq": chunked[:100]}},
    )
    floors = panel_floors({"chunked": {"dq": chunked}}, {"dq": truth}, None, ("float32",), sample)
    ratio = np.array(_figures_of_named(step, part)) / np.array(
        _figures_of_named(chunked[:100], part)
    )
    whole = np.array(_figures_of_named(chunked, truth))
    assert floors["float32"]["dq"][:2] == pytest.approx(SAMPLE_MARGIN * ratio * whole, rel=2e-2)
    assert floors["float32"]["dq"][2] == pytest.approx(1.0, rel=1e-2)  # the step form's is worst


def _figures_of_named(low: NDArray[Any], truth: NDArray[np.float64]) -> tuple[float, float]:
    err = np.abs(np.asarray(low, np.float32).astype(np.float64) - truth)
    return (_rms(err) / _rms(truth), float(err.max()) / _rms(truth))


def test_gradient_floors_do_not_depend_on_the_states_kept() -> None:
    # The kernels' chunks are 64 steps whatever states a fixture keeps: states at 16-step
    # boundaries come from a run of their own.
    layout = GdnBackwardLayout(1, 100, 2, 8, gate_per_channel=True)
    plain = make_fixture(layout, regime="qwen", seed=2)
    with_states = make_fixture(layout, regime="qwen", seed=2, states=16)
    assert plain.floors == with_states.floors
    assert with_states.state_floors is not None
    assert set(with_states.state_floors["float32"]) == {"y", "h", "dh", "final_state"}


def test_no_case_of_the_suite_samples_its_step_by_step_floors() -> None:
    assert all(sampled_pairs(case.layout) is None for case in _suite_cases())
    assert sampled_pairs(GdnBackwardLayout(3, 4096, 5, 64)) == [(0, 0), (2, 4)]

"""The calibrated criterion: floors measured at fixture time, stored, and judged against."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, compare, load_fixture, save_fixture, unpack
from gdn_layout._dtypes import UNIT_ROUNDOFF
from gdn_layout.check._criterion import DEFAULT_FLOORS, FLOOR_DTYPES, K
from gdn_layout.check._floors import decode_floors, encode_floors, round_to
from gdn_layout.files import Fixture, FixtureError
from gdn_layout.generate import make_fixture
from gdn_layout.reference import backward

LAYOUT = GdnBackwardLayout(2, 9, 3, 8, gate_per_channel=True, carry_state=True)


@pytest.fixture(scope="module")
def fixture() -> Fixture:
    return make_fixture(LAYOUT, regime="mixed", seed=7)


def _rms(x: NDArray[np.float64]) -> float:
    return math.sqrt(float(np.mean(np.square(x))))


def test_floors_are_measured_per_dtype_and_gradient(fixture: Fixture) -> None:
    assert fixture.floors is not None
    assert set(fixture.floors) == set(FLOOR_DTYPES)
    q, k, v, g, beta, dy = (np.asarray(a, np.float64) for a in fixture.inputs[:6])
    truth = backward(q, k, v, g, beta, dy, np.asarray(fixture.state, np.float64))
    low = backward(*fixture.inputs, dtype=np.float32, method="recurrent")  # the spec's arithmetic
    for dtype in FLOOR_DTYPES:
        assert set(fixture.floors[dtype]) == set(LAYOUT.names)
        rounded = low.astype(dtype if dtype != "bfloat16" else ml_dtypes.bfloat16)
        for seg in LAYOUT.segments():
            span = slice(seg.offset, seg.offset + seg.length)
            err = rounded[span].astype(np.float64) - truth[span]
            rms_floor, max_floor = fixture.floors[dtype][seg.name]
            assert rms_floor == pytest.approx(_rms(err) / _rms(truth[span]), rel=1e-2)
            assert max_floor == pytest.approx(np.abs(err).max() / _rms(truth[span]), rel=1e-2)
    # Each dtype's floor is about its rounding: float16 and bfloat16 far above float32.
    assert fixture.floors["float32"]["dq"][0] < 1e-6
    assert 1e-4 < fixture.floors["float16"]["dq"][0] < UNIT_ROUNDOFF["float16"]
    assert 1e-3 < fixture.floors["bfloat16"]["dq"][0] < UNIT_ROUNDOFF["bfloat16"]


def test_bfloat16_rounding_needs_no_ml_dtypes() -> None:
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(round_to(x, "bfloat16"), expected)


def test_floors_round_trip_through_the_file(tmp_path: Path, fixture: Fixture) -> None:
    path = save_fixture(tmp_path / "f.safetensors", fixture)
    assert load_fixture(path).floors == fixture.floors
    assert decode_floors(encode_floors(fixture.floors or {})) == fixture.floors
    # A fixture without floors writes no floors key and loads with floors None.
    plain = Fixture(*fixture.inputs, y=fixture.y, packed=fixture.packed)
    assert "floors" not in plain.metadata()
    assert load_fixture(save_fixture(tmp_path / "plain.safetensors", plain)).floors is None
    # The floors key is added after the existing ones, which keep their values; the states'
    # keys, newer still, come after it.
    meta = fixture.metadata()
    newer = ("floors", "states_chunk", "state_floors")
    keys = [k for k in meta if k in newer]
    assert list(meta)[-len(keys) :] == keys
    assert keys[0] == "floors"
    assert {k: v for k, v in meta.items() if k not in newer} == {
        **plain.metadata(),
        "seed": "7",
        "regime": "mixed",
        "compute_dtype": "float64",
    }


@pytest.mark.parametrize(
    "text",
    [
        '{"float32": {"dq": [1]}}',
        '{"float8": {}}',
        "[1]",
        "{",
        '{"float32": {"dx": [0, 0]}}',
        '{"float32": {"dq": [Infinity, 1e-5]}}',  # would let any error pass
        '{"float32": {"dq": [NaN, 1e-5]}}',
        '{"float32": {"dq": [true, false]}}',
        '{"float32": {"dq": [-1e-5, 1e-5]}}',
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
        judged = result["dq"].judged_dtype
        assert judged == out.dtype.name
        for grad in result.grads:
            assert grad.mode == "calibrated"
            assert grad.floor is not None
            assert grad.floor[0] >= fixture.floors[judged][grad.name][0]  # type: ignore[index]
            assert grad.error_floor_ratio is not None
            assert grad.error_floor_ratio <= K[judged]
            assert grad.mismatches == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_injected_bugs_fail_the_gradients_they_touch(fixture: Fixture, dtype: str) -> None:
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
    # A chunked kernel that forgets the state at a chunk boundary: every gradient is off.
    x = fixture.inputs
    cut = 4
    q, k, v, g, beta, dy = (np.asarray(a) for a in x[:6])
    head = unpack(
        backward(
            q[:, :cut],
            k[:, :cut],
            v[:, :cut],
            g[:, :cut],
            beta[:, :cut],
            dy[:, :cut],
            x.state,
            dtype=np.float32,
        ),
        GdnBackwardLayout(2, cut, 3, 8, gate_per_channel=True, carry_state=True),
    )
    tail = unpack(
        backward(
            q[:, cut:],
            k[:, cut:],
            v[:, cut:],
            g[:, cut:],
            beta[:, cut:],
            dy[:, cut:],
            dtype=np.float32,
        ),
        GdnBackwardLayout(2, 9 - cut, 3, 8, gate_per_channel=True),
    )
    dropped = np.empty(LAYOUT.total_elems, np.float32)
    grads = unpack(dropped, LAYOUT)
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        getattr(grads, name)[:, :cut] = getattr(head, name)
        getattr(grads, name)[:, cut:] = getattr(tail, name)
    assert grads.dstate is not None
    assert head.dstate is not None
    grads.dstate[...] = head.dstate
    assert set(judged(dropped)) >= {"dq", "dk", "dv", "dstate"}


def test_out_of_size_counts_elements_over_the_max_error(fixture: Fixture) -> None:
    out = _f32(fixture)
    dq = unpack(out, LAYOUT).dq
    dq[0, :3, 0, 0] += np.float32(1.0)
    grad = compare(out, fixture.packed, LAYOUT, floors=fixture.floors)["dq"]
    assert grad.mismatches == 3
    assert grad.worst is not None
    assert grad.worst[:2] == (0, 0) or grad.worst[1] < 3
    assert "error/floor" in str(compare(out, fixture.packed, LAYOUT, floors=fixture.floors))


def test_without_floors_the_defaults_apply(fixture: Fixture) -> None:
    result = compare(_f32(fixture), fixture.packed, LAYOUT)
    assert result.passed
    for dtype in FLOOR_DTYPES:
        out = _f32(fixture).astype(dtype if dtype != "bfloat16" else ml_dtypes.bfloat16)
        grad = compare(out, fixture.packed, LAYOUT)["dk"]
        assert grad.floor == DEFAULT_FLOORS[dtype]
        assert grad.passed
    # float64's defaults are float32's, scaled to its unit roundoff.
    wide = fixture.packed.astype(np.float64)
    assert compare(wide, wide, LAYOUT)["dq"].floor == tuple(
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
        (
            "x",
            TypeError,
            r"compare: floors must be a mapping \{dtype: \{gradient: \(rms, max\)\}\}, got str",
        ),
        ({"float8": {}}, ValueError, r"compare: floors: unknown dtype 'float8'"),
        (
            {"float32": [1.0]},
            TypeError,
            r"compare: floors\['float32'\] must be a mapping, got list",
        ),
        ({"float32": {"dq": (1.0,)}}, ValueError, r"compare: floors\['float32'\]\['dq'\] must be"),
        (
            {"float32": {"dq": (-1.0, "x")}},
            ValueError,
            r"two finite numbers >= 0; got \(-1.0, 'x'\)",
        ),
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

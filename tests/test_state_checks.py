"""Fixtures that keep a kernel's parts (y, the chunk states, their cotangents, the final state)
and the checks that judge them, so that a kernel wrong everywhere can be bisected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, load_fixture, save_fixture
from gdn_layout.cli import main
from gdn_layout.files import Fixture, FixtureError
from gdn_layout.generate import make_fixture
from gdn_layout.reference import chunk_states, forward
from gdn_layout.suites import STATE_TENSORS, compare_states, make_case
from support import run

LAYOUT = GdnBackwardLayout(2, 40, 2, 8, carry_state=True)
STATELESS = GdnBackwardLayout(1, 33, 3, 4, gate_per_channel=True)


@pytest.fixture(scope="module")
def fixture() -> Fixture:
    return make_fixture(LAYOUT, regime="qwen", seed=4, states=16)


def _kernel_parts(
    fx: Fixture, chunk: int, method: Literal["chunked", "recurrent"] = "chunked"
) -> dict[str, NDArray[Any]]:
    """A correct float32 kernel's y, h, dh and final state."""
    x = fx.inputs
    result = forward(*x[:5], state=x.state, dtype=np.float32, method=method)
    y = result[0] if isinstance(result, tuple) else result
    h, dh, final = chunk_states(*x, chunk=chunk, dtype=np.float32, method=method)
    return {"y": y, "h": h, "dh": dh, "final_state": final}


def test_a_fixture_keeps_the_states_it_was_asked_for(fixture: Fixture, tmp_path: Path) -> None:
    x = fixture.inputs
    assert x.state is not None
    wide = [np.asarray(a, np.float64) for a in (x.q, x.k, x.v, x.g, x.beta, x.dy, x.state)]
    h, dh, final = chunk_states(*wide, chunk=16)
    assert fixture.states_chunk == 16
    assert fixture.h is not None
    assert fixture.dh is not None
    assert fixture.final_state is not None
    assert fixture.h.shape == fixture.dh.shape == (2, 3, 2, 8, 8)
    np.testing.assert_array_equal(fixture.h, h.astype(np.float32))
    np.testing.assert_array_equal(fixture.dh, dh.astype(np.float32))
    np.testing.assert_array_equal(fixture.final_state, final.astype(np.float32))
    assert fixture.state_floors is not None
    assert set(fixture.state_floors["float32"]) == set(STATE_TENSORS)
    # Saved, they load back, and the official reader finds them by name.
    path = save_fixture(tmp_path / "states.safetensors", fixture)
    back = load_fixture(path)
    assert (back.states_chunk, back.state_floors) == (16, fixture.state_floors)
    safetensors = pytest.importorskip("safetensors.numpy")
    tensors = safetensors.load_file(str(path))
    for name in ("h", "dh", "final_state"):
        np.testing.assert_array_equal(getattr(back, name), getattr(fixture, name))
        np.testing.assert_array_equal(tensors[name], getattr(fixture, name))


def test_the_final_state_is_kept_whenever_the_state_is_carried() -> None:
    carried = make_fixture(GdnBackwardLayout(1, 5, 2, 4, carry_state=True))
    assert carried.final_state is not None
    assert carried.h is None
    assert carried.states_chunk is None
    assert carried.state is not None
    _, final = forward(*carried.inputs[:5], state=carried.state)
    np.testing.assert_array_equal(carried.final_state, np.asarray(final).astype(np.float32))
    plain = make_fixture(STATELESS)
    assert plain.final_state is None
    assert plain.state_floors is None
    assert set(plain.tensors()) == {"q", "k", "v", "g", "beta", "dy", "y", "packed"}
    assert "states_chunk" not in plain.metadata()


def _rewritten(path: Path, change: Any) -> Path:
    """The fixture at ``path`` with its header's JSON changed by ``change``."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    out = path.with_name("changed.safetensors")
    out.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    return out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h: h["__metadata__"].pop("states_chunk"), "unexpected tensor.*dh, h.*states_chunk"),
        (lambda h: h["__metadata__"].update(states_chunk="0"), "states_chunk must be a positive"),
        (lambda h: h["__metadata__"].update(states_chunk="x"), "states_chunk must be a positive"),
        (lambda h: h["__metadata__"].update(states_chunk="8"), r"tensor 'h' has shape \(2, 3, "),
        (lambda h: h.pop("dh"), "missing tensor.*dh"),
        (lambda h: h["__metadata__"].update(state_floors="{"), "state_floors is not JSON"),
    ],
)
def test_damaged_states_are_named(
    fixture: Fixture, tmp_path: Path, change: Any, message: str
) -> None:
    path = _rewritten(save_fixture(tmp_path / "states.safetensors", fixture), change)
    with pytest.raises(FixtureError, match=message):
        load_fixture(path)


def test_h_dh_and_the_chunk_come_together() -> None:
    x = make_fixture(GdnBackwardLayout(1, 4, 1, 2))
    with pytest.raises(ValueError, match="h, dh and states_chunk are given together"):
        Fixture(*x.inputs, y=x.y, packed=x.packed, h=np.zeros((1, 1, 1, 2, 2), np.float32))
    with pytest.raises(ValueError, match="states_chunk must be a positive integer or None, got 0"):
        Fixture(
            *x.inputs,
            y=x.y,
            packed=x.packed,
            h=np.zeros((1, 1, 1, 2, 2), np.float32),
            dh=np.zeros((1, 1, 1, 2, 2), np.float32),
            states_chunk=0,
        )
    for states, shown in ((0, "0"), (10**19, "10+")):  # 10**19 steps: too long to record
        with pytest.raises(
            ValueError, match=rf"states must be an integer from 1 to 9+ or None, got {shown}"
        ):
            make_fixture(GdnBackwardLayout(1, 4, 1, 2), states=states)


@pytest.mark.parametrize("method", ["chunked", "recurrent"])
def test_a_correct_kernels_parts_pass(
    fixture: Fixture, method: Literal["chunked", "recurrent"]
) -> None:
    for name, part in _kernel_parts(fixture, 16, method).items():
        result = compare_states(part, fixture, name)
        assert result.passed, result.summary()
        assert result.criterion.precision_name == "float32"


@pytest.mark.slow
def test_states_are_computed_for_a_fixture_that_keeps_none() -> None:
    plain = make_fixture(STATELESS, regime="mixed", seed=2)
    for chunk in (1, 16, 64):
        for name, part in _kernel_parts(plain, chunk).items():
            assert compare_states(part, plain, name, chunk=chunk).passed, (name, chunk)


def test_a_state_lost_at_one_chunk_is_named_by_that_chunk(fixture: Fixture) -> None:
    parts = _kernel_parts(fixture, 16)
    h = parts["h"].copy()
    h[1, 2, 0] = 0  # batch 1, the state entering chunk 2, head 0
    result = compare_states(h, fixture, "h")
    assert not result.passed
    assert result.axes == ("b", "c", "h", "i", "j")
    assert result.worst is not None
    assert result.worst[:3] == (1, 2, 0)
    assert result.where().startswith("h[1, 2, 0, ")
    assert result.error_map.shape == (3, 2)  # chunk by head
    assert set(zip(*np.nonzero(result.mismatch_map[1]), strict=True)) == {(2, 0)}


def test_a_gate_read_one_step_late_is_found_in_y_first(fixture: Fixture) -> None:
    x = fixture.inputs
    late = np.zeros_like(x.g)
    late[:, 1:] = x.g[:, :-1]
    y, _ = forward(x.q, x.k, x.v, late, x.beta, x.state, dtype=np.float32)
    result = compare_states(y, fixture, "y")
    assert not result.passed
    assert result.axes == ("b", "s", "h", "n")


def test_bad_arguments_are_named(fixture: Fixture) -> None:
    h = _kernel_parts(fixture, 16)["h"]
    with pytest.raises(
        ValueError, match=r"tensor must be one of \('y', 'h', 'dh', 'final_state'\)"
    ):
        compare_states(h, fixture, "state")
    with pytest.raises(ValueError, match="chunk must be a positive integer or None, got 0"):
        compare_states(h, fixture, "h", chunk=0)
    with pytest.raises(TypeError, match="chunk must be a positive integer or None, got bool True"):
        compare_states(h, fixture, "h", chunk=True)
    with pytest.raises(ValueError, match=r"h must have shape \(2, 5, 2, 8, 8\), got \(2, 3, 2"):
        compare_states(h, fixture, "h", chunk=8)
    with pytest.raises(TypeError, match="h must have a float dtype, got int64"):
        compare_states(h.astype(np.int64), fixture, "h")


def test_check_states_names_the_part_and_where() -> None:
    case = make_case(GdnBackwardLayout(1, 40, 2, 4, carry_state=True), regime="mild", seed=1)
    parts = _kernel_parts(case.fixture, 16)
    results = case.check_states(
        chunk=16, y=parts["y"], h=parts["h"], dh=parts["dh"], final_state=parts["final_state"]
    )
    assert set(results) == set(STATE_TENSORS)
    dh = parts["dh"].copy()
    dh[0, 1, 1] *= 2
    with pytest.raises(AssertionError) as info:
        case.check_states(h=parts["h"], dh=dh, chunk=16)
    message = str(info.value)
    assert message.startswith(f"case {case.name}: dh differ")
    assert "worst at b=0, c=1, h=1, i=" in message
    assert "  h[" not in message  # h passes: only what differs is named
    with pytest.raises(AssertionError) as info:
        case.check_states(h=parts["h"].swapaxes(-1, -2), chunk=16)
    # The cause leads, once, as it does for the gradients (one message function says both).
    lines = str(info.value).splitlines()
    assert lines[1].startswith("  likely cause: h holds its transpose: h[b, c, h, i, j] is")
    assert sum("likely cause" in line for line in lines) == 1
    with pytest.raises(ValueError, match="give at least one of y, h, dh, final_state"):
        case.check_states()


def test_the_command_line_writes_and_compares_states(fixture: Fixture, tmp_path: Path) -> None:
    path = tmp_path / "case.safetensors"
    done = run(
        "fixture",
        *["-B", "1", "-S", "40", "-H", "2", "-N", "4", "--carry-state", "--states", "16", "-o"],
        path,
    )
    assert done.returncode == 0, done.stderr
    loaded = load_fixture(path)
    assert loaded.states_chunk == 16
    parts = _kernel_parts(loaded, 16)
    np.save(tmp_path / "h.npy", parts["h"])
    done = run("compare", "--tensor", "h", tmp_path / "h.npy", path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok h[")
    bad = parts["h"].copy()
    bad[0, 1] = 0
    np.save(tmp_path / "bad.npy", bad)
    done = run("compare", "--tensor", "h", tmp_path / "bad.npy", path)
    assert done.returncode == 1
    assert done.stdout.startswith("FAIL h[0, 1, ")
    np.save(tmp_path / "late.npy", np.concatenate([parts["h"][:, 1:], parts["h"][:, -1:]], 1))
    done = run("compare", "--tensor", "h", tmp_path / "late.npy", path)
    assert done.returncode == 1
    assert "\nlikely cause: h is expected shifted by -1 chunk along c: h[:, c] holds" in done.stdout
    np.save(tmp_path / "y.npy", parts["y"])
    assert run("compare", "--tensor", "y", tmp_path / "y.npy", path).returncode == 0
    done = run("compare", "--tensor", "h", "--chunk", "8", tmp_path / "h.npy", path)
    assert done.returncode == 2
    assert "elements, but h of" in done.stderr
    assert len(done.stderr.splitlines()) == 1
    done = run("compare", "--tensor", "h", "--rtol", "1e-3", tmp_path / "h.npy", path)
    assert done.returncode == 2
    assert "--tensor is judged against the fixture's floors; drop --rtol" in done.stderr
    done = run("compare", "--chunk", "8", tmp_path / "h.npy", path)
    assert done.returncode == 2
    assert "give --tensor or --plot" in done.stderr
    done = run("fixture", "--suite", tmp_path / "suite", "--states", "16")
    assert done.returncode == 2
    assert "--suite writes no states" in done.stderr


def test_judging_states_leaves_the_fixture_writeable() -> None:
    fx = make_fixture(STATELESS)
    y = np.array(fx.y)
    assert compare_states(y, fx, "y").passed
    fx.y[0, 0, 0, 0] = 1.0  # the fixture's own array is as it was


TRUNCATED_STATES = """
import os, sys
import numpy as np
import gdn_layout.files._mapping
from gdn_layout import FixtureError, load_fixture
from gdn_layout.suites import compare_states

gdn_layout.files._mapping.MAP_THRESHOLD = 0
fx = load_fixture(sys.argv[1])
y = np.array(fx.y)
os.truncate(sys.argv[1], 4096)
try:
    compare_states(y, fx, "h")
except FixtureError as error:
    print("FixtureError:", error)
"""


@pytest.mark.slow
def test_states_of_a_truncated_mapped_fixture_raise_instead_of_crashing(tmp_path: Path) -> None:
    path = save_fixture(tmp_path / "plain.safetensors", make_fixture(STATELESS))
    done = subprocess.run(
        [sys.executable, "-c", TRUNCATED_STATES, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.startswith(f"FixtureError: {path}: changed since it was loaded")


def test_the_command_line_names_a_bad_tensor_file_in_one_line(
    fixture: Fixture, tmp_path: Path
) -> None:
    path = save_fixture(tmp_path / "case.safetensors", fixture)
    assert fixture.h is not None
    np.save(tmp_path / "h.npy", np.zeros(fixture.h.shape, np.int32))
    done = run("compare", "--tensor", "h", tmp_path / "h.npy", path)
    assert done.returncode == 2
    assert "h must have a float dtype, got int32" in done.stderr
    assert len(done.stderr.splitlines()) == 1
    done = run("compare", "--tensor", "h", tmp_path / "h.npy", tmp_path / "h.npy")
    assert done.returncode == 2
    assert "--tensor judges against a gdn-layout fixture" in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["fixture", "-o", "x.safetensors", "--states", "0"],
        ["compare", "--tensor", "h", "--chunk", "0", "a.npy", "b.safetensors"],
        ["verify", "suite", "--crossing", "0"],
    ],
)
def test_a_chunk_of_no_steps_is_a_usage_error(argv: list[str]) -> None:
    done = run(*argv)
    assert done.returncode == 2
    assert "expected a positive integer, got '0'" in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_compare_tensor_plot_draws_the_state_s_map(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = save_fixture(
        tmp_path / "fx.safetensors",
        make_fixture(GdnBackwardLayout(2, 40, 2, 4, carry_state=True), states=16),
    )
    h = _kernel_parts(load_fixture(path), 16)["h"]
    h[1, 1:] *= 2
    np.save(tmp_path / "h.npy", h)
    command = ["compare", "--tensor", "h", str(tmp_path / "h.npy"), str(path)]
    assert main([*command, "--plot", str(tmp_path / "h.png")]) == 1
    assert (tmp_path / "h.png").stat().st_size > 0

"""What a fixture asks of the machine: the memory estimate is within twice the peak RSS of the
work, a run that cannot fit is refused up front, and work with no state element finishes at
once whatever S."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gdn_layout import GdnBackwardLayout, make_fixture, reference
from gdn_layout._limits import human_bytes, memory_refusal
from gdn_layout.generate import draw_inputs, fixture_memory
from support import assert_user_error, deadline, run

limits = importlib.import_module("gdn_layout._limits")

MiB = 1 << 20

#: ``gdn-layout fixture`` in a fresh interpreter: its peak RSS less the interpreter's, the
#: command line imported.
_MEASURE = textwrap.dedent(
    """
    import json, sys

    def peak():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

    from gdn_layout.cli import main

    start = peak()
    code = main(json.loads(sys.argv[1]))
    print(json.dumps({"code": code, "peak": peak() - start}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize(
    ("dims", "flags"),
    [
        ((1, 4096, 4, 64), ["--workers", "2"]),
        ((2, 2048, 3, 16), ["--states", "1", "--per-channel"]),
    ],
)
def test_the_estimate_is_within_twice_the_peak(
    tmp_path: Path, dims: tuple[int, int, int, int], flags: list[str]
) -> None:
    layout = GdnBackwardLayout(*dims, gate_per_channel="--per-channel" in flags)
    work = {"workers": 2} if "--workers" in flags else {"states": 1}
    estimate = fixture_memory(layout, **work)  # type: ignore[arg-type]
    assert 100 * MiB <= estimate <= 600 * MiB  # above the interpreter's noise, and quick
    argv = ["fixture", *(f"-{c}{d}" for c, d in zip("BSHN", dims, strict=True)), *flags]
    argv += ["-o", str(tmp_path / "x.safetensors"), "-q"]
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["code"] == 0, done.stderr
    assert result["peak"] / 2 <= estimate <= 2 * result["peak"], (estimate, result["peak"])


# -- refusals up front -------------------------------------------------------------------------


def test_states_every_step_are_refused_when_they_cannot_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Estimated at 99 MiB for every --states, it ran out of memory under a 1.5 GiB limit after
    # 20 s: h and dh, [B, S, H, N, N] with states every step, are counted now.
    layout = GdnBackwardLayout(2, 4096, 3, 16)
    every_step = fixture_memory(layout, states=1, workers=None)
    plain = fixture_memory(layout, workers=None)
    states = 2 * layout.seq * layout.batch * layout.heads * layout.state_size**2
    assert every_step >= plain + states * (8 + 4)  # in float64, and as stored
    room = (plain + every_step) // 2
    monkeypatch.setattr(limits, "available_memory", lambda: (room, "a test's figure"))
    flags: list[str | Path] = ["-B", "2", "-S", "4096", "-H", "3", "-N", "16"]
    flags += ["-o", tmp_path / "x.safetensors"]
    assert_user_error(
        run("fixture", *flags, "--states", "1"),
        f"B=2 S=4096 H=3 N=16, per-head gate, no state, its states kept every step needs about "
        f"{human_bytes(every_step)} of memory, but {human_bytes(room)} is available "
        "(a test's figure); choose smaller dimensions or longer chunks of states",
    )
    assert not (tmp_path / "x.safetensors").exists()
    assert memory_refusal(layout, plain) is None


def test_a_huge_s_with_n_0_is_refused_for_its_per_step_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Estimated at 64 MiB, it grew past 4 GB: g and beta are [B, S, H] whatever N.
    layout = GdnBackwardLayout(2, 10**8, 3, 0)
    per_step = layout.gate_elems + layout.beta_elems
    assert fixture_memory(layout) >= per_step * (8 + 8 + 4)  # drawn, converted, stored
    monkeypatch.setattr(limits, "available_memory", lambda: (1 << 30, "a test's figure"))
    with deadline(5):
        result = run("fixture", "-N", "0", "-S", str(10**8), "-o", tmp_path / "x.safetensors")
    assert_user_error(result, "B=2 S=100000000 H=3 N=0", "needs about", "1.0 GiB is available")


def test_the_estimate_names_its_arguments() -> None:
    layout = GdnBackwardLayout(1, 4, 1, 2)
    with pytest.raises(ValueError, match=r"^fixture_memory: states must be a positive integer"):
        fixture_memory(layout, states=0)
    with pytest.raises(TypeError, match="fixture_memory"):
        fixture_memory((1, 4, 1, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="workers"):
        fixture_memory(layout, workers=0)


# -- work with no state element ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dims", "states"), [((0, 2**40, 3, 16), 1), ((2, 2**40, 0, 16), 1), ((1, 10**6, 1, 0), 3)]
)
def test_work_with_no_element_finishes_at_once(
    dims: tuple[int, int, int, int], states: int
) -> None:
    layout = GdnBackwardLayout(*dims, gate_per_channel=dims[3] > 0, carry_state=True)
    with deadline(10):
        fixture = make_fixture(layout, states=states, precisions="all")
    assert fixture.packed.shape == (layout.total_elems,)
    assert not fixture.packed.any()
    assert fixture.h is not None
    assert fixture.h.shape == (dims[0], -(-dims[1] // states), dims[2], dims[3], dims[3])


def test_the_command_line_makes_an_empty_fixture_at_once(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    with deadline(5):
        result = run("fixture", "-B", "0", "-S", str(2**40), "--states", "1", "-o", path)
    assert result.returncode == 0, result.stderr
    assert path.stat().st_size < 4096


@pytest.mark.parametrize(
    "dims", [(0, 5, 3, 16), (2, 5, 0, 16), (2, 7, 3, 0), (1, 70, 2, 0)], ids=str
)
@pytest.mark.parametrize("per_channel", [False, True])
def test_what_is_not_run_is_what_the_reference_gives(
    dims: tuple[int, int, int, int], per_channel: bool
) -> None:
    layout = GdnBackwardLayout(*dims, gate_per_channel=per_channel, carry_state=True)
    fixture = make_fixture(layout, states=4, regime="mixed", seed=5)
    x = draw_inputs(layout, regime="mixed", seed=5)
    assert x.state is not None
    q, k, v, g, beta, dy, state = (a.astype(np.float64) for a in (*x[:6], x.state))
    packed = reference.backward(q, k, v, g, beta, dy, state, method="recurrent")
    y, final = reference.forward(q, k, v, g, beta, state, method="recurrent")
    h, dh, _ = reference.chunk_states(q, k, v, g, beta, dy, state, chunk=4, method="recurrent")
    for name, expected in {
        "packed": packed,
        "y": y,
        "final_state": final,
        "h": h,
        "dh": dh,
    }.items():
        got = getattr(fixture, name)
        assert got.shape == expected.shape, name
        assert np.array_equal(got, expected.astype(np.float32)), name
    # Every form gives those zeros: no rounding to measure.
    assert fixture.floors is not None
    assert all(f == (0.0, 0.0, 0.0) for per in fixture.floors.values() for f in per.values())


# -- available memory ----------------------------------------------------------------------------


def _cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, current: int) -> None:
    """This process in a cgroup v2 tree of one group, ``/job``, of files under ``tmp_path``."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "memory.max").write_text(limit + "\n")
    (tmp_path / "job" / "memory.current").write_text(f"{current}\n")
    (tmp_path / "cgroup").write_text("0::/job\n")
    real = open

    def redirected(path: Any, *args: Any, **kwargs: Any) -> Any:
        for system, here in (("/proc/self/cgroup", "cgroup"), ("/sys/fs/cgroup", "")):
            if str(path).startswith(system):
                path = f"{tmp_path}/{here}{str(path)[len(system) :]}"
        return real(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", redirected)


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="no /proc/meminfo")
@pytest.mark.parametrize(("limit", "source"), [("1610612736", "cgroup"), ("max", "MemAvailable")])
def test_available_memory_is_within_this_process_s_cgroup_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, source: str
) -> None:
    # A container limited to 1.5 GiB on a machine with more: the limit is what is available.
    _cgroup(tmp_path, monkeypatch, limit, 100 << 20)
    found = limits.available_memory()
    assert found is not None
    assert source in found[1]
    assert found[0] == int(limit) - (100 << 20) if source == "cgroup" else found[0] > 0


def test_without_meminfo_there_is_no_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("/proc/meminfo")

    monkeypatch.setattr("builtins.open", missing)
    assert limits.available_memory() is None
    assert memory_refusal(GdnBackwardLayout(1, 1, 1, 1), 1 << 60) is None


@given(
    st.from_type(GdnBackwardLayout),
    st.sampled_from([None, 1, 3, 64]),
    st.sampled_from([np.float32, np.float64]),
    st.sampled_from([None, "all"]),
    st.sampled_from([1, 2]),
)
def test_every_layout_has_an_estimate(
    layout: GdnBackwardLayout, states: int | None, dtype: type, precisions: str | None, workers: int
) -> None:
    estimate = fixture_memory(
        layout, dtype=dtype, states=states, precisions=precisions, workers=workers
    )
    # At least the packed gradient, in float64 and as stored.
    assert estimate >= layout.total_elems * (8 + np.dtype(dtype).itemsize)

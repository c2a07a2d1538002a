"""``workers=``: the reference and fixtures spread over threads give the same bits (a suite's
processes: test_generate)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gdn_layout.generate
import gdn_layout.reference as reference
from gdn_layout import GdnBackwardLayout
from gdn_layout.cli import main
from gdn_layout.files import save_fixture
from gdn_layout.generate import draw_inputs, make_fixture, write_suite
from gdn_layout.reference import backward, chunk_states, forward

METHODS = ("chunked", "recurrent")


def _inputs(layout: GdnBackwardLayout, regime: str, seed: int) -> list[Any]:
    x = draw_inputs(layout, regime=regime, seed=seed, dtype=np.float64)
    return [x.q, x.k, x.v, x.g, x.beta, x.dy, x.state]


def _bytes(x: Any, chunk: int, **kwargs: Any) -> list[bytes]:
    """Every result of backward, forward and chunk_states, bit for bit (zeros' signs too)."""
    y = forward(*[*x[:5], x[6]], **kwargs)
    results = [backward(*x, **kwargs), *(y if isinstance(y, tuple) else (y,))]
    return [a.tobytes() for a in (*results, *chunk_states(*x, chunk=chunk, **kwargs))]


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    layout=st.from_type(GdnBackwardLayout),
    regime=st.sampled_from(gdn_layout.generate.REGIMES),
    method=st.sampled_from(METHODS),
    dtype=st.sampled_from((np.float32, np.float64)),
    workers=st.integers(2, 7),
    chunk=st.integers(1, 9),
)
def test_any_workers_give_the_same_bits(
    layout: GdnBackwardLayout, regime: str, method: str, dtype: Any, workers: int, chunk: int
) -> None:
    x = _inputs(layout, regime, seed=layout.seq)
    options = {"dtype": dtype, "method": method}
    assert _bytes(x, chunk, **options) == _bytes(x, chunk, workers=workers, **options)


def test_progress_reaches_one_from_every_thread() -> None:
    x = _inputs(GdnBackwardLayout(2, 50, 3, 8, carry_state=True), "mixed", seed=1)
    for method in METHODS:
        seen: list[float] = []
        backward(*x, method=method, progress=seen.append, workers=4)  # type: ignore[arg-type]
        assert seen == sorted(seen)
        assert seen[-1] == 1.0


def test_none_takes_every_core_this_process_may_use() -> None:
    assert reference.resolve_workers(None, "backward") == len(os.sched_getaffinity(0))
    assert reference.resolve_workers(np.int64(3), "backward") == 3


#: (value, error, what the message says it got, as a regular expression)
BAD_WORKERS = [
    (0, ValueError, "0"),
    (1.5, TypeError, r"float 1\.5"),
    (np.bool_(True), TypeError, r"bool (np\.)?True_?"),  # NumPy 1 and 2 spell it apart
    ("2", TypeError, "str '2'"),
]


@pytest.mark.parametrize(("value", "error", "message"), BAD_WORKERS)
def test_bad_workers_are_refused_naming_the_argument(
    tmp_path: Path, value: object, error: type[Exception], message: str
) -> None:
    layout = GdnBackwardLayout(1, 4, 2, 4)
    x = _inputs(layout, "mixed", seed=0)
    calls: dict[str, Callable[[], object]] = {
        "forward": lambda: forward(x[0], x[1], x[2], x[3], x[4], workers=value),  # type: ignore[call-overload]
        "backward": lambda: backward(*x, workers=value),  # type: ignore[arg-type]
        "chunk_states": lambda: chunk_states(*x, workers=value),  # type: ignore[arg-type]
        "make_fixture": lambda: make_fixture(layout, workers=value),  # type: ignore[arg-type]
        "write_suite": lambda: write_suite(tmp_path / "s", workers=value),  # type: ignore[arg-type]
    }
    for name, call in calls.items():
        expected = f"^{name}: workers must be a positive integer or None, got {message}$"
        with pytest.raises(error, match=expected):
            call()
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_fixture_files_do_not_depend_on_workers(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(2, 70, 3, 16, gate_per_channel=True, carry_state=True)
    digests = set()
    for workers in (1, 2, 5, None):
        fixture = make_fixture(layout, regime="qwen", seed=4, states=16, workers=workers)
        path = save_fixture(tmp_path / f"w{workers}.safetensors", fixture)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1


def test_the_command_line_takes_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["fixture", "-B", "1", "-S", "30", "-H", "3", "-N", "8", "--carry-state", "-q"]
    for workers in ("1", "3"):
        assert (
            main([*flags, "--workers", workers, "-o", str(tmp_path / f"{workers}.safetensors")])
            == 0
        )
    assert main([*flags, "-o", str(tmp_path / "all.safetensors")]) == 0  # every core
    files = {p.read_bytes() for p in tmp_path.iterdir()}
    assert len(files) == 1
    capsys.readouterr()
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(SystemExit) as exit_:
            main([*flags, "--workers", bad, "-o", str(tmp_path / "bad.safetensors")])
        assert exit_.value.code == 2
        assert f"argument --workers: expected a positive integer, got '{bad}'" in (
            capsys.readouterr().err
        )

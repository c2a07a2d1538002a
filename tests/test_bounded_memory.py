"""``compare`` and ``inspect`` in bounded memory: peak RSS at most the mapped size of the files
plus 256 MiB, measured in a fresh process, for a large N and for a B=0 file of huge S and H."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gdn_layout import GdnBackwardLayout, make_fixture, unpack
from gdn_layout.check import compare
from gdn_layout.files import Fixture, save_fixture

MiB = 1 << 20
#: The documented bound: the files' mapped size plus this.
ALLOWANCE = 256 * MiB

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="peak RSS is read from /proc/self/status"
)

_MEASURE = textwrap.dedent(
    """
    import json, sys
    from gdn_layout.cli import main

    code = main(json.loads(sys.argv[1]))
    status = open("/proc/self/status").read()
    peak = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    print("PEAK", int(peak.split()[1]) * 1024, "EXIT", code, file=sys.stderr)
    """
)


def _peak_rss(*argv: str) -> tuple[int, int, str]:
    """Run the CLI with ``argv`` in a fresh interpreter: peak RSS in bytes, exit code, stdout."""
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(list(argv))],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    words = done.stderr.split()
    assert "PEAK" in words, done.stderr
    return int(words[words.index("PEAK") + 1]), int(words[words.index("EXIT") + 1]), done.stdout


def _sparse(path: Path, nbytes: int) -> Path:
    with open(path, "wb") as file:
        file.truncate(nbytes)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [False, True], ids=["passing", "failing"])
def test_a_large_state_is_compared_in_bounded_memory(tmp_path: Path, wrong: bool) -> None:
    # dstate is [1, 1, N, N]: one of its rows is N * N = 16.8 M elements, 128 MiB in float64,
    # which a row-by-row comparison converts at once, several times over. With one element
    # wrong, the explanations (the scan for unwritten and non-finite values, the cause maps)
    # read it in pieces too.
    n = 4096
    layout = GdnBackwardLayout(1, 1, 1, n, carry_state=True)
    nbytes = layout.nbytes(np.float32)
    if shutil.disk_usage(tmp_path).free < 4 * nbytes:
        pytest.skip("not enough disk space for two files")
    actual = _sparse(tmp_path / "actual.bin", nbytes)
    expected = _sparse(tmp_path / "expected.bin", nbytes)
    if wrong:  # dstate[0, 0, 5, 7] = 1
        with open(actual, "r+b") as file:
            file.seek(4 * (layout.segment("dstate").offset + 5 * n + 7))
            file.write(np.float32(1.0).tobytes())
    flags = ["--dtype", "float32", "-B", "1", "-S", "1", "-H", "1", "-N", str(n), "--carry-state"]
    peak, code, _ = _peak_rss("compare", str(actual), str(expected), *flags)
    assert code == (1 if wrong else 0)
    assert peak <= 2 * nbytes + ALLOWANCE, f"peak RSS {peak / MiB:.0f} MiB"


@pytest.mark.slow
def test_a_tiny_file_of_huge_dimensions_is_compared_in_bounded_memory(tmp_path: Path) -> None:
    # B=0: no element at all, yet an unbinned S x H error map would be 32 PiB of float64.
    layout = GdnBackwardLayout(0, 2**32, 2**20, 16, carry_state=True)
    names = ["q", "k", "v", "g", "beta", "dy", "y", "state"]
    arrays: dict[str, Any] = {n: np.zeros(layout.input_shape(n), np.float32) for n in names}
    empty = Fixture(**arrays, packed=np.zeros(0, np.float32))
    path = save_fixture(tmp_path / "empty.safetensors", empty)
    assert path.stat().st_size < 4096
    for argv in (("compare", str(path), str(path)), ("inspect", str(path))):
        peak, code, _ = _peak_rss(*argv)
        assert code == 0
        assert peak <= ALLOWANCE, f"peak RSS {peak / MiB:.0f} MiB"


def test_a_huge_error_map_is_binned() -> None:
    layout = GdnBackwardLayout(0, 2**32, 2**20, 16, carry_state=True)
    empty = np.zeros(0, np.float32)
    result = compare(empty, empty, layout)
    assert result.passed
    assert result["dq"].error_map.shape == (1024, 1024)
    assert result["dq"].error_map_bins == (2**22, 2**10)
    assert result["dstate"].error_map.shape == (16, 2**16)  # [N, H]: H binned by 16
    assert result["dstate"].error_map_bins == (1, 16)


def test_a_binned_map_keeps_the_largest_error_of_each_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.import_module("gdn_layout.check._compare"), "MAP_CELLS", 64)
    # S * H = 128 cells, twice the limit: positions are binned in pairs along s.
    layout = GdnBackwardLayout(1, 16, 8, 1)
    expected = np.zeros(layout.total_elems, np.float32)
    actual = expected.copy()
    dbeta = unpack(actual, layout).dbeta[0]
    dbeta[5, 7] = 3.0
    dbeta[4, 7] = 2.0
    dbeta[11, 0] = np.nan
    grad = compare(actual, expected, layout)["dbeta"]
    assert grad.error_map_bins == (2, 1)
    assert grad.error_map.shape == (8, 8)
    assert grad.error_map[2, 7] == 3.0
    assert grad.error_map[5, 0] == np.inf
    assert np.count_nonzero(grad.error_map) == 2


@pytest.mark.slow
def test_a_misreading_is_named_within_the_bound_of_a_passing_compare(tmp_path: Path) -> None:
    # A failing compare re-runs the op under each reading on a slice of the case: its peak
    # stays within the files' size plus the allowance, as a passing compare's does.
    from gdn_layout.check._misreadings import BUDGET
    from gdn_layout.reference import backward

    layout = GdnBackwardLayout(2, 2048, 8, 128, carry_state=True)
    assert layout.batch * layout.seq * layout.heads * layout.state_size**2 > 4 * BUDGET
    fixture = make_fixture(layout, regime="mixed")
    path = save_fixture(tmp_path / "case.safetensors", fixture)
    q, k, v, g, beta, dy, state = fixture.inputs
    assert state is not None
    misread = backward(q, k, v, g, beta, dy, state.swapaxes(-1, -2), dtype=np.float32)
    np.save(tmp_path / "kernel.npy", misread)
    files = path.stat().st_size + (tmp_path / "kernel.npy").stat().st_size
    passing, code, _ = _peak_rss("compare", str(path), str(path))
    assert code == 0
    failing, code, printed = _peak_rss("compare", str(tmp_path / "kernel.npy"), str(path))
    assert code == 1
    assert "initial state read transposed" in printed, printed
    assert failing <= files + ALLOWANCE, (failing / MiB, files / MiB)
    assert passing <= files + ALLOWANCE, (passing / MiB, files / MiB)

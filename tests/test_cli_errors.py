"""The command line tells the user's errors (one line, exit 2) from its own bugs (a traceback,
exit 1), and refuses up front a run that cannot fit in memory."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gdn_layout.cli
from gdn_layout.cli import main
from support import run

limits = importlib.import_module("gdn_layout._limits")


def assert_user_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit 2, one line on stderr that says what is wrong, and no traceback."""
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr


def test_huge_dimensions_are_refused_up_front(tmp_path: Path) -> None:
    # Made and then refused for want of memory after 42 s; now refused before any work.
    start = time.perf_counter()
    result = run("fixture", "-S", "10000000", "-o", tmp_path / "x.safetensors")
    assert time.perf_counter() - start < 2.0
    assert_user_error(result, "B=2 S=10000000 H=3 N=16, per-head gate, no state needs about ")
    assert re.search(
        r"needs about [\d.]+ GiB of memory, but [\d.]+ \w+ is available", result.stderr
    )
    assert list(tmp_path.iterdir()) == []


def test_the_estimate_is_checked_against_what_is_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "available_memory", lambda: (1000, "a test's figure"))
    assert_user_error(
        run("fixture", "-S", "4", "-o", tmp_path / "x.safetensors"),
        "of memory, but 1000 B is available (a test's figure)",
    )
    assert_user_error(run("demo", "-S", "4"), "but 1000 B is available")
    # A system that does not say how much is available runs anything.
    monkeypatch.setattr(limits, "available_memory", lambda: None)
    assert run("fixture", "-S", "4", "-o", tmp_path / "x.safetensors").returncode == 0


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="no /proc/meminfo")
def test_available_memory_reads_meminfo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "cgroup_memory", lambda: None)
    monkeypatch.setattr(limits, "address_space_memory", lambda: None)
    found = limits.available_memory()
    assert found is not None
    assert found[0] > 0
    assert found[1] == "MemAvailable in /proc/meminfo"


def test_available_memory_falls_back_without_meminfo(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("/proc/meminfo")

    monkeypatch.setattr(limits, "cgroup_memory", lambda: None)
    monkeypatch.setattr(limits, "address_space_memory", lambda: None)
    monkeypatch.setattr("builtins.open", missing)
    found = limits.available_memory()
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        assert found is not None
        assert found[1] == "free physical memory"
    else:
        assert found is None


def test_a_bug_shows_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> str:
        raise TypeError("a bug inside the library")

    monkeypatch.setattr(gdn_layout.cli, "layout_text", broken)
    with pytest.raises(TypeError, match="a bug inside the library"):
        main(["describe"])


@pytest.mark.slow
def test_a_bug_exits_1_with_a_traceback_from_the_entry_point() -> None:
    script = textwrap.dedent(
        """
        import sys
        import gdn_layout.cli as cli

        def broken(*args):
            raise ValueError("a bug inside the library")

        cli.layout_text = broken
        sys.argv = ["gdn-layout", "describe"]
        sys.exit(cli.main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "Traceback" in done.stderr
    assert "ValueError: a bug inside the library" in done.stderr


def test_flags_whose_arrays_cannot_exist_are_a_user_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    flags = ["--dtype", "float32", "-B", "0", "-S", str(2**40), "-H", str(2**40), "-N", "2"]
    assert_user_error(run("inspect", empty, *flags), "which no array can have")


def test_bad_tolerances_are_user_errors(tmp_path: Path) -> None:
    raw = tmp_path / "zeros.bin"
    raw.write_bytes(b"\0" * 4 * 6)
    flags = ["--dtype", "float32", "-B", "1", "-S", "1", "-H", "1", "-N", "1"]
    for tolerance, message in [
        ("-1", "expected numbers >= 0 and < inf, for gradients among dq, dk"),
        ("inf", "expected numbers >= 0 and < inf"),
        ("dz=1e-3", "for gradients among dq, dk, dv, dg, dbeta, dstate, got 'dz=1e-3'"),
    ]:
        assert_user_error(run("compare", raw, raw, *flags, "--rtol", tolerance), message)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_a_user_error(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    assert_user_error(run("inspect", fifo), f"{fifo}: not a regular file: it is a FIFO")

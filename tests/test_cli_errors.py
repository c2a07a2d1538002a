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
from support import assert_user_error, run

limits = importlib.import_module("gdn_layout._limits")


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
    raw.write_bytes(b"\0" * 4 * 5)
    flags = ["--dtype", "float32", "-B", "1", "-S", "1", "-H", "1", "-N", "1"]
    # Judged by compare(), its messages naming the flag.
    for tolerance, message in [
        ("-1", "error: --rtol must be a finite float >= 0, got -1.0"),
        ("inf", "error: --rtol must be a finite float >= 0, got inf"),
        ("dq=nan", "error: --rtol['dq'] must be a finite float >= 0, got nan"),
        (
            "dz=1e-3",
            "error: --rtol has unknown gradient names ['dz']; "
            "expected names among dq, dk, dv, dg, dbeta, dstate",
        ),
    ]:
        assert_user_error(run("compare", raw, raw, *flags, "--rtol", tolerance), message)


def test_the_librarys_refusals_name_the_flag(tmp_path: Path) -> None:
    too_big = str(2**64)
    assert_user_error(
        run("describe", "-N", too_big),
        f"error: --state-size must fit in a 64-bit usize, got {too_big}",
    )
    states = ["--states", str(10**20), "-o", str(tmp_path / "x.safetensors")]
    assert_user_error(
        run("fixture", "-S", "4", *states), "error: --states must be an integer from 1"
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_a_user_error(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    assert_user_error(run("inspect", fifo), f"{fifo}: not a regular file: it is a FIFO")

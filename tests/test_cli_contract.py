"""The command line's contract at its edges: hostile manifests, file names no encoding can
print, headers that claim impossible shapes, a closed stderr, memory limits other than
``MemAvailable`` (cgroups, ``RLIMIT_AS``), a ``SIGTERM`` mid-run and an existing ``--plot``
file all end in one line and exit status 2 (or, for SIGTERM, 143 with nothing left behind)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import gdn_layout.plot
from gdn_layout.cli import main

limits = importlib.import_module("gdn_layout._limits")

SRC = Path(__file__).resolve().parents[1] / "src"


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``gdn-layout ARGS`` in this process, with its output captured."""
    argv = [str(arg) for arg in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_process(
    *args: str | bytes | Path, env: dict[str, str] | None = None, close_stderr: bool = False
) -> subprocess.CompletedProcess[bytes]:
    """``python -m gdn_layout ARGS`` in a subprocess (with fd 2 closed: ``2>&-``)."""
    argv: list[str | bytes | Path] = [sys.executable, "-m", "gdn_layout", *args]
    if close_stderr:
        argv = ["sh", "-c", 'exec "$0" "$@" 2>&-', *argv]
    return subprocess.run(
        argv,
        capture_output=not close_stderr,
        stdout=subprocess.PIPE if close_stderr else None,
        env={**os.environ, **(env or {})},
        timeout=300,
        check=False,
    )


def assert_user_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 2, one line on stderr that says what is wrong, and no traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


@pytest.fixture(scope="module")
def fixture_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fx") / "case.safetensors"
    assert run("fixture", "-B", "1", "-S", "5", "-H", "2", "-N", "4", "-o", path).returncode == 0
    return path


# -- 1c: a .npy header that claims more elements than any array can have ------------------------


@pytest.mark.parametrize("shape", [(2**64,), (2**32, 2**32), (2**62,)])
@pytest.mark.parametrize("command", ["inspect", "compare"])
def test_npy_header_claiming_an_impossible_shape_is_a_user_error(
    tmp_path: Path, shape: tuple[int, ...], command: str
) -> None:
    path = tmp_path / "huge.npy"
    with open(path, "wb") as file:
        header = {"descr": "<f4", "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(file, header)  # type: ignore[no-untyped-call]
    args = [path, path] if command == "compare" else [path]
    result = run(command, *args, "-B", "1", "-S", "1", "-H", "1", "-N", "1")
    assert_user_error(result, str(path), f"shape {shape}", "float32")


def test_npy_header_warnings_do_not_add_lines(tmp_path: Path) -> None:
    path = tmp_path / "huge.npy"
    with open(path, "wb") as file:
        header = {"descr": "<f4", "fortran_order": False, "shape": (2**32, 2**32)}
        np.lib.format.write_array_header_1_0(file, header)  # type: ignore[no-untyped-call]
    done = run_process("inspect", path)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr



"""The command line's contract at its edges: hostile manifests, file names no encoding can
print, headers that claim impossible shapes, a closed stderr, a layout beyond memory, a
``SIGTERM`` mid-run and an existing ``--plot`` file all end in one line and exit status 2 (or,
for SIGTERM, 143 with nothing left behind)."""

from __future__ import annotations

import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np
import pytest

import gdn_layout.plot
from support import assert_user_error, run


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


@pytest.fixture(scope="module")
def fixture_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fx") / "case.safetensors"
    assert run("fixture", "-B", "1", "-S", "5", "-H", "2", "-N", "4", "-o", path).returncode == 0
    return path


# -- 1a: a manifest holding an integer of more digits than Python converts ---------------------


def _suite_with_huge_integer(root: Path, fixture_path: Path) -> Path:
    root.mkdir()
    shutil.copy(fixture_path, root / "case.safetensors")
    huge = "9" * 5000
    (root / "manifest.json").write_text(
        '{"fixtures": [{"file": "case.safetensors", "sha256": "0", "bytes": ' + huge + "}]}"
    )
    return root


def test_verify_refuses_a_manifest_with_a_5000_digit_integer(
    tmp_path: Path, fixture_path: Path
) -> None:
    root = _suite_with_huge_integer(tmp_path / "suite", fixture_path)
    assert_user_error(run("verify", root), "manifest.json is not JSON", "digits")


def test_verify_counts_the_fixtures_through_the_suite_module(
    tmp_path: Path, fixture_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The count does not come from a second json.loads of its own: a manifest that changed
    # after the check is reported by the suite module, in one line.
    root = _suite_with_huge_integer(tmp_path / "suite", fixture_path)
    monkeypatch.setattr(
        importlib.import_module("gdn_layout.cli"), "verify_suite", lambda d, **selection: []
    )
    assert_user_error(run("verify", root), "manifest.json is not JSON", "digits")
    manifest = {"format": "gdn-layout-fixture-suite", "fixtures": [{"file": "a", "sha256": "0"}]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert run("verify", root).stdout == f"{root}: 1 fixtures match manifest.json\n"


def test_plugin_refuses_a_manifest_with_a_5000_digit_integer(
    tmp_path: Path, fixture_path: Path, pytester: pytest.Pytester
) -> None:
    root = _suite_with_huge_integer(tmp_path / "suite", fixture_path)
    pytester.makepyfile(test_kernel="def test_one(gdn_case):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-suite", str(root))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["*gdn-layout: *manifest.json is not JSON*digits*"])


# -- 1b: names that the output's encoding cannot print ------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="bytes file names are POSIX's")
@pytest.mark.parametrize("encoding", ["ascii:strict", "utf-8:strict"])
def test_names_that_cannot_be_encoded_are_printed_escaped(
    tmp_path: Path, fixture_path: Path, encoding: str
) -> None:
    undecodable = os.path.join(os.fsencode(tmp_path), b"\xff.safetensors")
    with open(undecodable, "wb") as file:
        file.write(fixture_path.read_bytes())
    env = {"PYTHONIOENCODING": encoding}
    done = run_process("inspect", undecodable, env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"\\udcff.safetensors: fixture, float32" in done.stdout
    # The same name in an error message: one line on stderr, exit 2.
    missing = os.path.join(os.fsencode(tmp_path), b"nope-\xff.npy")
    done = run_process("inspect", missing, env=env)
    assert done.returncode == 2, done.stderr
    assert b"Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert b"\\udcff" in done.stderr
    assert b"no such file" in done.stderr
    # A name that is valid UTF-8 but not ASCII.
    accented = tmp_path / "caf\u00e9.safetensors"
    shutil.copy(fixture_path, accented)
    done = run_process("inspect", accented, env=env)
    assert done.returncode == 0, done.stderr
    expected = "caf\\xe9" if encoding.startswith("ascii") else "caf\u00e9"
    assert f"{expected}.safetensors: fixture".encode() in done.stdout


# -- 1c: a .npy header that claims more elements than any array can have ------------------------


@pytest.mark.parametrize("shape", [(2**64,), (2**32, 2**32), (2**62,)])
@pytest.mark.parametrize("command", ["inspect", "compare"])
def test_npy_header_claiming_an_impossible_shape_is_a_user_error(
    tmp_path: Path, shape: tuple[int, ...], command: str
) -> None:
    path = tmp_path / "huge.npy"
    with open(path, "wb") as file:
        header = {"descr": "<f4", "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(file, header)
    args = [path, path] if command == "compare" else [path]
    result = run(command, *args, "-B", "1", "-S", "1", "-H", "1", "-N", "1")
    assert_user_error(result, str(path), f"shape {shape}", "float32")


@pytest.mark.slow
def test_npy_header_warnings_do_not_add_lines(tmp_path: Path) -> None:
    path = tmp_path / "huge.npy"
    with open(path, "wb") as file:
        header = {"descr": "<f4", "fortran_order": False, "shape": (2**32, 2**32)}
        np.lib.format.write_array_header_1_0(file, header)
    done = run_process("inspect", path)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# -- 1d: stderr closed --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_a_closed_stderr_disables_progress_and_keeps_the_exit_status(tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    done = run_process("fixture", "-S", "4", "-o", out, close_stderr=True)
    assert done.returncode == 0
    assert out.is_file()
    assert done.stdout.startswith(f"wrote {out}".encode())
    done = run_process("demo", "-S", "4", close_stderr=True)
    assert done.returncode == 0
    # An error has nowhere to go, and does not go to stdout; the status still says it.
    done = run_process("inspect", tmp_path / "nowhere.npy", close_stderr=True)
    assert (done.returncode, done.stdout) == (2, b"")
    done = run_process("describe", "--seq", "x", close_stderr=True)
    assert (done.returncode, done.stdout) == (2, b"")


def test_progress_survives_a_stderr_that_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from gdn_layout._progress import Progress, stderr_is_terminal

    monkeypatch.setattr(sys, "stderr", None)
    assert stderr_is_terminal() is False
    bar = Progress(enabled=True)
    bar.update(0.5)
    bar.done()

    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(sys, "stderr", Broken())
    bar = Progress(enabled=True)
    bar.update(0.5)
    assert not bar.enabled
    bar.done()


# -- 3: the plugin refuses a layout beyond memory ----------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("64,100000,64,128", "*gdn-layout: B=64 S=100000 H=64 N=128*needs about*available*"),
        ("0,1099511627776,1099511627776,2", "*which no array can have*"),
    ],
)
def test_plugin_refuses_a_layout_beyond_memory(
    pytester: pytest.Pytester, spec: str, message: str
) -> None:
    pytester.makepyfile(test_kernel="def test_one(gdn_case):\n    pass\n")
    start = time.perf_counter()
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-layout", spec)
    assert time.perf_counter() - start < 20
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines([message])
    assert len([line for line in result.stderr.lines if "gdn-layout" in line]) == 1


def test_plugin_turns_memory_error_into_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suites = importlib.import_module("gdn_layout.suites")

    def exhausted(*args: object, **kwargs: object) -> None:
        raise MemoryError("Unable to allocate 1.00 TiB")

    monkeypatch.setattr(suites, "make_case", exhausted)
    pytester.makepyfile(test_kernel="def test_one(gdn_case):\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--gdn-layout", "1,4,1,2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["*gdn-layout: out of memory: Unable to allocate 1.00 TiB*"])


# -- 4: SIGTERM cleans up the demo's temporary folder -------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX")
def test_sigterm_during_demo_removes_its_temporary_folder(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gdn_layout",
            "demo",
            *("-B", "2", "-S", "4096", "-H", "8", "-N", "64"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(tmp.iterdir()) and time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            time.sleep(0.05)
        assert any(tmp.iterdir()), "the demo made no temporary folder"
        time.sleep(0.3)  # well into the work
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 128 + signal.SIGTERM, process.stderr.read() if process.stderr else ""
    assert list(tmp.iterdir()) == []


def test_main_restores_the_sigterm_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert run("describe", "-S", "2").returncode == 0
    assert signal.getsignal(signal.SIGTERM) is before


# -- 5: --plot does not replace a file unless told to -------------------------------------------


def test_compare_plot_refuses_an_existing_file_without_force(
    fixture_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "errors.png"
    png.write_bytes(b"precious")
    drawn: list[object] = []
    monkeypatch.setattr(
        gdn_layout.plot, "plot_errors", lambda result, path, chunk=None: drawn.append(path)
    )
    result = run("compare", fixture_path, fixture_path, "--plot", png)
    assert_user_error(result, str(png), "exists", "--force")
    assert result.stdout == "", "refused before the work"
    assert (png.read_bytes(), drawn) == (b"precious", [])
    result = run("compare", fixture_path, fixture_path, "--plot", png, "--force")
    assert result.returncode == 0, result.stderr
    assert drawn == [str(png)]


@pytest.mark.slow
def test_plot_errors_writes_its_file_atomically(
    fixture_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    files = importlib.import_module("gdn_layout.files._atomic")
    written: list[Path] = []
    real: Callable[..., Path] = files.atomic_write

    def spy(path: Path, write: Callable[[IO[bytes]], None], *, overwrite: bool) -> Path:
        written.append(path)
        return real(path, write, overwrite=overwrite)

    monkeypatch.setattr(files, "atomic_write", spy)
    png = tmp_path / "errors.png"
    png.write_bytes(b"old")
    result = run("compare", fixture_path, fixture_path, "--plot", png, "--force")
    assert result.returncode == 0, result.stderr
    assert written == [png]
    assert png.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["errors.png"]

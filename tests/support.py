"""Helpers the test modules share: the dtypes and modes of fixtures and a bitwise comparison, a
deadline for code that may hang, the command line run in this process and what a user error
looks like, and folders that pytest-xdist's workers make once for all of them."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout.cli import main
from gdn_layout.files import Fixture

__all__ = [
    "DTYPES",
    "FLAGS",
    "DeviceArray",
    "Hung",
    "Suite",
    "assert_same_fixture",
    "assert_user_error",
    "deadline",
    "dtype_id",
    "run",
    "same_bits",
    "shared_folder",
    "suite_with_huge_integer",
]

#: Every dtype a fixture holds, and every (gate_per_channel, carry_state) of a layout.
DTYPES = [
    np.dtype(np.float64),
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
]
FLAGS = [(False, False), (True, False), (False, True), (True, True)]

#: The ``suite`` fixture's value (conftest.py): the standard suite's folder and its fixture
#: paths.
Suite = tuple[Path, list[Path]]


class DeviceArray:
    """An array of another library in a device's memory, as DLPack describes it: its
    ``__dlpack_device__`` is ``device`` (CUDA's ``(2, 0)`` unless told), and its ``__dlpack__``
    honours only the request for a copy in host memory (``dl_device=(kDLCPU, 0),
    copy=True``), each one a new copy of ``host`` recorded in ``copies``. It has no
    ``__array__``: a reader gets its values by that request or not at all.
    ``honour=False`` refuses that request too. On a device of host memory (CUDA's pinned
    memory, ``(3, 0)``), ``host`` itself is exported to a reader that asks for no copy."""

    def __init__(
        self, host: NDArray[Any], device: tuple[int, int] = (2, 0), *, honour: bool = True
    ) -> None:
        self.host, self.kind, self.honour = host, device, honour
        self.copies: list[NDArray[Any]] = []
        self.dtype, self.device = host.dtype, f"device{device}"

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.kind

    def __dlpack__(
        self,
        *,
        stream: object = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> object:
        if self.kind[0] == 3 and dl_device is None and not copy:
            return self.host.__dlpack__()
        if not self.honour or dl_device != (1, 0) or copy is not True:
            raise BufferError(f"cannot export from {self.kind} with {dl_device=}, {copy=}")
        self.copies.append(self.host.copy())
        versioned: dict[str, Any] = {} if max_version is None else {"max_version": max_version}
        return self.copies[-1].__dlpack__(**versioned)


class Hung(Exception):
    """Still running at the deadline (not an OSError, which the code under test may catch)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: an alarm interrupts even a blocking open()."""

    def expire(signum: int, frame: object) -> None:
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Terminal(io.StringIO):
    """A captured stream that says it is a terminal, as an interactive shell's stderr is."""

    def isatty(self) -> bool:
        return True


def run(
    *args: str | Path, cwd: Path | None = None, terminal: bool = False
) -> subprocess.CompletedProcess[str]:
    """``gdn-layout ARGS`` in this process (in ``cwd``), with its output captured; with
    ``terminal``, stderr says it is a terminal."""
    argv = [str(arg) for arg in args]
    out, err = io.StringIO(), _Terminal() if terminal else io.StringIO()
    with contextlib.ExitStack() as stack:
        if cwd is not None:
            stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's usage errors and --help
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def assert_user_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 2, one line on stderr that says what is wrong (each of ``words``), no traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def shared_folder(
    factory: pytest.TempPathFactory, name: str, make: Callable[[Path], list[Path]]
) -> list[Path]:
    """``make(folder)``'s files, made once per test session: under pytest-xdist, by the first
    worker that asks, in the session's own temporary folder, while the others wait for it
    (an exclusive lock), then read its list; without workers, in this process's folder.

    The files are shared: a test that changes them works on a copy."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(factory.mktemp(name))
    session = factory.getbasetemp().parent  # one per session, above every worker's
    folder, listed = session / name, session / f"{name}.json"
    with open(session / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not listed.exists():
            paths = make(folder)
            listed.write_text(json.dumps([str(path) for path in paths]))
    return [Path(path) for path in json.loads(listed.read_text())]


def suite_with_huge_integer(root: Path, fixture_path: Path) -> Path:
    """A suite folder at ``root`` (made here): a copy of ``fixture_path`` and a manifest whose
    integer has 5000 digits, more than Python converts to an int by default."""
    root.mkdir()
    shutil.copy(fixture_path, root / "case.safetensors")
    huge = "9" * 5000
    (root / "manifest.json").write_text(
        '{"fixtures": [{"file": "case.safetensors", "sha256": "0", "bytes": ' + huge + "}]}"
    )
    return root


def dtype_id(dtype: np.dtype[Any]) -> str:
    return dtype.name


def _bits(a: NDArray[Any]) -> NDArray[Any]:
    # Bitwise comparison: works for bfloat16 and tells -0.0 from 0.0.
    return np.ascontiguousarray(a).view(np.uint8)


def same_bits(a: NDArray[Any] | None, b: NDArray[Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def assert_same_fixture(a: Fixture, b: Fixture) -> None:
    assert a.layout == b.layout
    for name in ("q", "k", "v", "g", "beta", "state", "dy", "y", "packed"):
        assert same_bits(getattr(a, name), getattr(b, name)), name
    assert (a.regime, a.seed, a.compute_dtype) == (b.regime, b.seed, b.compute_dtype)


def on_a_terminal(argv: list[str], cwd: Path, *, stdout: bool = True) -> tuple[int, str]:
    """Run ``argv`` with stderr (and ``stdout``, unless False) on a pseudo-terminal, as in an
    interactive shell: its exit code and what the terminal showed."""
    import pty

    leader, follower = pty.openpty()
    out = follower if stdout else subprocess.DEVNULL
    with subprocess.Popen(argv, stdout=out, stderr=follower, cwd=cwd) as process:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = process.wait(timeout=300)
    os.close(leader)
    return code, b"".join(chunks).decode()

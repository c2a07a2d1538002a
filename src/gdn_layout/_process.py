"""The command line's process: error lines on a stderr that may be gone, output that escapes
what its encoding cannot write, and SIGTERM turned into an exception so that cleanup runs."""

from __future__ import annotations

import contextlib
import io
import signal
import sys
from collections.abc import Iterator

__all__ = ["escaping_output", "report", "sigterm_as_exit"]


def report(line: str) -> None:
    """Print an error line on stderr; with no stderr to print on (``2>&-``), say nothing: the
    exit status still tells."""
    if sys.stderr is not None:
        with contextlib.suppress(OSError, ValueError):
            print(line, file=sys.stderr)


@contextlib.contextmanager
def escaping_output() -> Iterator[None]:
    """For the run, stdout and stderr escape what their encoding cannot write (a file name
    that is not UTF-8, or not ASCII on an ASCII stream) instead of raising."""
    restore: list[tuple[io.TextIOWrapper, str]] = []
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            with contextlib.suppress(OSError, ValueError):
                stream.reconfigure(errors="backslashreplace")
                restore.append((stream, "strict"))
    try:
        yield
    finally:
        for stream, errors in restore:
            with contextlib.suppress(OSError, ValueError):
                stream.reconfigure(errors=errors)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """For the run, SIGTERM raises SystemExit(143), so that ``with`` blocks clean up (the
    demo's temporary folder) before the process ends; the previous handler is restored."""

    def terminate(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_IGN)  # the cleanup is not interrupted in turn
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except (AttributeError, ValueError, OSError):  # no SIGTERM here, or not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

"""Helpers the test modules share: a deadline for code that may hang, and the command line
run in this process."""

from __future__ import annotations

import contextlib
import io
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from gdn_layout.cli import main

__all__ = ["Hung", "deadline", "run"]


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

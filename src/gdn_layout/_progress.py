"""Progress on stderr: a bar redrawn in place on a terminal, plain lines in a log."""

from __future__ import annotations

import sys
import time
from typing import Final

__all__ = ["LINE_STEP", "Progress", "stderr_is_terminal"]

#: Off a terminal, a line at every tenth of the work, and at least this often (seconds).
LINE_STEP: Final = 0.1
LINE_SECONDS: Final = 10.0


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal; False with no stderr (``2>&-``) or one that cannot say."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (OSError, ValueError):  # a closed file, or one whose descriptor went away
        return False


class Progress:
    """Progress on stderr: a bar redrawn in place, or with ``lines`` (a log) a line at every
    :data:`LINE_STEP` of the work and at least every :data:`LINE_SECONDS`. Silent unless
    ``enabled``, and once stderr is gone or cannot be written.

    >>> import contextlib, io
    >>> log = io.StringIO()
    >>> with contextlib.redirect_stderr(log):
    ...     progress = Progress(enabled=True, label="suite", lines=True)
    ...     for i in range(1, 21):
    ...         progress.update(i / 20)
    ...     progress.done()
    >>> log.getvalue().splitlines()[:2], len(log.getvalue().splitlines())
    (['suite: 10% (0 s)', 'suite: 20% (0 s)'], 10)
    """

    def __init__(self, *, enabled: bool, label: str = "reference backward", lines: bool = False):
        self.enabled, self.label, self.lines = enabled, label, lines
        self._start = time.monotonic()
        self._said = (0.0, self._start)  # the fraction and the time of the last line

    def update(self, fraction: float) -> None:
        if not self.lines:
            bar = "#" * round(30 * fraction)
            self._write(f"\r{self.label} [{bar:.<30}] {100 * fraction:3.0f}%")
            return
        said, when = self._said
        now = time.monotonic()
        # A tenth reached (to a rounding of the fraction's), or a while without a line.
        step = int(fraction / LINE_STEP + 1e-9) > int(said / LINE_STEP + 1e-9)
        if fraction > said and (step or now - when >= LINE_SECONDS):
            self._said = (fraction, now)
            self._write(f"{self.label}: {100 * fraction:.0f}% ({now - self._start:.0f} s)\n")

    def done(self) -> None:
        if not self.lines:
            self._write("\r\x1b[K")

    def _write(self, text: str) -> None:
        if not self.enabled:
            return
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):  # no stderr, or it cannot be written
            self.enabled = False

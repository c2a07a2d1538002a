"""A progress bar for the command line."""

from __future__ import annotations

import sys

__all__ = ["Progress", "stderr_is_terminal"]


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal; False when there is no stderr (``2>&-``) or it cannot
    say."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (OSError, ValueError):  # a closed file, or one whose descriptor went away
        return False


class Progress:
    """A progress bar on stderr, redrawn in place; silent when not enabled, and it goes silent
    when stderr is gone or cannot be written."""

    def __init__(self, *, enabled: bool, label: str = "reference backward") -> None:
        self.enabled = enabled
        self.label = label

    def update(self, fraction: float) -> None:
        if self.enabled:
            filled = round(30 * fraction)
            bar = "#" * filled + "." * (30 - filled)
            self._write(f"\r{self.label} [{bar}] {100 * fraction:3.0f}%")

    def done(self) -> None:
        if self.enabled:
            self._write("\r\x1b[K")

    def _write(self, text: str) -> None:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):  # no stderr, or it cannot be written
            self.enabled = False

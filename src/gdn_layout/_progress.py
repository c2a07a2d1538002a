"""A progress bar for the command line."""

from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    """A progress bar on stderr, redrawn in place; silent when not enabled."""

    def __init__(self, *, enabled: bool, label: str = "reference backward") -> None:
        self.enabled = enabled
        self.label = label

    def update(self, fraction: float) -> None:
        if self.enabled:
            filled = round(30 * fraction)
            bar = "#" * filled + "." * (30 - filled)
            sys.stderr.write(f"\r{self.label} [{bar}] {100 * fraction:3.0f}%")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()

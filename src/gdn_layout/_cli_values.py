"""Values of the command line: argument types, a progress bar, byte counts."""

from __future__ import annotations

import argparse
import sys

from ._dtypes import SPELLINGS, canonical_name

__all__ = ["Progress", "dimension", "dtype_name", "human", "tolerance"]


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


def human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def tolerance(text: str) -> float | dict[str, float]:
    try:
        if "=" not in text:
            return float(text)
        pairs = [item.split("=", 1) for item in text.split(",")]
        named = {name.strip(): float(value) for name, value in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or NAME=NUMBER pairs like dq=1e-3,dg=2e-3, got {text!r}"
        ) from None
    if len(named) != len(pairs):
        raise argparse.ArgumentTypeError(f"a gradient is named twice in {text!r}")
    return named


def dtype_name(text: str) -> str:
    """A floating dtype in any common spelling (``bf16``, ``F32``, ``half``, ...), as its NumPy
    name."""
    name = canonical_name(text)
    if name is None:
        spellings = "; ".join("/".join(aliases) for aliases in SPELLINGS.values())
        raise argparse.ArgumentTypeError(
            f"expected a floating dtype ({spellings}, in any case), got {text!r}"
        )
    return name


def dimension(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value

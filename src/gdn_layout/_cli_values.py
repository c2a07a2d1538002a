"""The command line's argument types (tolerances, dtype names, counts), which the pytest
plugin's options share."""

from __future__ import annotations

import argparse

from ._checks import integer_words
from ._dtypes import PRECISIONS, SPELLINGS, canonical_name, precision_of

__all__ = ["PRECISION_HELP", "count_arg", "dtype_arg", "positive_arg", "precision_arg", "tolerance"]

#: The precision classes in words, for help texts.
PRECISION_HELP = (
    "the precision class the kernel computes in, whose floors judge it: "
    + ", ".join(PRECISIONS)
    + " (tf32: float32 with matrix products on 10-bit operands; default: the buffers' dtype)"
)


def tolerance(text: str) -> float | dict[str, float]:
    """One number, or numbers by gradient name; compare() judges the names and the values."""
    try:
        if "=" not in text:
            return float(text)
        pairs = [item.split("=", 1) for item in text.split(",")]
        named = {name.strip(): float(value) for name, value in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or NAME=NUMBER pairs like dq=1e-3,dg=2e-3, got {text!r}"
        ) from None
    if len(named) != len(pairs):  # a dict keeps only the last
        raise argparse.ArgumentTypeError(f"a gradient is named twice in {text!r}")
    return named


def dtype_arg(text: str) -> str:
    """A floating dtype in any common spelling (``bf16``, ``F32``, ``half``, ...): its name."""
    if (name := canonical_name(text)) is None:
        spellings = "; ".join("/".join(aliases) for aliases in SPELLINGS.values())
        raise argparse.ArgumentTypeError(
            f"expected a floating dtype ({spellings}, in any case), got {text!r}"
        )
    return name


def precision_arg(text: str) -> str:
    """A precision class, in any of its spellings: its name."""
    try:
        return precision_of(text, "the precision").name
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def count_arg(text: str, least: int = 0) -> int:
    """A size, a seed or a count: an integer of at least ``least``."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {integer_words(least)}, got {text!r}")
    return value


def positive_arg(text: str) -> int:
    """A chunk length or a number of workers: an integer of at least 1."""
    return count_arg(text, 1)

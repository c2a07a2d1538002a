"""The command line's argument types (tolerances, dtype names, dimensions) and the flag
groups several commands share."""

from __future__ import annotations

import argparse

from ._checks import integer_words
from ._dtypes import PRECISIONS, SPELLINGS, canonical_name, precision_of

__all__ = [
    "add_file_arguments",
    "add_layout_arguments",
    "count_arg",
    "dtype_arg",
    "positive_arg",
    "tolerance",
]


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
    """A floating dtype in any common spelling (``bf16``, ``F32``, ``half``, ...), as its NumPy
    name."""
    name = canonical_name(text)
    if name is None:
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


#: The precision classes in words, for help texts.
PRECISION_HELP = (
    "the precision class the kernel computes in, whose floors judge it: "
    + ", ".join(PRECISIONS)
    + " (tf32: float32 with matrix products on 10-bit operands; default: the buffers' dtype)"
)


def count_arg(text: str) -> int:
    """A size, a seed or a count: an integer of at least 0."""
    return _integer_arg(text, 0)


def positive_arg(text: str) -> int:
    """A chunk length or a number of workers: an integer of at least 1."""
    return _integer_arg(text, 1)


def _integer_arg(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {integer_words(least)}, got {text!r}")
    return value


def add_file_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say what a .npy, plain safetensors or raw file holds."""
    group = parser.add_argument_group(
        "other files",
        "a fixture carries its own layout and dtype; a .npy, a plain safetensors file (its "
        "tensor 'packed', or its only one) or a raw file takes the layout from these flags or "
        "from the fixture it is compared with",
    )
    group.add_argument(
        "--dtype",
        type=dtype_arg,
        help="the dtype of a raw binary file (fixtures and .npy files carry their own)",
    )
    group.add_argument("--batch", "-B", type=count_arg, help="batch size B")
    group.add_argument("--seq", "-S", type=count_arg, help="sequence length S")
    group.add_argument("--heads", "-H", type=count_arg, help="heads H")
    group.add_argument("--state-size", "-N", type=count_arg, help="state (head) size N")
    group.add_argument(
        "--per-channel",
        action="store_true",
        default=None,
        help="the gate is per key channel: dg is [B, S, H, N]",
    )
    group.add_argument(
        "--carry-state", action="store_true", default=None, help="dstate is packed last"
    )


def add_layout_arguments(
    parser: argparse.ArgumentParser,
    *,
    batch: int,
    seq: int,
    heads: int,
    state_size: int,
    flags: bool = False,
) -> None:
    """The layout flags of the commands that make a layout, with their defaults."""
    group = parser.add_argument_group("layout")
    # None marks a flag the user did not give, so that `fixture --suite` can refuse it.
    parser.set_defaults(layout_defaults=(batch, seq, heads, state_size, flags))
    for flag, short, default, what in (
        ("--batch", "-B", batch, "batch size B"),
        ("--seq", "-S", seq, "sequence length S"),
        ("--heads", "-H", heads, "heads H"),
        ("--state-size", "-N", state_size, "state (head) size N"),
    ):
        group.add_argument(flag, short, type=count_arg, help=f"{what} (default: {default})")
    # With flags on by default, --no-per-channel and --no-carry-state turn them off.
    action = argparse.BooleanOptionalAction if flags else "store_true"
    group.add_argument(
        "--per-channel", action=action, default=None, help="gate per key channel: g is [B, S, H, N]"
    )
    group.add_argument(
        "--carry-state",
        action=action,
        default=None,
        help="an initial state is given: dstate is packed",
    )

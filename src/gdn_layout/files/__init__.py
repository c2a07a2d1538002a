"""Fixtures (inputs, output and packed gradient, in safetensors) and kernel outputs: the
format is in README.md, *Fixtures*; saving, loading and memory mapping in docs/files.md."""

from __future__ import annotations

from ._fixture import (
    FORMAT,
    FORMAT_VERSION,
    MAP_THRESHOLD,
    Fixture,
    FixtureError,
    GdnInputs,
    load_fixture,
    save_fixture,
)
from ._outputs import PackedFile, open_packed

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAP_THRESHOLD",
    "Fixture",
    "FixtureError",
    "GdnInputs",
    "PackedFile",
    "load_fixture",
    "open_packed",
    "save_fixture",
]

"""Any file that holds a packed gradient: a fixture, a plain safetensors file, a .npy or raw
bytes, known by its content and read lazily (memory-mapped)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import DTypeLike, NDArray

from . import _safetensors as safetensors
from ._criteria import Floors
from ._dtypes import resolve
from ._files import NotRegularFileError, open_regular
from ._fixture import FORMAT, load_fixture
from ._safetensors import FixtureError, looks_like_safetensors, reason
from .layout import GdnBackwardLayout

__all__ = ["PackedFile", "open_packed"]


class PackedFile(NamedTuple):
    """A packed buffer read from a file: ``kind`` is ``"fixture"``, ``"safetensors"`` (a
    plain safetensors file), ``".npy"`` or ``"raw"``; ``layout`` and ``floors`` are the ones
    a fixture states, else None."""

    path: str
    kind: str
    packed: NDArray[Any]
    layout: GdnBackwardLayout | None
    floors: Floors | None = None


def open_packed(path: str, dtype: DTypeLike | None = None) -> PackedFile:
    """Read a packed buffer lazily (memory-mapped) from a fixture, a .npy or a raw file.

    Parameters
    ----------
    path
        The file. What it holds is known from its first bytes; a damaged fixture or .npy
        file by its suffix. A safetensors file that is not a fixture (what a Rust test writes
        with the ``safetensors`` crate) gives its tensor named ``packed``, or its only tensor,
        flattened; the layout then comes from elsewhere.
    dtype
        The dtype of a raw binary file; fixtures and .npy files carry their own.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ValueError
        The file cannot be read as a packed buffer (:class:`FixtureError` for a fixture, and
        for a path that is not a regular file or cannot be read).
    """
    file = Path(path)
    try:
        with open_regular(file) as stream:
            head = stream.read(9)
            size = os.fstat(stream.fileno()).st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except NotRegularFileError as err:
        raise FixtureError(str(err)) from None
    except OSError as err:
        raise FixtureError(f"{path}: cannot be read: {reason(err)}") from None
    kind = _sniff(file, head, size)
    if kind == "fixture":
        if not _is_fixture(file):
            return PackedFile(path, "safetensors", _plain_safetensors(file), None)
        fixture = load_fixture(path)
        return PackedFile(path, kind, fixture.packed, fixture.layout, fixture.floors)
    if kind == ".npy":
        if not head.startswith(b"\x93NUMPY"):
            raise ValueError(f"{path}: not a .npy file: it has no NumPy header")
        try:
            with np.errstate(over="ignore"):  # NumPy warns as it sizes a claimed huge shape
                packed = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError, OverflowError, MemoryError) as error:
            # Python objects, a damaged header, or a shape no array can have
            raise ValueError(
                f"{path}: cannot be read as a packed buffer: {_claimed(file)}{error}"
            ) from None
        return PackedFile(path, kind, packed, None)
    if dtype is None:
        raise ValueError(f"{path}: a raw binary file needs --dtype (and the layout flags)")
    resolved = resolve(dtype, "dtype")
    if size % resolved.itemsize:
        raise ValueError(f"{path}: {size} bytes is not a whole number of {resolved.name} elements")
    raw = np.memmap(path, dtype=resolved, mode="r") if size else np.empty(0, resolved)
    return PackedFile(path, kind, raw, None)


def _claimed(path: Path) -> str:
    """What a .npy header claims, e.g. ``"its header claims shape (4294967296,) of float32;
    "``; empty when the header cannot be read."""
    try:
        with open(path, "rb") as file:
            version = np.lib.format.read_magic(file)
            read = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read is None:
                return ""
            shape, _, dtype = read(file)
    except (OSError, ValueError, SyntaxError, TypeError):
        return ""
    return f"its header claims shape {tuple(shape)} of {dtype}; "


def _is_fixture(path: Path) -> bool:
    """Whether a safetensors file says it is a gdn-layout fixture (a damaged one counts)."""
    try:
        meta = safetensors.read_header(path).metadata
    except (FixtureError, ImportError):
        return True  # load_fixture says what is wrong
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _plain_safetensors(path: Path) -> NDArray[Any]:
    """The tensor named ``packed`` of a safetensors file, or its only one, memory-mapped and
    flattened."""
    header = safetensors.read_header(path)
    safetensors.check_tiling(header.entries, header.size - header.data_start, path)
    by_name = {e.name: e for e in header.entries}
    entry = by_name.get("packed")
    if entry is None and len(header.entries) == 1:
        entry = header.entries[0]
    if entry is None:
        names = ", ".join(sorted(by_name)) or "none"
        raise FixtureError(
            f"{path}: a safetensors file with tensors {names}: name the packed gradient "
            "'packed', or write it alone"
        )
    if entry.end == entry.start:
        return np.empty(0, entry.dtype)
    buffer: NDArray[np.uint8] = np.memmap(path, dtype=np.uint8, mode="r")
    start = header.data_start
    return buffer[start + entry.start : start + entry.end].view(entry.dtype).reshape(-1)


def _sniff(path: Path, head: bytes, size: int) -> str:
    """What a file holds, from its first bytes; a damaged fixture or .npy by its name."""
    name = path.name.lower()
    if head.startswith(b"\x93NUMPY"):
        return ".npy"
    if looks_like_safetensors(head, size):  # whatever its name says
        return "fixture"
    if name.endswith(".npy"):
        return ".npy"
    return "fixture" if name.endswith(".safetensors") else "raw"

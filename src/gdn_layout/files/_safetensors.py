"""The safetensors format with NumPy alone, for F64, F32, F16 and BF16; its limits are in
docs/files.md, *Loading*."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .._checks import MAX_NBYTES, array_can_exist
from .._dtypes import BF16_HINT, DTYPES
from ._atomic import NotRegularFileError

#: The largest header read or written: 1 MiB (a fixture's is about 2 KiB; the official
#: reader's limit is 100 MB). Checked before the header is read.
MAX_HEADER: Final = 1 << 20
_BY_CODE: Final = {d.code: d for d in DTYPES.values()}


class FixtureError(ValueError):
    """A fixture file that is truncated, corrupt or inconsistent; the message names the file."""


class Entry(NamedTuple):
    """A tensor of a header: its dtype, shape and byte range in the data section."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    start: int
    end: int


class Header(NamedTuple):
    """A parsed header: ``__metadata__`` (or None), the tensors, the data's start, the size."""

    metadata: object
    entries: list[Entry]
    data_start: int
    size: int


def dtype_code(dtype: np.dtype[Any], where: str) -> str:
    """The safetensors code of ``dtype``; a TypeError naming ``where`` for any other dtype."""
    known = DTYPES.get(dtype.name)
    # The name alone could come from any extension dtype; bfloat16 must be ml_dtypes' own.
    if known is None or (known.ml_dtypes and dtype != known.numpy()):
        raise TypeError(
            f"{where}: dtype must be float64, float32, float16 or bfloat16, got {dtype}"
        )
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder != "little"):
        raise TypeError(f"{where}: safetensors is little-endian; got big-endian {dtype}")
    return known.code


def dtype_of_code(code: str, name: str, path: Path) -> np.dtype[Any]:
    """The little-endian NumPy dtype of a code read from the file at ``path``."""
    known = _BY_CODE.get(code)
    if known is not None and known.ml_dtypes:
        try:
            return known.numpy()
        except ImportError:
            raise ImportError(f"{path}: tensor {name!r} is {code}; {BF16_HINT}") from None
    if known is not None:
        return known.numpy().newbyteorder("<")
    raise FixtureError(
        f"{path}: tensor {name!r} has dtype {code!r}; a fixture holds F64, F32, F16 or BF16"
    )


def write(out: IO[bytes], tensors: Mapping[str, NDArray[Any]], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` and ``metadata`` to ``out`` as the official writer does (wider dtypes
    first, then by name; the header space-padded to 8 bytes), checked before writing."""
    codes = {name: dtype_code(array.dtype, name) for name, array in tensors.items()}
    order = sorted(codes, key=lambda name: (-_BY_CODE[codes[name]].itemsize, name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    start = 0
    for name in order:
        nbytes = tensors[name].nbytes
        header[name] = {
            "dtype": codes[name],
            "shape": list(tensors[name].shape),
            "data_offsets": [start, start + nbytes],
        }
        start += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:  # no reader of this package would take it
        key, value = max(metadata.items(), key=lambda item: len(item[1]), default=("", ""))
        raise ValueError(
            f"the header would be {len(text)} bytes, over the {MAX_HEADER}-byte (1 MiB) cap; "
            f"the longest metadata value, {key!r}, has {len(value)} characters"
        )
    out.write(len(text).to_bytes(8, "little") + text)
    for name in order:
        out.write(np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8).data)


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """Whether a file of ``size`` bytes whose first 9 are ``head`` starts like safetensors."""
    length = int.from_bytes(head[:8], "little")
    return len(head) >= 9 and head[8:9] == b"{" and 2 <= length <= size - 8


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Errors reading ``path`` as a FixtureError naming it; FileNotFoundError passes."""
    try:
        yield
    except FileNotFoundError:
        raise
    except NotRegularFileError as err:
        raise FixtureError(str(err)) from None
    except OSError as err:
        raise FixtureError(f"{path}: cannot be read: {reason(err)}") from None


def reason(err: OSError) -> str:
    return err.strerror or str(err)  # without the file name


#: Reads ``count`` bytes at ``offset`` (fewer at the end) of a file or a buffer.
Reader = Callable[[int, int], bytes]


def of_file(file: IO[bytes]) -> Reader:
    def read(offset: int, count: int) -> bytes:
        file.seek(offset)
        return file.read(count)

    return read


def of_buffer(buffer: NDArray[np.uint8]) -> Reader:
    return lambda offset, count: buffer[offset : offset + count].tobytes()


def parse_header(read: Reader, size: int, path: Path) -> Header:
    """The checked header of a file of ``size`` bytes that ``read`` reads (its length
    checked against :data:`MAX_HEADER` before it is read)."""
    if size < 8:
        raise FixtureError(
            f"{path}: truncated: {size} bytes, shorter than the 8-byte header length"
        )
    length = int.from_bytes(read(0, 8), "little")
    if length < 2 or length > size - 8:
        raise FixtureError(
            f"{path}: bad header length {length}: expected 2 to "
            f"{min(MAX_HEADER, size - 8)} for a file of {size} bytes"
        )
    if length > MAX_HEADER:
        raise FixtureError(
            f"{path}: header is {length} bytes, over the {MAX_HEADER}-byte (1 MiB) cap; a "
            "fixture's is a few KiB"
        )
    raw = read(8, length)
    if len(raw) != length:
        raise FixtureError(f"{path}: changed size while being read ({length} header bytes)")
    header = _parse_json(raw, path)
    metadata = header.pop("__metadata__", None)
    entries = [_parse_entry(name, spec, path) for name, spec in header.items()]
    return Header(metadata, entries, 8 + length, size)


def check_tiling(entries: list[Entry], data_size: int, path: Path) -> None:
    """As the official reader: the tensors tile the data section exactly, in offset order."""
    end, previous = 0, None
    for entry in sorted(entries, key=lambda e: (e.start, e.end)):
        if entry.end > data_size:
            raise FixtureError(
                f"{path}: tensor {entry.name!r} occupies bytes [{entry.start}, {entry.end}) of "
                f"the data section, which has only {data_size} bytes (truncated file?)"
            )
        if entry.start < end:
            raise FixtureError(
                f"{path}: tensor {entry.name!r} at bytes [{entry.start}, {entry.end}) overlaps "
                f"tensor {previous!r}, which ends at {end}"
            )
        if entry.start > end:
            raise FixtureError(
                f"{path}: gap in the data section: bytes [{end}, {entry.start}) before tensor "
                f"{entry.name!r} belong to no tensor"
            )
        end, previous = entry.end, entry.name
    if end != data_size:
        raise FixtureError(
            f"{path}: {data_size - end} bytes after the last tensor: the data section has "
            f"{data_size} bytes, the tensors cover {end}"
        )


def _parse_json(raw: bytes, path: Path) -> dict[str, Any]:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) != len(pairs):
            twice = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
            raise FixtureError(f"{path}: header has duplicate keys {twice[:10]}")
        return result

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except FixtureError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FixtureError(f"{path}: header is not UTF-8 JSON: {err}") from None
    except (RecursionError, ValueError) as err:
        raise FixtureError(f"{path}: header is not usable JSON: {err}") from None
    if not isinstance(header, dict):
        raise FixtureError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(name: str, spec: object, path: Path) -> Entry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise FixtureError(
            f"{where} must be an object with exactly dtype, shape and data_offsets, "
            f"got {spec!r:.200}"
        )
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str):
        raise FixtureError(f"{where}: dtype must be a string, got {code!r:.100}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise FixtureError(
            f"{where}: shape must be a list of non-negative integers, got {shape!r:.100}"
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_uint(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise FixtureError(
            f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, "
            f"got {offsets!r:.100}"
        )
    dtype = dtype_of_code(code, name, path)
    if not array_can_exist(shape, dtype.itemsize):
        raise FixtureError(
            f"{where}: shape {tuple(shape)} of {code} cannot exist: its non-zero dimensions "
            f"span more than the {MAX_NBYTES} bytes an array can address"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise FixtureError(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but "
            f"{code} {tuple(shape)} needs {nbytes}"
        )
    return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])

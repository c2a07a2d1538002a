"""The safetensors format, read and written with NumPy alone.

One header encoder and one parser, the official writer's data order, and recognising a
safetensors file by its first bytes. Only the dtypes a fixture holds are supported (their codes
are in :data:`gdn_layout._dtypes.DTYPES`): ``F64``, ``F32``, ``F16`` and ``BF16`` (which needs
ml_dtypes).

A header is at most :data:`MAX_HEADER` bytes (1 MiB), checked before it is read
(docs/files.md, *Loading*).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .._checks import MAX_NBYTES, array_can_exist
from .._dtypes import BF16_HINT, DTYPES
from ._atomic import NotRegularFileError, open_regular

__all__ = [
    "DTYPE_NAMES",
    "MAX_HEADER",
    "Entry",
    "FixtureError",
    "Header",
    "check_tiling",
    "dtype_code",
    "dtype_of_code",
    "looks_like_safetensors",
    "parse_header",
    "read_header",
    "reader_of_buffer",
    "reader_of_file",
    "reason",
    "write",
]

#: The largest header read or written, in bytes: 1 MiB, where a fixture's header (states and
#: floors included) is about 2 KiB. Checked before the header is read, it bounds the time and
#: memory of parsing it (the official reader's limit is 100 MB).
MAX_HEADER: Final = 1 << 20
#: The dtypes a fixture can hold, by name.
DTYPE_NAMES: Final = tuple(DTYPES)
_BY_CODE: Final = {d.code: d for d in DTYPES.values()}
# Valid safetensors codes that a fixture never holds, to tell "unsupported" from "unknown".
_OTHER_CODES: Final = frozenset(
    (
        "BOOL",
        "U8",
        "I8",
        "U16",
        "I16",
        "U32",
        "I32",
        "U64",
        "I64",
        "C64",
        "F8_E5M2",
        "F8_E4M3",
        "F8_E8M0",
        "F6_E2M3",
        "F6_E3M2",
        "F4",
    )
)


class FixtureError(ValueError):
    """A fixture file that is truncated, corrupt or inconsistent; the message names the file.

    See Also
    --------
    load_fixture : Raises it.
    load_suite : Raises it for a suite's files.
    """


class Entry(NamedTuple):
    """One tensor of a header: its dtype, shape and byte range in the data section."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    start: int
    end: int


class Header(NamedTuple):
    """A parsed header: the raw ``__metadata__`` (None when absent), the tensors, where the
    data section starts and the file's size."""

    metadata: object
    entries: list[Entry]
    data_start: int
    size: int


# -- dtypes -------------------------------------------------------------------------------------


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
    if code in _OTHER_CODES:
        raise FixtureError(
            f"{path}: tensor {name!r} has dtype {code}; a fixture holds F64, F32, F16 or BF16"
        )
    raise FixtureError(f"{path}: tensor {name!r} has unknown dtype {code!r}")


# -- writing ------------------------------------------------------------------------------------


def data_order(codes: Mapping[str, str]) -> list[str]:
    """The official writer's order of tensors ``name -> code``: wider dtypes first, then by
    name, so that every tensor stays aligned."""
    return sorted(codes, key=lambda name: (-_BY_CODE[codes[name]].itemsize, name))


def encode_header(
    specs: Mapping[str, tuple[str, tuple[int, ...], int]],
    metadata: Mapping[str, str],
    order: list[str],
) -> bytes:
    """The 8-byte length and the JSON header for tensors ``name -> (code, shape, nbytes)``
    stored in ``order``."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    start = 0
    for name in order:
        code, shape, nbytes = specs[name]
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [start, start + nbytes],
        }
        start += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    # Spaces up to a multiple of 8, as the official writer pads, so the data section is aligned.
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:  # no reader of this package would take it
        key, value = max(metadata.items(), key=lambda item: len(item[1]), default=("", ""))
        raise ValueError(
            f"the header would be {len(text)} bytes, over the {MAX_HEADER}-byte (1 MiB) cap; "
            f"the longest metadata value, {key!r}, has {len(value)} characters"
        )
    return len(text).to_bytes(8, "little") + text


def write(out: IO[bytes], tensors: Mapping[str, NDArray[Any]], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` and string ``metadata`` to ``out`` as one safetensors file.

    Every dtype (:func:`dtype_code`) and the header's size (at most :data:`MAX_HEADER`: a
    ValueError) are checked before anything is written.
    """
    codes = {name: dtype_code(array.dtype, name) for name, array in tensors.items()}
    order = data_order(codes)
    specs = {name: (codes[name], a.shape, a.nbytes) for name, a in tensors.items()}
    out.write(encode_header(specs, metadata, order))
    for name in order:
        flat = np.ascontiguousarray(tensors[name]).reshape(-1)
        out.write(flat.view(np.uint8).data)


# -- reading ------------------------------------------------------------------------------------


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """Whether a file of ``size`` bytes that starts with ``head`` (at least 9 bytes when the
    file has them) starts like safetensors: a little-endian u64 header length that fits the
    file, then a JSON object."""
    length = int.from_bytes(head[:8], "little")
    return len(head) >= 9 and head[8:9] == b"{" and 2 <= length <= size - 8


def read_header(path: Path) -> Header:
    """Read and check the header of the safetensors file at ``path``.

    Only a regular file is opened (a FIFO or a device is refused before it is opened), and a
    header longer than :data:`MAX_HEADER` is refused before it is read, so that parsing it
    takes bounded time and memory.

    Raises
    ------
    FileNotFoundError
        There is no file at ``path``.
    FixtureError
        ``path`` is not a regular file or cannot be read, the header is longer than
        :data:`MAX_HEADER`, or the length, the JSON or an entry is malformed.
    ImportError
        A tensor is BF16 and ml_dtypes is not installed.
    """
    with reading(path), open_regular(path) as f:
        return parse_header(reader_of_file(f), os.fstat(f.fileno()).st_size, path)


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Errors of reading ``path`` as one FixtureError naming it; FileNotFoundError passes."""
    try:
        yield
    except FileNotFoundError:
        raise
    except NotRegularFileError as err:
        raise FixtureError(str(err)) from None
    except OSError as err:
        raise FixtureError(f"{path}: cannot be read: {reason(err)}") from None


#: Reads ``count`` bytes at ``offset`` (fewer at the end) of a file or a buffer.
Reader = Callable[[int, int], bytes]


def reader_of_file(file: IO[bytes]) -> Reader:
    """A :data:`Reader` of an open binary file."""

    def read(offset: int, count: int) -> bytes:
        file.seek(offset)
        return file.read(count)

    return read


def reader_of_buffer(buffer: NDArray[np.uint8]) -> Reader:
    """A :data:`Reader` of bytes already in memory."""

    def read(offset: int, count: int) -> bytes:
        return buffer[offset : offset + count].tobytes()

    return read


def parse_header(read: Reader, size: int, path: Path) -> Header:
    """Check and parse the header of a safetensors file of ``size`` bytes that ``read`` reads;
    ``path`` names it in errors. See :func:`read_header`.

    Raises
    ------
    FixtureError
        The length, the JSON or an entry is malformed, the header is longer than
        :data:`MAX_HEADER`, or the file is shorter than it says.
    OSError
        ``read`` failed.
    ImportError
        A tensor is BF16 and ml_dtypes is not installed.
    """
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


def reason(err: OSError) -> str:
    """What went wrong in ``err``, without the file name it may repeat."""
    return err.strerror or str(err)


def _parse_json(raw: bytes, path: Path) -> dict[str, Any]:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) != len(pairs):  # a set, not list.count: linear in the number of keys
            seen: set[str] = set()
            duplicates: set[str] = set()
            for key, _ in pairs:
                (duplicates if key in seen else seen).add(key)
            raise FixtureError(f"{path}: header has duplicate keys {sorted(duplicates)[:10]}")
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
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_uint(o) for o in offsets)
        or offsets[0] > offsets[1]
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

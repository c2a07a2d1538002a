"""Fixture files for ``GatedDeltaNetBackward``: inputs, output and packed gradient, in safetensors.

A fixture is one `safetensors <https://github.com/huggingface/safetensors>`_ file, the format
RLX memory-maps its weights from, holding the tensors ``q, k, v, g, beta``, ``state`` (only
when carried), ``dy``, the forward output ``y`` and ``packed``, the 1-D gradient in rlx-ir's
order. Its ``__metadata__`` (string values only) records:

``format``
    ``"gdn-layout-fixture"``, so that any other safetensors file is refused.
``format_version``
    ``"1"``.
``gdn_layout_version``
    the version of gdn-layout that wrote the file.
``layout``
    the :class:`~gdn_layout.GdnBackwardLayout` as JSON, from its ``to_dict()``.
``seed``, ``regime``, ``compute_dtype``
    how the data was made, when known: the seed and gate regime of :func:`draw_inputs`, and
    the dtype the reference computed ``y`` and ``packed`` in.

Every tensor has one dtype: ``F64``, ``F32``, ``F16`` or ``BF16`` (bfloat16 needs ml_dtypes:
``pip install gdn-layout[bfloat16]``). Neither safetensors nor ml_dtypes is needed otherwise;
the format is read and written here with NumPy alone.

>>> import tempfile, pathlib
>>> import gdn_layout as gl
>>> from gdn_layout.fixtures import Fixture, draw_inputs, load_fixture, save_fixture
>>> layout = gl.GdnBackwardLayout(batch=1, seq=3, heads=2, state_size=4)
>>> x = draw_inputs(layout, regime="mild", seed=1)
>>> flat = np.zeros(layout.total_elems, np.float32)
>>> fx = Fixture(*x[:5], dy=x.dy, y=np.zeros_like(x.v), packed=flat, regime="mild", seed=1)
>>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny.safetensors"
>>> save_fixture(path, fx) == path
True
>>> back = load_fixture(path)
>>> back.layout == layout, back.grads.dg.shape, back.regime, back.seed
(True, (1, 3, 2), 'mild', 1)
>>> bool((back.q == x.q).all()), isinstance(back.q, np.memmap), back.q.flags.writeable
(True, True, False)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, NamedTuple

import numpy as np
from numpy.typing import DTypeLike, NDArray

from . import __version__
from ._dtypes import BF16_HINT, bfloat16, resolve
from .layout import GdnBackwardLayout, _not_a_layout
from .packing import GdnGrads, unpack

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "REGIMES",
    "Fixture",
    "FixtureError",
    "GdnInputs",
    "draw_inputs",
    "load_fixture",
    "make_fixture",
    "save_fixture",
    "write_suite",
]

#: The ``format`` metadata value that marks a gdn-layout fixture.
FORMAT: Final = "gdn-layout-fixture"
#: The ``format_version`` this module writes and the only one it reads.
FORMAT_VERSION: Final = 1
#: Gate regimes of :func:`draw_inputs`.
REGIMES: Final = ("zero", "mild", "strong", "mixed")

# The official implementation's limit; a larger "header" is a corrupt length, not a header.
_MAX_HEADER: Final = 100_000_000
_INPUT_NAMES: Final = ("q", "k", "v", "g", "beta", "state", "dy")
_TENSOR_NAMES: Final = (*_INPUT_NAMES, "y", "packed")
_CODES: Final = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
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
    """A fixture file that is truncated, corrupt or inconsistent; the message names the file."""


class GdnInputs(NamedTuple):
    """The inputs of the op and the cotangent ``dy``, in the reference's argument order.

    ``backward(*inputs)`` and ``forward(*inputs[:5], state=inputs.state)`` both work.
    """

    q: NDArray[Any]
    k: NDArray[Any]
    v: NDArray[Any]
    g: NDArray[Any]
    beta: NDArray[Any]
    dy: NDArray[Any]
    state: NDArray[Any] | None = None


@dataclass(frozen=True, eq=False, repr=False)
class Fixture:
    """One test case of ``GatedDeltaNetBackward``: its inputs, ``y`` and the packed gradient.

    The layout is inferred from ``q``, ``g`` and ``state``, and every other tensor is checked
    against it; all tensors share one dtype (float64, float32, float16 or bfloat16). ``grads``
    holds the views of ``packed`` given by :func:`~gdn_layout.unpack`. A fixture from
    :func:`load_fixture` has read-only arrays backed by the file (``path`` says which).

    >>> import gdn_layout as gl
    >>> x = draw_inputs(gl.GdnBackwardLayout(1, 2, 1, 4, carry_state=True), dtype=np.float64)
    >>> fx = Fixture(*x, y=np.zeros_like(x.q), packed=np.zeros(44))
    >>> fx.layout.carry_state, fx.grads.dstate.shape
    (True, (1, 1, 4, 4))
    >>> Fixture(*x, y=np.zeros_like(x.q), packed=np.zeros(40))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Fixture: packed has shape (40,), expected (44,) for GdnBackwardLayout(...)
    """

    q: NDArray[Any]
    k: NDArray[Any]
    v: NDArray[Any]
    g: NDArray[Any]
    beta: NDArray[Any]
    dy: NDArray[Any]
    state: NDArray[Any] | None = None
    y: NDArray[Any] = field(kw_only=True)
    packed: NDArray[Any] = field(kw_only=True)
    #: How the data was made, when known (see :func:`make_fixture`).
    regime: str | None = field(default=None, kw_only=True)
    seed: int | None = field(default=None, kw_only=True)
    compute_dtype: str | None = field(default=None, kw_only=True)
    #: The file this fixture was loaded from, and the gdn-layout version that wrote it.
    path: Path | None = field(default=None, kw_only=True)
    writer_version: str | None = field(default=None, kw_only=True)
    layout: GdnBackwardLayout = field(init=False)
    grads: GdnGrads = field(init=False, repr=False)

    def __post_init__(self) -> None:
        arrays = self.tensors()
        for name, array in arrays.items():
            if not isinstance(array, np.ndarray):
                raise TypeError(
                    f"Fixture: {name} must be a NumPy array, got {type(array).__name__}"
                )
        dtype = self.q.dtype
        _dtype_code(dtype, "Fixture: q")
        for name, array in arrays.items():
            if array.dtype != dtype:
                raise TypeError(
                    f"Fixture: {name} has dtype {array.dtype}, expected {dtype} like q "
                    "(a fixture holds one dtype)"
                )
        try:
            layout = GdnBackwardLayout.from_inputs(self.q, self.g, self.state)
        except (TypeError, ValueError) as err:
            raise ValueError(f"Fixture: {err}") from None
        for name, array in arrays.items():
            expected = _expected_shape(layout, name)
            if array.shape != expected:
                raise ValueError(
                    f"Fixture: {name} has shape {array.shape}, expected {expected} for {layout!r}"
                )
        _check_provenance(self.regime, self.seed, self.compute_dtype, "Fixture")
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "grads", unpack(self.packed, layout))

    def __repr__(self) -> str:
        # The arrays are left out: a fixture can be gigabytes.
        fields = [f"{self.layout!r}", f"dtype={self.dtype}"]
        fields += [
            f"{name}={getattr(self, name)!r}"
            for name in ("regime", "seed", "compute_dtype", "path")
            if getattr(self, name) is not None
        ]
        return f"Fixture({', '.join(fields)})"

    @property
    def dtype(self) -> np.dtype[Any]:
        """The one dtype of every tensor."""
        return self.q.dtype

    @property
    def inputs(self) -> GdnInputs:
        """``q, k, v, g, beta, dy, state`` in the reference's argument order."""
        return GdnInputs(self.q, self.k, self.v, self.g, self.beta, self.dy, self.state)

    def tensors(self) -> dict[str, NDArray[Any]]:
        """The file's tensors by name: ``state`` only when carried."""
        named = {name: getattr(self, name) for name in _TENSOR_NAMES}
        return {name: array for name, array in named.items() if array is not None}

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` that :func:`save_fixture` writes for this fixture."""
        meta = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "gdn_layout_version": __version__,
            "layout": json.dumps(self.layout.to_dict(), sort_keys=True),
        }
        if self.seed is not None:
            meta["seed"] = str(self.seed)
        if self.regime is not None:
            meta["regime"] = self.regime
        if self.compute_dtype is not None:
            meta["compute_dtype"] = self.compute_dtype
        return meta


# -- dtypes -------------------------------------------------------------------------------------


def _resolve_dtype(dtype: DTypeLike, where: str) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype a fixture can hold; ``"bfloat16"`` works as a string."""
    try:
        resolved = resolve(dtype, where)
    except TypeError:
        raise TypeError(
            f"{where}: dtype must be float64, float32, float16 or bfloat16, got {dtype!r}"
        ) from None
    _dtype_code(resolved, where)
    return resolved


def _dtype_code(dtype: np.dtype[Any], where: str) -> str:
    code = _CODES.get(dtype.name)
    # The name alone could come from any extension dtype; bfloat16 must be ml_dtypes' own.
    if code is None or (code == "BF16" and dtype != bfloat16()):
        raise TypeError(
            f"{where}: dtype must be float64, float32, float16 or bfloat16, got {dtype}"
        )
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder != "little"):
        raise TypeError(f"{where}: safetensors is little-endian; got big-endian {dtype}")
    return code


def _dtype_of_code(code: str, name: str, path: Path) -> np.dtype[Any]:
    if code == "BF16":
        try:
            return bfloat16()
        except ImportError:
            raise ImportError(f"{path}: tensor {name!r} is BF16; {BF16_HINT}") from None
    for dtype_name, known in _CODES.items():
        if known == code:
            little: np.dtype[Any] = np.dtype(dtype_name).newbyteorder("<")
            return little
    if code in _OTHER_CODES:
        raise FixtureError(
            f"{path}: tensor {name!r} has dtype {code}; a fixture holds F64, F32, F16 or BF16"
        )
    raise FixtureError(f"{path}: tensor {name!r} has unknown dtype {code!r}")


def _expected_shape(layout: GdnBackwardLayout, name: str) -> tuple[int, ...]:
    if name == "packed":
        return (layout.total_elems,)
    if name in ("g", "beta", "state"):
        return layout.shape("d" + name)
    return layout.shape("dq")


def _seed(value: object, where: str) -> int:
    """A seed as NumPy's generators take it: a non-negative integer, NumPy's included."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: seed must be a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"{where}: seed must be a non-negative int, got {value!r}")
    return int(value)


def _check_provenance(regime: object, seed: object, compute_dtype: object, where: str) -> None:
    if regime is not None and regime not in REGIMES:
        raise ValueError(f"{where}: regime must be one of {REGIMES} or None, got {regime!r}")
    if seed is not None:
        _seed(seed, where)
    if compute_dtype is not None and not isinstance(compute_dtype, str):
        raise ValueError(f"{where}: compute_dtype must be a str or None, got {compute_dtype!r}")


# -- writing ------------------------------------------------------------------------------------


def save_fixture(
    path: str | os.PathLike[str], fixture: Fixture, *, overwrite: bool = False
) -> Path:
    """Write ``fixture`` to ``path`` as a safetensors file, atomically; return the path.

    The file is written to a temporary file in the same folder, flushed to disk, then renamed
    over ``path``: a reader sees the old file or the new one, never half of one, and a failure
    leaves nothing behind. An existing ``path`` is replaced only with ``overwrite=True``;
    otherwise :class:`FileExistsError` is raised.
    """
    if not isinstance(fixture, Fixture):
        raise TypeError(f"save_fixture: fixture must be a Fixture, got {type(fixture).__name__}")
    tensors = fixture.tensors()
    header = _encode_header(
        {name: (_dtype_code(a.dtype, name), a.shape, a.nbytes) for name, a in tensors.items()},
        fixture.metadata(),
    )

    def write(out: IO[bytes]) -> None:
        out.write(header)
        for name in _data_order(tensors):
            flat = np.ascontiguousarray(tensors[name]).reshape(-1)
            out.write(flat.view(np.uint8).data)

    return _atomic_write(Path(path), write, overwrite=overwrite)


def _data_order(tensors: Mapping[str, NDArray[Any]]) -> list[str]:
    # The official writer's order: wider dtypes first, then by name; every tensor stays aligned.
    return sorted(tensors, key=lambda name: (-tensors[name].dtype.itemsize, name))


def _encode_header(
    specs: Mapping[str, tuple[str, tuple[int, ...], int]], metadata: Mapping[str, str]
) -> bytes:
    """The 8-byte length and the JSON header for tensors ``name -> (code, shape, nbytes)``."""
    order = sorted(specs, key=lambda name: (-_ITEMSIZE[specs[name][0]], name))
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
    return len(text).to_bytes(8, "little") + text


_ITEMSIZE: Final = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def _atomic_write(path: Path, write: Callable[[IO[bytes]], None], *, overwrite: bool) -> Path:
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: the folder {path.parent} does not exist")
    tmp = _create_temp(path)
    try:
        with open(tmp, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _create_temp(path: Path) -> Path:
    # A hidden name in the same folder, so that the rename stays on one filesystem; created
    # with O_EXCL and mode 0o666 so that the final file gets the usual umask permissions.
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666
            )
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"could not create a temporary file next to {path}")  # pragma: no cover


def _link_new(tmp: Path, path: Path) -> None:
    # A hard link fails if path appeared meanwhile, so an existing file is never replaced.
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it") from None
    except OSError:  # pragma: no cover - filesystems without hard links
        if path.exists():
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it") from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


# -- reading ------------------------------------------------------------------------------------


class _Entry(NamedTuple):
    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    start: int
    end: int


def load_fixture(path: str | os.PathLike[str], *, mmap: bool = True) -> Fixture:
    """Read a fixture written by :func:`save_fixture` (or any conforming safetensors writer).

    Only the header is read and checked up front; with ``mmap=True`` (the default) the tensors
    are read-only :class:`numpy.memmap` views into the file, so that a multi-GiB fixture opens
    at once. With ``mmap=False`` the file is read into memory (still read-only). A file that
    is truncated, corrupt or inconsistent raises :class:`FixtureError` naming it and the
    problem; a bfloat16 file without ml_dtypes raises :class:`ImportError`.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise FixtureError(
                f"{path}: truncated: {size} bytes, shorter than the 8-byte header length"
            )
        length = int.from_bytes(f.read(8), "little")
        if length < 2 or length > _MAX_HEADER or length > size - 8:
            raise FixtureError(
                f"{path}: bad header length {length}: expected 2 to "
                f"{min(_MAX_HEADER, size - 8)} for a file of {size} bytes"
            )
        raw = f.read(length)
    header = _parse_header(raw, path)
    metadata = _parse_metadata(header.pop("__metadata__", None), path)
    entries = [_parse_entry(name, spec, path) for name, spec in header.items()]
    layout = _layout_of(metadata, path)
    _check_entries(entries, layout, size - 8 - length, path)

    data_start = 8 + length
    if mmap:
        buffer: NDArray[np.uint8] = np.memmap(path, dtype=np.uint8, mode="r")
    else:
        buffer = np.fromfile(path, dtype=np.uint8)
        buffer.flags.writeable = False
    if buffer.size != size:
        raise FixtureError(f"{path}: changed size while being read ({size} -> {buffer.size})")
    arrays = {
        e.name: buffer[data_start + e.start : data_start + e.end].view(e.dtype).reshape(e.shape)
        for e in entries
    }
    try:
        seed = int(metadata["seed"]) if "seed" in metadata else None
        return Fixture(
            **arrays,
            regime=metadata.get("regime"),
            seed=seed,
            compute_dtype=metadata.get("compute_dtype"),
            path=path,
            writer_version=metadata.get("gdn_layout_version"),
        )
    except (TypeError, ValueError) as err:
        raise FixtureError(f"{path}: {err}") from None


def _parse_header(raw: bytes, path: Path) -> dict[str, Any]:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        duplicates = sorted({key for key in keys if keys.count(key) > 1})
        if duplicates:
            raise FixtureError(f"{path}: header has duplicate keys {duplicates}")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FixtureError(f"{path}: header is not UTF-8 JSON: {err}") from None
    except RecursionError:
        raise FixtureError(f"{path}: header is not usable JSON: nested too deeply") from None
    if not isinstance(header, dict):
        raise FixtureError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header


def _parse_metadata(meta: object, path: Path) -> dict[str, str]:
    if meta is None:
        raise FixtureError(f"{path}: not a gdn-layout fixture: the header has no __metadata__")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FixtureError(f"{path}: __metadata__ must map strings to strings, got {meta!r:.200}")
    if meta.get("format") != FORMAT:
        raise FixtureError(
            f"{path}: not a gdn-layout fixture: metadata format is {meta.get('format')!r}, "
            f"expected {FORMAT!r}"
        )
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise FixtureError(
            f"{path}: unsupported format_version {meta.get('format_version')!r}; this "
            f"gdn-layout {__version__} reads {str(FORMAT_VERSION)!r}"
        )
    seed = meta.get("seed")
    if seed is not None and not (seed.isascii() and seed.isdigit()):
        raise FixtureError(f"{path}: metadata seed must be a non-negative integer, got {seed!r}")
    return meta


def _layout_of(meta: Mapping[str, str], path: Path) -> GdnBackwardLayout:
    text = meta.get("layout")
    if text is None:
        raise FixtureError(f"{path}: metadata has no layout")
    try:
        return GdnBackwardLayout.from_dict(json.loads(text))
    except (ValueError, TypeError, RecursionError) as err:
        raise FixtureError(f"{path}: metadata layout {text!r:.200} does not parse: {err}") from None


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(name: str, spec: object, path: Path) -> _Entry:
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
    dtype = _dtype_of_code(code, name, path)
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise FixtureError(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but "
            f"{code} {tuple(shape)} needs {nbytes}"
        )
    return _Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_entries(
    entries: list[_Entry], layout: GdnBackwardLayout, data_size: int, path: Path
) -> None:
    names = {e.name for e in entries}
    required = set(_TENSOR_NAMES) - (set() if layout.carry_state else {"state"})
    missing = [n for n in _TENSOR_NAMES if n in required - names]
    if missing:
        raise FixtureError(f"{path}: missing tensor(s) {', '.join(missing)} required by {layout!r}")
    unexpected = sorted(names - required)
    if unexpected:
        raise FixtureError(f"{path}: unexpected tensor(s) {', '.join(unexpected)} for {layout!r}")
    by_name = {e.name: e for e in entries}
    for name in _TENSOR_NAMES:
        entry = by_name.get(name)
        if entry is None:
            continue
        expected = _expected_shape(layout, name)
        if entry.shape != expected:
            raise FixtureError(
                f"{path}: tensor {name!r} has shape {entry.shape}, expected {expected} "
                f"for {layout!r}"
            )
        if entry.dtype != by_name["q"].dtype:
            raise FixtureError(
                f"{path}: tensor {name!r} has dtype {entry.dtype}, expected "
                f"{by_name['q'].dtype} like 'q' (a fixture holds one dtype)"
            )
    # As the official reader: the tensors tile the data section exactly, in offset order.
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


# -- generating ---------------------------------------------------------------------------------


def draw_inputs(
    layout: GdnBackwardLayout,
    *,
    regime: str = "mixed",
    seed: int = 0,
    dtype: DTypeLike = np.float32,
) -> GdnInputs:
    """Random inputs for ``layout`` as the op expects them, in ``dtype``.

    ``q`` and ``k`` are L2-normalised over ``N``; ``v``, ``dy`` and ``state`` are standard
    normal; ``beta`` is uniform in ``[0.05, 0.95]``. The log-gate ``g`` depends on ``regime``:

    ``"zero"``
        ``g = 0``: no decay.
    ``"mild"``
        ``g`` uniform in ``[-0.1, -0.001]``: ``exp(g)`` near 1.
    ``"strong"``
        ``g`` uniform in ``[-8, -3]``: ``exp(g)`` near 0.
    ``"mixed"``
        each element of ``g`` drawn from one of the three, at random.

    Each tensor has its own random stream, so ``q`` is the same for every regime and gate
    mode of a seed, and a layout with ``carry_state`` shares all other inputs with the one
    without it. Values are drawn in float64 and normalised before the cast to ``dtype``.

    >>> import gdn_layout as gl
    >>> x = draw_inputs(gl.GdnBackwardLayout(2, 5, 3, 8), regime="strong", seed=3)
    >>> x.q.shape, x.g.shape, x.state is None, x.q.dtype
    ((2, 5, 3, 8), (2, 5, 3), True, dtype('float32'))
    >>> bool(np.allclose(np.linalg.norm(x.k, axis=-1), 1.0)), float(x.g.max()) <= -3.0
    (True, True)
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise _not_a_layout(layout, "draw_inputs")
    if regime not in REGIMES:
        raise ValueError(f"draw_inputs: regime must be one of {REGIMES}, got {regime!r}")
    seed = _seed(seed, "draw_inputs")
    target = _resolve_dtype(dtype, "draw_inputs")
    streams = dict(
        zip(
            _INPUT_NAMES,
            map(np.random.default_rng, np.random.SeedSequence(int(seed)).spawn(7)),
            strict=True,
        )
    )
    qkv = layout.shape("dq")

    def unit(rng: np.random.Generator) -> NDArray[np.float64]:
        x = rng.standard_normal(qkv)
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
        return x / np.where(norm > 0, norm, 1.0)

    drawn: dict[str, NDArray[Any] | None] = {
        "q": unit(streams["q"]),
        "k": unit(streams["k"]),
        "v": streams["v"].standard_normal(qkv),
        "g": _gate(streams["g"], layout.shape("dg"), regime),
        "beta": streams["beta"].uniform(0.05, 0.95, layout.shape("dbeta")),
        "dy": streams["dy"].standard_normal(qkv),
        "state": (
            streams["state"].standard_normal(layout.shape("dstate")) if layout.carry_state else None
        ),
    }
    cast = {n: None if a is None else a.astype(target) for n, a in drawn.items()}
    return GdnInputs(**cast)  # type: ignore[arg-type]


def _gate(rng: np.random.Generator, shape: tuple[int, ...], regime: str) -> NDArray[np.float64]:
    # The bounds keep every regime apart after a cast to bfloat16 too: mild never rounds to 0.
    mild = rng.uniform(-0.1, -0.001, shape)
    strong = rng.uniform(-8.0, -3.0, shape)
    if regime == "zero":
        return np.zeros(shape)
    if regime == "mild":
        return mild
    if regime == "strong":
        return strong
    pick = rng.integers(0, 3, shape)
    return np.select([pick == 1, pick == 2], [mild, strong], 0.0)


def make_fixture(
    layout: GdnBackwardLayout,
    *,
    dtype: DTypeLike = np.float32,
    regime: str = "mixed",
    seed: int = 0,
    progress: Callable[[float], object] | None = None,
) -> Fixture:
    """Draw inputs with :func:`draw_inputs` and compute ``y`` and ``packed`` for them.

    The reference runs in float64 on the inputs as stored (already cast to ``dtype``), and its
    results are cast to ``dtype``: the fixture is exactly the reference's answer for its own
    inputs, up to that final rounding. ``progress`` is passed to the reference backward.

    >>> import gdn_layout as gl
    >>> fx = make_fixture(gl.GdnBackwardLayout(1, 4, 2, 8, carry_state=True), regime="zero")
    >>> fx.packed.shape, fx.grads.dstate.shape, fx.compute_dtype
    ((336,), (1, 2, 8, 8), 'float64')
    """
    from . import reference  # deferred: only generation needs the reference

    x = draw_inputs(layout, regime=regime, seed=seed, dtype=dtype)
    state = None if x.state is None else x.state.astype(np.float64)
    q, k, v, g, beta, dy = (a.astype(np.float64) for a in x[:6])
    wide = GdnInputs(q, k, v, g, beta, dy, state)
    y = reference.forward(*wide[:5], state=wide.state, dtype=np.float64)
    if isinstance(y, tuple):  # (y, final_state) when the state is carried
        y = y[0]
    packed = reference.backward(*wide, dtype=np.float64, progress=progress)
    target = x.q.dtype
    return Fixture(
        *x,
        y=np.asarray(y).astype(target),
        packed=np.asarray(packed).astype(target),
        regime=regime,
        seed=int(seed),
        compute_dtype="float64",
    )


class _Case(NamedTuple):
    tag: str
    batch: int
    seq: int
    heads: int
    state_size: int


#: Edge shapes of :func:`write_suite`: S=1, N=1, the shape RLX tests with (B, H > 1), S a
#: multiple of 64, S not one, S just past one, and the largest N of RLX's CPU kernels.
_SUITE_SHAPES: Final = (
    _Case("s1", 1, 1, 1, 8),
    _Case("n1", 1, 7, 2, 1),
    _Case("rlx", 2, 5, 3, 8),
    _Case("s64", 1, 64, 2, 16),
    _Case("s65", 2, 65, 2, 16),
    _Case("s100", 1, 100, 3, 16),
    _Case("n128", 1, 3, 1, 128),
)


def _suite_cases() -> Iterator[tuple[str, GdnBackwardLayout, str]]:
    for case in _SUITE_SHAPES:
        for per_channel in (False, True):
            for carry in (False, True):
                layout = GdnBackwardLayout(
                    case.batch,
                    case.seq,
                    case.heads,
                    case.state_size,
                    gate_per_channel=per_channel,
                    carry_state=carry,
                )
                for regime in REGIMES:
                    name = (
                        f"{case.tag}-b{case.batch}s{case.seq}h{case.heads}n{case.state_size}"
                        f"-{'channel' if per_channel else 'scalar'}"
                        f"-{'state' if carry else 'nostate'}-{regime}.safetensors"
                    )
                    yield name, layout, regime


def write_suite(
    directory: str | os.PathLike[str],
    *,
    dtype: DTypeLike = np.float32,
    seed: int = 0,
    overwrite: bool = False,
    progress: Callable[[float], object] | None = None,
) -> list[Path]:
    """Write the standard fixture set for a kernel test-suite into ``directory``.

    Every combination of gate mode (scalar, per channel), state mode (carried or not), gate
    regime (:data:`REGIMES`) and edge shape (S=1, N=1, B and H above 1, S = 64, 65, 100 and
    N=128) is one file; file ``i`` uses seed ``seed + i``. ``manifest.json`` lists each file
    with its layout, regime, seed, dtype, size and SHA-256. The whole set is a few MiB in
    float32. Existing files are refused unless ``overwrite=True``. Returns the fixture paths.
    ``progress``, when given, is called with the fraction of the files written so far.
    """
    root = Path(directory)
    target = _resolve_dtype(dtype, "write_suite")
    seed = _seed(seed, "write_suite")
    root.mkdir(parents=True, exist_ok=True)
    manifest = root / "manifest.json"
    if not overwrite and manifest.exists():
        raise FileExistsError(f"{manifest} exists; pass overwrite=True to replace the suite")
    paths: list[Path] = []
    entries: list[dict[str, Any]] = []
    cases = list(_suite_cases())
    for index, (name, layout, regime) in enumerate(cases):
        fixture = make_fixture(layout, dtype=target, regime=regime, seed=seed + index)
        path = save_fixture(root / name, fixture, overwrite=overwrite)
        paths.append(path)
        if progress is not None:
            progress((index + 1) / len(cases))
        entries.append(
            {
                "file": name,
                "layout": layout.to_dict(),
                "regime": regime,
                "seed": seed + index,
                "dtype": _dtype_code(target, "write_suite"),
                "bytes": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
        )
    document = {
        "format": FORMAT + "-suite",
        "format_version": FORMAT_VERSION,
        "gdn_layout_version": __version__,
        "dtype": _dtype_code(target, "write_suite"),
        "seed": seed,
        "fixtures": entries,
    }
    text = (json.dumps(document, indent=1) + "\n").encode()

    def write(out: IO[bytes]) -> None:
        out.write(text)

    _atomic_write(manifest, write, overwrite=overwrite)
    return paths

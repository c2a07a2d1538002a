"""A kernel's output in any file that holds a packed gradient, known by its content
(docs/cli.md, *inspect*)."""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import DTypeLike, NDArray

from .._dtypes import resolve
from .._floors import Floors
from .._limits import available_memory, human_bytes
from ..layout import GdnBackwardLayout
from . import _mapping
from . import _safetensors as safetensors
from ._atomic import open_regular
from ._fixture import FORMAT, Fixture, fixture_of
from ._mapping import FileStamp, held, map_file, read_all
from ._safetensors import FixtureError

__all__ = ["FILE_KINDS", "PackedFile", "open_packed"]

#: The kinds of file :func:`open_packed` reads, as help texts name them.
FILE_KINDS: Final = (
    "a fixture, a plain safetensors file, a .npy, a .npz, a torch.save file (.pt) or a raw file"
)
#: The gradients a file of several arrays may hold by name (``dstate`` when carried).
_GRADIENTS: Final = ("dq", "dk", "dv", "dg", "dbeta", "dstate")


class PackedFile(NamedTuple):
    """A packed buffer read from a file: ``kind`` is ``"fixture"``, ``"safetensors"``,
    ``".npy"``, ``".npz"``, ``".pt"`` or ``"raw"``; ``layout`` is a fixture's or that of
    gradients given by name; ``floors`` and ``fixture`` a fixture's, else None.
    """

    path: str
    kind: str
    packed: NDArray[Any]
    layout: GdnBackwardLayout | None
    floors: Floors | None = None
    fixture: Fixture | None = None
    #: The file ``packed`` is memory-mapped from, as it was when opened; None in memory.
    stamp: FileStamp | None = None

    @property
    def scales(self) -> dict[str, float] | None:
        """A fixture's :attr:`Fixture.scales`, else None."""
        return None if self.fixture is None else self.fixture.scales

    def unchanged(self) -> contextlib.AbstractContextManager[None]:
        """A mapped ``packed`` checked against its file as opened, on entry and on exit, as
        :meth:`Fixture.unchanged` does."""
        return held(self.stamp, Path(self.path))


def open_packed(path: str, dtype: DTypeLike | None = None) -> PackedFile:
    """Read a packed buffer from a fixture, a safetensors, .npy, .npz, torch.save or raw file.

    Read into memory or mapped as :func:`~gdn_layout.load_fixture` does (a .npy mapped by
    :func:`numpy.load`); no pickle in a file is ever run.

    Parameters
    ----------
    path
        The file, its kind known from its first bytes (docs/cli.md, *inspect*). A file of
        several arrays gives its only one, the one named ``packed``, or ``dq`` ... ``dstate``
        packed (which give the layout).
    dtype
        The dtype of a raw binary file; the other kinds carry their own.

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
        with safetensors.reading(file), open_regular(file) as stream:
            head, status = stream.read(9), os.fstat(stream.fileno())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    kind = _sniff(file.name.lower(), head, status.st_size)
    if kind == ".npy":
        return _npy(path, head, status)
    if kind == "zip":
        return _zipped(path, file)
    if kind == "fixture":
        buffer, stamp = _contents(file)
        header = safetensors.parse_header(safetensors.of_buffer(buffer), buffer.size, file)
        meta = header.metadata
        if isinstance(meta, dict) and meta.get("format") == FORMAT:
            fx = fixture_of(file, header, buffer, stamp)
            return PackedFile(path, kind, fx.packed, fx.layout, fx.floors, fx, fx.stamp)
        return PackedFile(path, "safetensors", _plain(file, header, buffer), None, stamp=stamp)
    if dtype is None:
        raise ValueError(f"{path}: a raw binary file needs --dtype (and the layout flags)")
    resolved = resolve(dtype, "dtype")
    if status.st_size % resolved.itemsize:
        raise ValueError(
            f"{path}: {status.st_size} bytes is not a whole number of {resolved.name} elements"
        )
    raw, stamp = _contents(file)
    return PackedFile(path, kind, raw.view(resolved), None, stamp=stamp)


def _sniff(name: str, head: bytes, size: int) -> str:
    """What a file holds, from its first bytes; a damaged fixture or .npy by its name."""
    if head.startswith(b"\x93NUMPY"):
        return ".npy"
    if safetensors.looks_like_safetensors(head, size):  # whatever its name says
        return "fixture"
    if head.startswith(b"PK\x03\x04") or name.endswith((".npz", ".pt", ".pth")):
        return "zip"  # numpy.savez and torch.save (since PyTorch 1.6) write zip archives
    if name.endswith(".npy"):
        return ".npy"
    return "fixture" if name.endswith(".safetensors") else "raw"


def _claimed(path: str) -> str | None:
    """What a .npy header claims, for an error; None where the header itself is unreadable."""
    fmt = np.lib.format
    try:
        with open(path, "rb") as file:
            major, _ = fmt.read_magic(file)
            read = fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0
            shape, _, dtype = read(file)
    except (ValueError, OSError, EOFError):
        return None
    return f"its header claims shape {shape} of {dtype}, which no array can have"


def _npy(path: str, head: bytes, status: os.stat_result) -> PackedFile:
    if not head.startswith(b"\x93NUMPY"):
        raise ValueError(f"{path}: not a .npy file: it has no NumPy header")
    try:
        with np.errstate(over="ignore"):  # NumPy warns as it sizes a claimed huge shape
            packed = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OverflowError, MemoryError) as error:
        # Python objects, a damaged header, or a shape no array can have
        why = _claimed(path) or error
        raise ValueError(f"{path}: cannot be read as a packed buffer: {why}") from None
    stamp = FileStamp.of(Path(path), status) if isinstance(packed, np.memmap) else None
    return PackedFile(path, ".npy", packed, None, stamp=stamp)


def _plain(path: Path, header: safetensors.Header, buffer: NDArray[np.uint8]) -> NDArray[Any]:
    """The tensor named ``packed`` of a plain safetensors file, or its only one, flattened."""
    safetensors.check_tiling(header.entries, header.size - header.data_start, path)
    by_name = {e.name: e for e in header.entries}
    entry = by_name.get("packed", header.entries[0] if len(by_name) == 1 else None)
    if entry is None:
        raise FixtureError(
            f"{path}: a safetensors file with tensors {', '.join(sorted(by_name)) or 'none'}: "
            "name the packed gradient 'packed', or write it alone"
        )
    start = header.data_start
    return buffer[start + entry.start : start + entry.end].view(entry.dtype).reshape(-1)


def _contents(path: Path) -> tuple[NDArray[np.uint8], FileStamp | None]:
    """The whole file as read-only bytes, read or memory-mapped as a fixture is."""
    with safetensors.reading(path), open_regular(path) as file:
        status = os.fstat(file.fileno())
        if status.st_size < _mapping.MAP_THRESHOLD:
            return read_all(file, status.st_size, path), None
        return map_file(file, status, path)


def _zipped(path: str, file: Path) -> PackedFile:
    """The packed gradient of a ``.npz`` or a ``torch.save`` file (both zip archives)."""
    try:
        with zipfile.ZipFile(file) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError) as error:
        raise ValueError(
            f"{path}: not a .npz or torch.save file ({error}; torch.save's format before "
            "PyTorch 1.6 is not read: save with torch 1.6 or later)"
        ) from None
    room, total = available_memory(), sum(m.file_size for m in members)
    if room is not None and total > room[0]:  # from the zip's directory, before inflating
        raise ValueError(
            f"{path}: its {len(members)} members say they hold {human_bytes(total)} in all, "
            f"more than the {human_bytes(room[0])} available ({room[1]})"
        )
    if any(m.filename.endswith("/data.pkl") or m.filename == "data.pkl" for m in members):
        return _arrays(path, ".pt", _torch_arrays(path, file))
    others = [m.filename for m in members if not m.filename.endswith(".npy")]
    if others or not members:
        raise ValueError(
            f"{path}: a zip archive that is neither a .npz (members all .npy) nor a torch.save "
            f"file; it holds {', '.join(others[:3]) or 'nothing'}"
        )
    with np.load(file, allow_pickle=False) as archive:
        try:
            arrays = {name: np.asarray(archive[name]) for name in archive.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
            raise ValueError(f"{path}: cannot be read as a .npz: {error}") from None
    return _arrays(path, ".npz", arrays)


def _torch_arrays(path: str, file: Path) -> dict[str, NDArray[Any]]:
    """The tensors of a ``torch.save`` file, loaded with ``weights_only=True``, as arrays."""
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{path}: a torch.save file needs PyTorch to read: pip install torch"
        ) from None
    from .._arrays import as_packed

    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # torch's own errors: not a file it reads with weights only
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        # A refused pickle: torch's advice to load it unsafely first, then what it refused.
        pickled = isinstance(error, pickle.UnpicklingError) and len(lines) > 1
        why = lines[1] if pickled else lines[0] if lines else type(error).__name__
        raise ValueError(
            f"{path}: cannot be read by torch.load(weights_only=True), which runs no code "
            f"from the file: {why}"
        ) from None
    arrays = {}
    for name, value in loaded.items() if isinstance(loaded, dict) else [("", loaded)]:
        if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
            what = value.layout if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{path}: holds {what} under {name!r}; expected a dense tensor or a dict of "
                "dense tensors"
            )
        arrays[str(name)] = np.asarray(as_packed(value.detach(), f"{path}[{name!r}]", "compare"))
    return arrays


def _arrays(path: str, kind: str, arrays: dict[str, NDArray[Any]]) -> PackedFile:
    """The packed gradient among named ``arrays``: the only one, ``packed``, or the gradients
    by name (then packed, and their layout given)."""
    from ..packing import pack

    if "packed" in arrays or len(arrays) == 1:
        packed = arrays.get("packed", next(iter(arrays.values())))
        return PackedFile(path, kind, packed.reshape(-1), None)
    if not set(_GRADIENTS[:5]) <= set(arrays) or set(arrays) - set(_GRADIENTS):
        raise ValueError(
            f"{path}: holds {', '.join(sorted(arrays)) or 'nothing'}; expected one array, one "
            "named 'packed', or the gradients dq, dk, dv, dg, dbeta (and dstate)"
        )
    dq, dk, dv, dg, dbeta, dstate = (arrays.get(n) for n in _GRADIENTS)
    try:
        layout = GdnBackwardLayout.from_grads(dq, dk, dv, dg, dbeta, dstate)
        packed = pack(dq, dk, dv, dg, dbeta, dstate, layout=layout)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: its gradients do not pack: {error}") from None
    return PackedFile(path, kind, packed, layout)

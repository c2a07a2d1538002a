"""The fixture record, and its safetensors files."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Final, NamedTuple, cast

import numpy as np
from numpy.typing import DTypeLike, NDArray

from . import _safetensors as safetensors
from ._checks import non_negative_int
from ._criteria import Floors, decode_floors, encode_floors
from ._dtypes import resolve
from ._files import NotRegularFileError, atomic_write, open_regular
from ._safetensors import Entry, FixtureError, dtype_code, reason
from ._version import __version__
from .layout import GdnBackwardLayout
from .packing import GdnGrads, unpack

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAP_THRESHOLD",
    "REGIMES",
    "FileStamp",
    "Fixture",
    "FixtureError",
    "GdnInputs",
    "check_seed",
    "load_fixture",
    "resolve_dtype",
    "save_fixture",
]

#: The ``format`` metadata value that marks a gdn-layout fixture.
FORMAT: Final = "gdn-layout-fixture"
#: The ``format_version`` this module writes and the only one it reads.
FORMAT_VERSION: Final = 1
#: The gate regimes a fixture can record; :func:`gdn_layout.generate.draw_inputs` draws each.
#: New regimes go at the end: the standard suite numbers its files (and seeds) in this order.
REGIMES: Final = ("zero", "mild", "strong", "mixed", "qwen", "extreme")
#: The tensors of a fixture file, in the reference's argument order then ``y`` and ``packed``.
TENSOR_NAMES: Final = ("q", "k", "v", "g", "beta", "state", "dy", "y", "packed")
#: Files smaller than this many bytes (64 MiB) are read into memory by :func:`load_fixture`
#: even with ``mmap=True``: nothing another process does to the file can then change or break
#: the loaded fixture, and it holds no file descriptor. Larger files are memory-mapped.
MAP_THRESHOLD: Final = 64 * 2**20


class FileStamp(NamedTuple):
    """What tells a file's contents apart without reading them: its absolute path (``where``),
    size, modification time, inode and device, as :func:`os.stat` gives them."""

    where: str
    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path, status: os.stat_result) -> FileStamp:
        """The stamp of the file at ``path`` whose status is ``status``."""
        where = os.path.abspath(path)
        return cls(where, status.st_size, status.st_mtime_ns, status.st_ino, status.st_dev)

    def check(
        self, path: Path, now: FileStamp | None = None, when: str = "since it was loaded"
    ) -> None:
        """Raise :class:`FixtureError` naming ``path`` if the file is no longer the one stamped
        (``now``, or what :func:`os.stat` says of it now): truncated, grown, rewritten,
        replaced or gone.

        A rewrite that keeps the size and falls within the filesystem's timestamp granularity
        (nanoseconds to a few milliseconds on Linux) of the stamped one is not seen.
        """
        if now is None:
            try:
                now = FileStamp.of(path, os.stat(self.where))
            except OSError as err:
                raise FixtureError(
                    f"{path}: changed {when}: it cannot be reached now ({reason(err)}); "
                    "load it again"
                ) from None
        if (now.inode, now.device) != (self.inode, self.device):
            what = f"replaced by another file: inode {self.inode} then, {now.inode} now"
        elif now.size != self.size:
            what = f"{self.size} bytes then, {now.size} now"
        elif now.mtime_ns != self.mtime_ns:
            what = f"rewritten: modified at {self.mtime_ns} ns then, {now.mtime_ns} now"
        else:
            return
        raise FixtureError(
            f"{path}: changed {when} ({what}): its memory-mapped tensors are not what was "
            "loaded; load it again"
        )


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
    :func:`load_fixture` has read-only arrays (``path`` says from which file): read into
    memory, or for a large file memory-mapped (``mapped``; see :meth:`check_unchanged`).

    >>> import gdn_layout as gl
    >>> from gdn_layout.generate import draw_inputs
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
    #: The precision floors measured when the fixture was made (see :mod:`gdn_layout.compare`):
    #: ``{dtype: {gradient: (rms, max)}}``, or None.
    floors: Floors | None = field(default=None, kw_only=True)
    #: The file this fixture was loaded from, and the gdn-layout version that wrote it.
    path: Path | None = field(default=None, kw_only=True)
    writer_version: str | None = field(default=None, kw_only=True)
    #: The file the arrays are memory-mapped from, as it was when loaded; None when they are
    #: in memory. Set by :func:`load_fixture`.
    _stamp: FileStamp | None = field(default=None, kw_only=True, repr=False)
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
        dtype_code(dtype, "Fixture: q")
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
    def mapped(self) -> bool:
        """Whether the tensors are memory-mapped from ``path`` (a file of
        :data:`MAP_THRESHOLD` bytes or more) rather than held in memory."""
        return self._stamp is not None

    def check_unchanged(self) -> None:
        """Raise :class:`FixtureError` if the file this fixture is mapped from has changed
        since it was loaded; do nothing for a fixture held in memory.

        A mapped fixture reads its file whenever its tensors are read: a file cut short under
        the mapping kills the process with SIGBUS on the next read (or, within its last page,
        reads zeros), and a rewrite changes the values. Calling this before judging a kernel
        against the fixture, and again after, makes either a :class:`FixtureError` naming the
        file; :meth:`~gdn_layout.suites.Case.compare` and ``gdn-layout compare`` do. The file
        is compared by size, modification time and inode, not read.

        Raises
        ------
        FixtureError
            The mapped file was truncated, grown, rewritten, replaced or removed.
        """
        if self._stamp is not None and self.path is not None:
            self._stamp.check(self.path)

    @property
    def inputs(self) -> GdnInputs:
        """``q, k, v, g, beta, dy, state`` in the reference's argument order."""
        return GdnInputs(self.q, self.k, self.v, self.g, self.beta, self.dy, self.state)

    def tensors(self) -> dict[str, NDArray[Any]]:
        """The file's tensors by name: ``state`` only when carried."""
        named = {name: getattr(self, name) for name in TENSOR_NAMES}
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
        if self.floors is not None:
            meta["floors"] = encode_floors(self.floors)
        return meta


def _expected_shape(layout: GdnBackwardLayout, name: str) -> tuple[int, ...]:
    return (layout.total_elems,) if name == "packed" else layout.input_shape(name)


def check_seed(value: object, where: str) -> int:
    """A seed as NumPy's generators take it: a non-negative integer, NumPy's included."""
    return non_negative_int(value, f"{where}: seed")


def resolve_dtype(dtype: DTypeLike, where: str) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype a fixture can hold; ``"bfloat16"`` works as a string."""
    try:
        resolved = resolve(dtype, where)
    except TypeError:
        raise TypeError(
            f"{where}: dtype must be float64, float32, float16 or bfloat16, got {dtype!r}"
        ) from None
    dtype_code(resolved, where)
    return resolved


def _check_provenance(regime: object, seed: object, compute_dtype: object, where: str) -> None:
    if regime is not None and regime not in REGIMES:
        raise ValueError(f"{where}: regime must be one of {REGIMES} or None, got {regime!r}")
    if seed is not None:
        check_seed(seed, where)
    if compute_dtype is not None and not isinstance(compute_dtype, str):
        raise ValueError(f"{where}: compute_dtype must be a str or None, got {compute_dtype!r}")


# -- files ---------------------------------------------------------------------------------------


def save_fixture(
    path: str | os.PathLike[str], fixture: Fixture, *, overwrite: bool = False
) -> Path:
    """Write ``fixture`` to ``path`` as a safetensors file, atomically; return the path.

    The file is written to a temporary file in the same folder, flushed to disk, then renamed
    over ``path``: a reader sees the old file or the new one, never half of one, and a failure
    leaves nothing behind. An existing ``path`` is replaced only with ``overwrite=True``;
    otherwise :class:`FileExistsError` is raised. On Linux the temporary file has no name
    until it is linked in place (``O_TMPFILE``), so that nothing is left even if the writer
    is killed; elsewhere its name carries the writer's process id, and a later write into the
    folder removes it once that process is gone.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write.
    fixture : Fixture
        What to write.
    overwrite : bool
        Replace an existing file.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    FileExistsError
        ``path`` exists and ``overwrite`` is false.
    FileNotFoundError
        The folder of ``path`` does not exist.
    TypeError
        ``fixture`` is not a :class:`Fixture`.
    OSError
        The file cannot be written (a full disk, a read-only folder); the error names it.
    """
    if not isinstance(fixture, Fixture):
        raise TypeError(f"save_fixture: fixture must be a Fixture, got {type(fixture).__name__}")
    tensors = fixture.tensors()
    metadata = fixture.metadata()
    for name, array in tensors.items():
        dtype_code(array.dtype, name)  # before the file is created

    def write(out: IO[bytes]) -> None:
        safetensors.write(out, tensors, metadata)

    return atomic_write(Path(path), write, overwrite=overwrite)


def load_fixture(path: str | os.PathLike[str], *, mmap: bool = True) -> Fixture:
    """Read a fixture written by :func:`save_fixture` (or any conforming safetensors writer).

    A file smaller than :data:`MAP_THRESHOLD` (64 MiB) is read into memory, read-only, in
    one pass through one descriptor that is closed before this returns: what another process
    does to the file afterwards cannot change or break the fixture. With ``mmap=True`` (the
    default) a larger file is memory-mapped (:class:`numpy.memmap`, read-only), so that a
    multi-GiB fixture opens at once; with ``mmap=False`` it is read into memory too. A mapped
    fixture records its file's size, modification time and inode, and
    :meth:`Fixture.check_unchanged` (called by :meth:`~gdn_layout.suites.Case.compare`, and
    by ``gdn-layout compare``, before and after they read it) raises :class:`FixtureError`
    when the file has changed: truncated, rewritten or replaced.

    A file that is truncated, corrupt or inconsistent raises :class:`FixtureError` naming it
    and the problem; so does a path that is not a regular file (a folder, a FIFO, a device:
    refused before it is opened) or that cannot be read. A missing file raises
    :class:`FileNotFoundError` naming it; a bfloat16 file without ml_dtypes raises
    :class:`ImportError`.

    Parameters
    ----------
    path : str or os.PathLike
        The fixture file.
    mmap : bool
        Memory-map the tensors of a file of :data:`MAP_THRESHOLD` bytes or more rather than
        read them.

    Returns
    -------
    Fixture
        Its tensors read-only, ``path`` and ``writer_version`` set.

    Raises
    ------
    FixtureError
        The file is truncated, corrupt, not a gdn-layout fixture, inconsistent, has a header
        past the limits, is not a regular file, cannot be read, or changed while it was read.
    FileNotFoundError
        The file does not exist.
    ImportError
        The file holds bfloat16 and ml_dtypes is not installed.

    Notes
    -----
    A mapped file that is cut short while its tensors are being read (after the check that
    :meth:`Fixture.check_unchanged` makes) still ends the process with SIGBUS: Python cannot
    recover from a fault in NumPy's code. Only files of :data:`MAP_THRESHOLD` bytes or more,
    loaded with ``mmap=True``, are exposed to it.
    """
    return _load(Path(path), mmap=mmap)


def load_checked(path: Path, *, size: int | None, sha256: str, said: str) -> Fixture:
    """:func:`load_fixture`, refusing a file whose size or SHA-256 is not the given one.

    The size is checked on the open file before anything is read from it; the digest is of
    the bytes the fixture then holds (read into memory), or, for a mapped file, of the file
    read through the descriptor it is then mapped from, whose size, modification time and
    inode must not change in between. ``said`` introduces the expected values in messages
    ("the manifest says").

    Raises
    ------
    FixtureError
        As :func:`load_fixture`, and for a size or a digest that differs.
    FileNotFoundError
        The file does not exist.
    """
    return _load(path, mmap=True, size=size, sha256=sha256, said=said)


class _Plan(NamedTuple):
    """What a checked header says a fixture is: its metadata and tensors."""

    metadata: dict[str, str]
    entries: list[Entry]
    data_start: int
    size: int


def _load(
    path: Path,
    *,
    mmap: bool,
    size: int | None = None,
    sha256: str | None = None,
    said: str = "expected",
) -> Fixture:
    try:
        with open_regular(path) as file:
            status = os.fstat(file.fileno())
            if size is not None and status.st_size != size:
                raise FixtureError(f"{path}: {status.st_size} bytes, {said} {size}")
            if mmap and status.st_size >= MAP_THRESHOLD:
                return _load_mapped(path, file, status, sha256, said)
            data = read_all(file, status.st_size, path)
    except FileNotFoundError:
        raise
    except NotRegularFileError as err:
        raise FixtureError(str(err)) from None
    except OSError as err:
        raise FixtureError(f"{path}: cannot be read: {reason(err)}") from None
    if sha256 is not None:
        _check_digest(hashlib.sha256(data.data).hexdigest(), sha256, path, said)
    plan = _plan(
        path, safetensors.parse_header(safetensors.reader_of_buffer(data), data.size, path)
    )
    return _build(path, plan, data, None)


def _load_mapped(
    path: Path, file: BinaryIO, status: os.stat_result, sha256: str | None, said: str
) -> Fixture:
    """The fixture in the open ``file``, mapped: its header is read, and the file hashed,
    through ``file`` (reads, unlike a mapping, cannot fault), then the same file is mapped."""
    plan = _plan(
        path, safetensors.parse_header(safetensors.reader_of_file(file), status.st_size, path)
    )
    if sha256 is not None:
        file.seek(0)
        _check_digest(
            hashlib.file_digest(_buffered(file), "sha256").hexdigest(), sha256, path, said
        )
    buffer, stamp = map_file(file, status, path)
    return _build(path, plan, buffer, stamp)


def map_file(
    file: BinaryIO, status: os.stat_result, path: Path
) -> tuple[NDArray[np.uint8], FileStamp]:
    """The open ``file`` memory-mapped read-only, and the stamp of ``status``, its status
    when it was opened: :class:`FixtureError` if it has changed since."""
    stamp = FileStamp.of(path, status)
    try:
        buffer: NDArray[np.uint8] = (
            np.memmap(file, dtype=np.uint8, mode="r", shape=(status.st_size,))
            if status.st_size
            else np.empty(0, np.uint8)  # mmap cannot map an empty file
        )
    except ValueError as err:  # the file shrank since it was opened
        raise FixtureError(f"{path}: changed while being read: {err}") from None
    stamp.check(path, FileStamp.of(path, os.fstat(file.fileno())), "while being read")
    return buffer, stamp


def read_all(file: BinaryIO, size: int, path: Path) -> NDArray[np.uint8]:
    """All ``size`` bytes of the open ``file`` as a read-only array, read from its start;
    :class:`FixtureError` if the file turns out shorter or longer."""
    buffer = np.empty(size, np.uint8)
    view, stream = buffer.data, _buffered(file)
    file.seek(0)
    done = 0
    while done < size:
        count = stream.readinto(view[done:])
        if not count:
            break
        done += count
    if done < size or file.read(1):
        now = f"{done} bytes" if done < size else "more"
        raise FixtureError(f"{path}: changed size while being read ({size} bytes, then {now})")
    buffer.flags.writeable = False
    return buffer


def _buffered(file: BinaryIO) -> io.BufferedIOBase:
    """``file`` as what :func:`~gdn_layout._files.open_regular` returns, with ``readinto``."""
    return cast(io.BufferedIOBase, file)


def _check_digest(digest: str, expected: str, path: Path, said: str) -> None:
    if digest != expected:
        raise FixtureError(f"{path}: SHA-256 {digest}, {said} {expected}")


def _plan(path: Path, header: safetensors.Header) -> _Plan:
    metadata = _parse_metadata(header.metadata, path)
    layout = _layout_of(metadata, path)
    _check_entries(header.entries, layout, path)
    safetensors.check_tiling(header.entries, header.size - header.data_start, path)
    return _Plan(metadata, header.entries, header.data_start, header.size)


def _build(path: Path, plan: _Plan, buffer: NDArray[np.uint8], stamp: FileStamp | None) -> Fixture:
    if buffer.size != plan.size:
        raise FixtureError(f"{path}: changed size while being read ({plan.size} -> {buffer.size})")
    start, metadata = plan.data_start, plan.metadata
    arrays = {
        e.name: buffer[start + e.start : start + e.end].view(e.dtype).reshape(e.shape)
        for e in plan.entries
    }
    try:
        seed = int(metadata["seed"]) if "seed" in metadata else None
        floors = decode_floors(metadata["floors"]) if "floors" in metadata else None
        return Fixture(
            **arrays,
            regime=metadata.get("regime"),
            seed=seed,
            compute_dtype=metadata.get("compute_dtype"),
            floors=floors,
            path=path,
            writer_version=metadata.get("gdn_layout_version"),
            _stamp=stamp,
        )
    except (TypeError, ValueError) as err:
        raise FixtureError(f"{path}: {err}") from None


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


def _check_entries(entries: list[Entry], layout: GdnBackwardLayout, path: Path) -> None:
    names = {e.name for e in entries}
    required = set(TENSOR_NAMES) - (set() if layout.carry_state else {"state"})
    missing = [n for n in TENSOR_NAMES if n in required - names]
    if missing:
        raise FixtureError(f"{path}: missing tensor(s) {', '.join(missing)} required by {layout!r}")
    unexpected = sorted(names - required)
    if unexpected:
        raise FixtureError(f"{path}: unexpected tensor(s) {', '.join(unexpected)} for {layout!r}")
    by_name = {e.name: e for e in entries}
    for name in TENSOR_NAMES:
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


# -- any packed buffer --------------------------------------------------------------------------

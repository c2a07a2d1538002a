"""The fixture record and its safetensors files (README.md, *Fixtures*; docs/files.md)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Final, NamedTuple

import numpy as np
from numpy.typing import DTypeLike, NDArray

from .._checks import integer
from .._dtypes import resolve
from .._floors import Floors, decode_floors, encode_floors, term_scales
from .._version import __version__
from ..layout import GdnBackwardLayout
from ..packing import GdnGrads, unpack
from ..regimes import REGIMES
from . import _mapping
from . import _safetensors as safetensors
from ._atomic import atomic_write, open_regular
from ._mapping import MAP_THRESHOLD, FileStamp, check_digest, held, map_file, read_all
from ._safetensors import Entry, FixtureError, dtype_code

__all__ = ["FORMAT", "FORMAT_VERSION", "MAP_THRESHOLD", "Fixture", "FixtureError", "GdnInputs"]
__all__ += ["load_fixture", "save_fixture"]

#: The ``format`` metadata value that marks a gdn-layout fixture.
FORMAT: Final = "gdn-layout-fixture"
#: The ``format_version`` this module writes and the only one it reads.
FORMAT_VERSION: Final = 1
#: The tensors of a fixture file, in the reference's argument order then ``y`` and ``packed``.
TENSOR_NAMES: Final = ("q", "k", "v", "g", "beta", "state", "dy", "y", "packed")
#: The states a fixture may also hold (the final state; with ``states_chunk``, h and dh).
STATE_NAMES: Final = ("final_state", "h", "dh")
#: The tensors besides the gradients that have precision floors (``state_floors``).
STATE_FLOOR_NAMES: Final = ("y", *STATE_NAMES)


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

    The layout is inferred from ``q``, ``g`` and ``state``, every other tensor checked against
    it; all share one dtype. ``grads`` are the views of ``packed``. See docs/files.md.

    Examples
    --------
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
    #: The precision floors measured when it was made: ``{dtype: {gradient: (rms, max)}}``.
    floors: Floors | None = field(default=None, kw_only=True)
    #: The state after the last step, ``[B, H, N, N]``, or None.
    final_state: NDArray[Any] | None = field(default=None, kw_only=True)
    #: The state entering each chunk of ``states_chunk`` steps and its cotangent,
    #: ``[B, ceil(S / states_chunk), H, N, N]`` each, or None.
    h: NDArray[Any] | None = field(default=None, kw_only=True)
    dh: NDArray[Any] | None = field(default=None, kw_only=True)
    states_chunk: int | None = field(default=None, kw_only=True)
    #: The floors of ``y`` and the states, as ``floors`` are of the gradients, or None.
    state_floors: Floors | None = field(default=None, kw_only=True)
    #: The file this fixture was loaded from, and the gdn-layout version that wrote it.
    path: Path | None = field(default=None, kw_only=True)
    writer_version: str | None = field(default=None, kw_only=True)
    #: The mapped file as it was when loaded; None when the arrays are in memory.
    stamp: FileStamp | None = field(default=None, kw_only=True, repr=False)
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
        states = {n: getattr(self, n) is not None for n in ("h", "dh", "states_chunk")}
        if len(set(states.values())) > 1:
            raise ValueError(
                "Fixture: h, dh and states_chunk are given together or not at all; got "
                + ", ".join(f"{n} {'given' if s else 'None'}" for n, s in states.items())
            )
        if self.states_chunk is not None:
            chunk = integer(self.states_chunk, "Fixture: states_chunk", least=1, or_none=True)
            object.__setattr__(self, "states_chunk", chunk)  # a Python int, as a file holds
        for name, array in arrays.items():
            expected = tensor_shape(layout, name, self.states_chunk)
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
        """Whether the tensors are memory-mapped from ``path`` rather than held in memory."""
        return self.stamp is not None

    def check_unchanged(self) -> None:
        """Raise :class:`FixtureError` if the mapped file changed since it was loaded."""
        if self.stamp is not None and self.path is not None:
            self.stamp.check(self.path)

    def unchanged(self) -> contextlib.AbstractContextManager[None]:
        """A context in which a mapped fixture is judged: its file is checked against its
        stamp on entry and on exit (writers are not held off); see docs/files.md.

        Raises
        ------
        FixtureError
            The mapped file changed since it was loaded, or while the block ran.
        """
        return held(self.stamp, self.path or Path(self.stamp.where if self.stamp else ""))

    @functools.cached_property
    def scales(self) -> dict[str, float]:
        """The scale of the terms forming each gradient that can be far below them,
        ``{"dg": ...}``, for :func:`~gdn_layout.compare`'s ``scales=``; computed once."""
        per_channel = self.layout.gate_per_channel
        return term_scales(self.q, self.k, self.grads.dq, self.grads.dk, per_channel=per_channel)

    @property
    def inputs(self) -> GdnInputs:
        """``q, k, v, g, beta, dy, state`` in the reference's argument order."""
        return GdnInputs._make(getattr(self, name) for name in GdnInputs._fields)

    def tensors(self) -> dict[str, NDArray[Any]]:
        """The file's tensors by name: ``state`` only when carried, the states when held."""
        named = {name: getattr(self, name) for name in (*TENSOR_NAMES, *STATE_NAMES)}
        return {name: array for name, array in named.items() if array is not None}

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` that :func:`save_fixture` writes for this fixture."""
        meta = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "gdn_layout_version": __version__,
            "layout": json.dumps(self.layout.to_dict(), sort_keys=True),
        }
        for key in ("seed", "regime", "compute_dtype"):
            if getattr(self, key) is not None:
                meta[key] = str(getattr(self, key))
        if self.floors is not None:
            meta["floors"] = encode_floors(self.floors)
        if self.states_chunk is not None:
            meta["states_chunk"] = str(self.states_chunk)
        if self.state_floors is not None:
            meta["state_floors"] = encode_floors(self.state_floors)
        return meta


def tensor_shape(layout: GdnBackwardLayout, name: str, chunk: int | None = None) -> tuple[int, ...]:
    """The shape of a fixture's tensor ``name`` for ``layout`` (``h`` and ``dh`` of chunks of
    ``chunk`` steps)."""
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    if name == "final_state":
        return (b, h, n, n)
    if name in ("h", "dh"):
        return (b, -(-s // chunk) if chunk else 0, h, n, n)
    return (layout.total_elems,) if name == "packed" else layout.input_shape(name)


def check_seed(value: object, where: str) -> int:
    """A seed as NumPy's generators take it: a non-negative integer, NumPy's included."""
    return integer(value, f"{where}: seed")


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


def save_fixture(
    path: str | os.PathLike[str], fixture: Fixture, *, overwrite: bool = False
) -> Path:
    """Write ``fixture`` to ``path`` as a safetensors file, atomically (docs/files.md);
    replace an existing regular file only with ``overwrite``. Return ``path``.

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
    tensors, metadata = fixture.tensors(), fixture.metadata()
    for name, array in tensors.items():
        dtype_code(array.dtype, name)  # before the file is created

    def write(out: IO[bytes]) -> None:
        safetensors.write(out, tensors, metadata)

    return atomic_write(Path(path), write, overwrite=overwrite)


def load_fixture(path: str | os.PathLike[str], *, mmap: bool = True) -> Fixture:
    """Read a fixture written by :func:`save_fixture` (or any conforming safetensors writer):
    its tensors read-only, ``path`` and ``writer_version`` set. A file of
    :data:`MAP_THRESHOLD` bytes or more is memory-mapped unless ``mmap`` is false
    (docs/files.md, *Memory mapping*).

    Raises
    ------
    FixtureError
        The file is truncated, corrupt, not a gdn-layout fixture, inconsistent, has a header
        past the limits, is not a regular file, cannot be read, or changed while it was read.
    FileNotFoundError
        The file does not exist.
    ImportError
        The file holds bfloat16 and ml_dtypes is not installed.
    """
    return _load(Path(path), mmap, None, None, "expected")


def load_checked(
    path: Path, *, size: int | None, sha256: str, said: str, dir_fd: int | None = None
) -> Fixture:
    """:func:`load_fixture` of a file whose size (checked first) and SHA-256 must be these
    (``said`` introduces them in messages), named in the open folder ``dir_fd``."""
    return _load(path, True, size, sha256, said, dir_fd)


def _load(
    path: Path,
    mmap: bool,
    size: int | None,
    sha256: str | None,
    said: str,
    dir_fd: int | None = None,
) -> Fixture:
    with safetensors.reading(path), open_regular(path, dir_fd=dir_fd) as file:
        status = os.fstat(file.fileno())
        if size is not None and status.st_size != size:
            raise FixtureError(f"{path}: {status.st_size} bytes, {said} {size}")
        if mmap and status.st_size >= _mapping.MAP_THRESHOLD:
            return _load_mapped(path, file, status, sha256, said)
        data = read_all(file, status.st_size, path)
    if sha256 is not None:
        check_digest(hashlib.sha256(data.data).hexdigest(), sha256, path, said)
    header = safetensors.parse_header(safetensors.of_buffer(data), data.size, path)
    return fixture_of(path, header, data, None)


def fixture_of(
    path: Path, header: safetensors.Header, buffer: NDArray[np.uint8], stamp: FileStamp | None
) -> Fixture:
    """The fixture whose file at ``path``, with this parsed ``header``, holds ``buffer``."""
    return _build(path, _metadata(path, header), header, buffer, stamp)


def _load_mapped(
    path: Path, file: BinaryIO, status: os.stat_result, sha256: str | None, said: str
) -> Fixture:
    """The fixture in the open ``file``, mapped once it is read and hashed (a read of a file
    cut short fails where a read of a mapping would fault)."""
    header = safetensors.parse_header(safetensors.of_file(file), status.st_size, path)
    metadata = _metadata(path, header)
    if sha256 is not None:
        file.seek(0)
        digest = hashlib.file_digest(file, "sha256").hexdigest()  # type: ignore[arg-type]
        check_digest(digest, sha256, path, said)
    buffer, stamp = map_file(file, status, path)
    return _build(path, metadata, header, buffer, stamp)


def _metadata(path: Path, header: safetensors.Header) -> dict[str, str]:
    """The metadata of a fixture's header, once the header is checked as a fixture's."""
    meta = header.metadata
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
    _check_entries(header.entries, _layout_of(meta, path), _chunk_of(meta, path), path)
    safetensors.check_tiling(header.entries, header.size - header.data_start, path)
    return meta


def _build(
    path: Path,
    metadata: dict[str, str],
    header: safetensors.Header,
    buffer: NDArray[np.uint8],  # of the header's size: both come from one status
    stamp: FileStamp | None,
) -> Fixture:
    start = header.data_start
    arrays = {
        e.name: buffer[start + e.start : start + e.end].view(e.dtype).reshape(e.shape)
        for e in header.entries
    }

    def floors(key: str, *names: Any) -> Floors | None:
        return decode_floors(metadata[key], *names) if key in metadata else None

    try:
        return Fixture(
            **arrays,
            regime=metadata.get("regime"),
            seed=int(metadata["seed"]) if "seed" in metadata else None,
            compute_dtype=metadata.get("compute_dtype"),
            floors=floors("floors"),
            states_chunk=_chunk_of(metadata, path),
            state_floors=floors("state_floors", STATE_FLOOR_NAMES, "state_floors"),
            path=path,
            writer_version=metadata.get("gdn_layout_version"),
            stamp=stamp,
        )
    except (TypeError, ValueError) as err:
        raise FixtureError(f"{path}: {err}") from None


def _layout_of(meta: Mapping[str, str], path: Path) -> GdnBackwardLayout:
    text = meta.get("layout")
    if text is None:
        raise FixtureError(f"{path}: metadata has no layout")
    try:
        return GdnBackwardLayout.from_dict(json.loads(text))
    except (ValueError, TypeError, RecursionError) as err:
        raise FixtureError(f"{path}: metadata layout {text!r:.200} does not parse: {err}") from None


def _chunk_of(meta: Mapping[str, str], path: Path) -> int | None:
    text = meta.get("states_chunk")
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 18 and int(text) > 0):
        raise FixtureError(
            f"{path}: metadata states_chunk must be a positive integer, got {text!r:.50}"
        )
    return int(text)


def _check_entries(
    entries: list[Entry], layout: GdnBackwardLayout, chunk: int | None, path: Path
) -> None:
    names = {e.name for e in entries}
    required = set(TENSOR_NAMES) - (set() if layout.carry_state else {"state"})
    states = {"h", "dh"} if chunk is not None else set()
    missing = [n for n in (*TENSOR_NAMES, "h", "dh") if n in (required | states) - names]
    if missing:
        raise FixtureError(f"{path}: missing tensor(s) {', '.join(missing)} required by {layout!r}")
    unexpected = sorted(names - required - states - {"final_state"})
    if unexpected:
        extra = "" if chunk is not None else " (h and dh come with metadata states_chunk)"
        raise FixtureError(
            f"{path}: unexpected tensor(s) {', '.join(unexpected)} for {layout!r}{extra}"
        )
    by_name = {e.name: e for e in entries}
    for entry in (by_name[n] for n in (*TENSOR_NAMES, *STATE_NAMES) if n in by_name):
        expected = tensor_shape(layout, entry.name, chunk)
        if entry.shape != expected:
            raise FixtureError(
                f"{path}: tensor {entry.name!r} has shape {entry.shape}, expected {expected} "
                f"for {layout!r}"
            )
        if entry.dtype != by_name["q"].dtype:
            raise FixtureError(
                f"{path}: tensor {entry.name!r} has dtype {entry.dtype}, expected "
                f"{by_name['q'].dtype} like 'q' (a fixture holds one dtype)"
            )

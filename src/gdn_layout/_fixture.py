"""The fixture record, and its safetensors files."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, NamedTuple

import numpy as np
from numpy.typing import DTypeLike, NDArray

from . import _safetensors as safetensors
from ._checks import non_negative_int
from ._criteria import Floors, decode_floors, encode_floors
from ._dtypes import resolve
from ._files import atomic_write, open_regular
from ._safetensors import Entry, FixtureError, dtype_code, reason
from ._version import __version__
from .layout import GdnBackwardLayout
from .packing import GdnGrads, unpack

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "REGIMES",
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

    Only the header is read and checked up front; with ``mmap=True`` (the default) the tensors
    are read-only :class:`numpy.memmap` views into the file, so that a multi-GiB fixture opens
    at once. With ``mmap=False`` the file is read into memory (still read-only). A file that
    is truncated, corrupt or inconsistent raises :class:`FixtureError` naming it and the
    problem; so does a path that is not a regular file (a folder, a FIFO, a device: refused
    before it is opened) or that cannot be read. A missing file raises
    :class:`FileNotFoundError` naming it; a bfloat16 file without ml_dtypes raises
    :class:`ImportError`.

    Parameters
    ----------
    path : str or os.PathLike
        The fixture file.
    mmap : bool
        Memory-map the tensors rather than read them.

    Returns
    -------
    Fixture
        Its tensors read-only, ``path`` and ``writer_version`` set.

    Raises
    ------
    FixtureError
        The file is truncated, corrupt, not a gdn-layout fixture, inconsistent, has a header
        past the limits, is not a regular file, or cannot be read.
    FileNotFoundError
        The file does not exist.
    ImportError
        The file holds bfloat16 and ml_dtypes is not installed.
    """
    path = Path(path)
    header = safetensors.read_header(path)
    metadata = _parse_metadata(header.metadata, path)
    entries, size, data_start = header.entries, header.size, header.data_start
    layout = _layout_of(metadata, path)
    _check_entries(entries, layout, path)
    safetensors.check_tiling(entries, size - data_start, path)

    buffer = _map_or_read(path, mmap)
    if buffer.size != size:
        raise FixtureError(f"{path}: changed size while being read ({size} -> {buffer.size})")
    arrays = {
        e.name: buffer[data_start + e.start : data_start + e.end].view(e.dtype).reshape(e.shape)
        for e in entries
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
        )
    except (TypeError, ValueError) as err:
        raise FixtureError(f"{path}: {err}") from None


def _map_or_read(path: Path, mmap: bool) -> NDArray[np.uint8]:
    """The whole file as read-only bytes: mapped, or read into memory."""
    try:
        with open_regular(path) as file:
            if not mmap:
                buffer = np.fromfile(file, dtype=np.uint8)
                buffer.flags.writeable = False
                return buffer
            if os.fstat(file.fileno()).st_size == 0:  # mmap cannot map an empty file
                return np.empty(0, np.uint8)
            mapped: NDArray[np.uint8] = np.memmap(file, dtype=np.uint8, mode="r")
            return mapped
    except FileNotFoundError:
        raise
    except OSError as err:
        raise FixtureError(f"{path}: cannot be read: {reason(err)}") from None
    except ValueError as err:  # mmap: the file shrank since its header was read
        raise FixtureError(f"{path}: changed while being read: {err}") from None


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

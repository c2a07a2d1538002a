"""Views into a packed gradient buffer, and gradients packed into one (README.md, *unpack,
pack, empty*)."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from ._arrays import as_packed
from ._checks import not_a_layout
from ._dtypes import is_floating, resolve
from ._stats import grads_html, grads_text
from .layout import GRADIENT_NAMES, GdnBackwardLayout, gradient_shapes

__all__ = ["GdnGrads", "empty", "pack", "unpack", "zeros"]

Casting = Literal["no", "equiv", "safe", "same_kind", "unsafe"]
_CASTINGS = ("no", "equiv", "safe", "same_kind", "unsafe")


class GdnGrads(NamedTuple):
    """The gradients of ``GatedDeltaNetBackward`` in packing order, ``dstate`` None when the
    state is not carried; ``str()`` and a notebook show each one's statistics."""

    dq: NDArray[Any]
    dk: NDArray[Any]
    dv: NDArray[Any]
    dg: NDArray[Any]
    dbeta: NDArray[Any]
    dstate: NDArray[Any] | None = None

    def __str__(self) -> str:
        """Per-gradient statistics."""
        return grads_text(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return grads_html(self)


def unpack(flat: NDArray[Any], layout: GdnBackwardLayout) -> GdnGrads:
    """Split a packed buffer ``(..., layout.total_elems)`` into views of it, shaped ``(...,
    *shape)``: never a copy, so a write to a view writes to ``flat``.

    Raises
    ------
    TypeError
        ``flat`` is not an ndarray, or ``layout`` not a :class:`GdnBackwardLayout`.
    ValueError
        The last axis of ``flat`` is not ``layout.total_elems`` long.

    Examples
    --------
    >>> import numpy as np
    >>> layout = GdnBackwardLayout(batch=1, seq=2, heads=1, state_size=2, carry_state=True)
    >>> flat = np.arange(layout.total_elems, dtype=np.float32)
    >>> grads = unpack(flat, layout)
    >>> grads.dk.ravel(), grads.dstate.shape, np.shares_memory(grads.dstate, flat)
    (array([4., 5., 6., 7.], dtype=float32), (1, 1, 2, 2), True)
    """
    if not isinstance(flat, np.ndarray):
        raise TypeError(f"unpack: flat must be a NumPy array, got {type(flat).__name__}")
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "unpack")
    if flat.ndim == 0 or flat.shape[-1] != layout.total_elems:
        received = "a 0-d array" if flat.ndim == 0 else f"shape {flat.shape}"
        raise ValueError(
            f"unpack: flat must have layout.total_elems = {layout.total_elems} elements "
            f"along its last axis, got {received}, for {layout!r}"
        )
    lead = flat.shape[:-1]
    return GdnGrads(
        *[
            flat[..., s.offset : s.offset + s.length].reshape(lead + s.shape)
            for s in layout.segments()
        ]
    )


def pack(
    dq: ArrayLike,
    dk: ArrayLike,
    dv: ArrayLike,
    dg: ArrayLike,
    dbeta: ArrayLike,
    dstate: ArrayLike | None = None,
    *,
    layout: GdnBackwardLayout | None = None,
    out: NDArray[Any] | None = None,
    dtype: DTypeLike | None = None,
    casting: Casting = "same_kind",
) -> NDArray[Any]:
    """Pack gradients (arrays, or tensors read as :func:`~gdn_layout.compare` reads them) into
    one 1-D buffer in rlx-ir's order; the inverse of :func:`unpack`.

    The layout is inferred from ``dq``, ``dg`` and ``dstate`` unless given, and every shape
    checked. The result is ``out`` (which the inputs may overlap), else a new array of ``dtype``
    or ``np.result_type`` of the gradients, cast by ``casting``. Nothing is written unless
    every check passes.

    Raises
    ------
    TypeError
        ``layout`` or ``out`` has the wrong type, a cast is not allowed by ``casting``, ``dtype``
        conflicts with ``out``, or the packed dtype is not numeric.
    ValueError
        A shape does not match the layout, ``dstate`` does not match ``carry_state``, ``out``
        is not 1-D of ``total_elems`` or is read-only, or ``casting`` is unknown.

    Examples
    --------
    >>> import numpy as np
    >>> layout = GdnBackwardLayout(batch=1, seq=2, heads=1, state_size=2)
    >>> buf = np.arange(layout.total_elems, dtype=np.float64)
    >>> grads = unpack(buf, layout)
    >>> bool((pack(*grads) == buf).all()), pack(*grads, dtype="f4").dtype
    (True, dtype('float32'))
    """
    given = (dq, dk, dv, dg, dbeta) if dstate is None else (dq, dk, dv, dg, dbeta, dstate)
    arrays = [x if isinstance(x, np.ndarray) else _array(x) for x in given]
    expected: tuple[tuple[int, ...], ...] = ()
    if layout is None:
        if len(shape := arrays[0].shape) == 4:
            b, s, h, n = shape
            expected = gradient_shapes(b, s, h, n, arrays[3].ndim == 4, dstate is not None)
    elif not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "pack")
    elif (dstate is None) == layout.carry_state:
        wrong = "missing" if layout.carry_state else "given"
        raise ValueError(
            f"pack: dstate is {wrong}, but the layout has carry_state={layout.carry_state}: "
            f"{layout!r}"
        )
    else:
        expected = layout.shapes
    # One comparison of shapes when all is well; a layout is made only to say what is wrong.
    if tuple([a.shape for a in arrays]) != expected:
        _raise_shape_error(arrays, layout)
    if casting not in _CASTINGS:
        raise ValueError(f"pack: casting must be one of {_CASTINGS}, got {casting!r}")
    wanted = None if dtype is None else resolve(dtype, "pack: dtype")
    if out is None:
        try:
            packed = np.concatenate(_raveled(arrays), dtype=wanted, casting=casting)
        except TypeError:  # a cast casting refuses: say which gradient
            _raise_cast_error(arrays, wanted, casting)
            raise
        if not (packed.dtype.kind in "biufc" or is_floating(packed.dtype)):
            raise TypeError(
                f"pack: gradients are numbers; the packed dtype would be {packed.dtype}"
            )
        return packed
    if not isinstance(out, np.ndarray):
        check_out(out, layout or GdnBackwardLayout.from_grads(*arrays), "pack")
    if wanted is not None and wanted != out.dtype:
        raise TypeError(f"pack: dtype={wanted} conflicts with out.dtype={out.dtype}; give one")
    # Every cast checked before any write, so that nothing is half-written; when the arrays'
    # common type is out's, each casts to it safely, which every rule but these two allows.
    if casting in ("no", "equiv") or np.result_type(*arrays) != out.dtype:
        _raise_cast_error(arrays, out.dtype, casting)
    # An input that overlaps out is copied first, so that no write clobbers what is still to
    # be read; memory an array owns is no other's, so only views can overlap.
    if not out.flags.owndata or any([a.base is not None for a in arrays]):
        arrays = [a.copy() if np.may_share_memory(a, out) else a for a in arrays]
    try:  # NumPy checks out's size, rank and writeability before it writes
        return np.concatenate(_raveled(arrays), out=out, casting=casting)
    except ValueError:
        check_out(out, layout or GdnBackwardLayout.from_grads(*arrays), "pack")
        raise


def _raveled(arrays: list[NDArray[Any]]) -> list[NDArray[Any]]:
    """Each array flattened in C order: a view where it is contiguous, else a copy. (NumPy's
    ``concatenate(axis=None)`` does the same but costs a small pack twice as much.)"""
    return [a.ravel() for a in arrays]


def _array(x: object) -> NDArray[Any]:
    """A gradient as an ndarray; a tensor with ``__dlpack__`` read as ``compare`` reads it."""
    return as_packed(x, "a gradient", "pack") if hasattr(x, "__dlpack__") else np.asarray(x)


def _raise_cast_error(arrays: list[NDArray[Any]], target: Any, casting: Casting) -> None:
    """The error naming the first gradient that ``casting`` does not allow to cast."""
    if target is None:
        target = np.result_type(*arrays)
    for name, a in zip(GRADIENT_NAMES, arrays, strict=False):
        if a.dtype != target and not np.can_cast(a.dtype, target, casting=casting):
            raise TypeError(
                f"pack: cannot cast {name} from {a.dtype} to {target} with casting={casting!r}"
            )


def _raise_shape_error(arrays: list[NDArray[Any]], layout: GdnBackwardLayout | None) -> None:
    """The error that names the gradient of a wrong shape."""
    if layout is None:
        try:
            layout = GdnBackwardLayout.from_grads(*arrays)
        except (TypeError, ValueError) as error:
            # Inferred from dq, a wrong dq makes the others look wrong: when dk's layout fits
            # every gradient but dq, name dq.
            try:
                dk_layout = GdnBackwardLayout.from_grads(arrays[1], *arrays[1:])
            except (TypeError, ValueError):
                raise type(error)(f"pack: {error}") from None
            raise ValueError(
                f"pack: dq has shape {arrays[0].shape}, expected {dk_layout.shape('dq')} for "
                f"{dk_layout!r}, the layout of the other gradients"
            ) from None
    for seg, array in zip(layout.segments(), arrays, strict=True):
        if array.shape != seg.shape:
            raise ValueError(
                f"pack: {seg.name} has shape {array.shape}, expected {seg.shape} for {layout!r}"
            )


def check_out(out: Any, layout: GdnBackwardLayout, func: str) -> None:
    """``out`` must be a writeable ndarray of shape ``(layout.total_elems,)``."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{func}: out must be a NumPy array, got {type(out).__name__}")
    if out.shape != (layout.total_elems,):
        raise ValueError(
            f"{func}: out must have shape ({layout.total_elems},) for {layout!r}, got {out.shape}"
        )
    if not out.flags.writeable:
        raise ValueError(f"{func}: out must be writeable, got a read-only array")


def empty(
    layout: GdnBackwardLayout, dtype: DTypeLike = np.float32
) -> tuple[NDArray[Any], GdnGrads]:
    """An uninitialised packed buffer of ``dtype`` and its views, ``unpack(flat, layout)``,
    for a backward to write in place.

    >>> import numpy as np
    >>> flat, grads = empty(GdnBackwardLayout(1, 4, 2, 8), dtype=np.float64)
    >>> grads.dq[...] = 1.0  # writes into flat
    >>> flat.shape, bool(flat[:64].sum() == 64)
    ((208,), True)
    """
    return _buffer(np.empty, layout, dtype, "empty")


def zeros(
    layout: GdnBackwardLayout, dtype: DTypeLike = np.float32
) -> tuple[NDArray[Any], GdnGrads]:
    """:func:`empty`, zeroed: for a backward that accumulates in place.

    >>> flat, grads = zeros(GdnBackwardLayout(1, 4, 2, 8, carry_state=True))
    >>> grads.dstate.shape, float(flat.sum())
    ((1, 2, 8, 8), 0.0)
    """
    return _buffer(np.zeros, layout, dtype, "zeros")


def _buffer(
    make: Any, layout: GdnBackwardLayout, dtype: DTypeLike, func: str
) -> tuple[NDArray[Any], GdnGrads]:
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout)
    flat = make(layout.total_elems, dtype=resolve(dtype, f"{func}: dtype"))
    return flat, unpack(flat, layout)

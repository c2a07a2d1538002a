"""Views into a packed gradient buffer, and packing gradients into one."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from ._arrays import as_packed
from ._checks import not_a_layout
from ._dtypes import is_floating, resolve
from ._stats import grads_html, grads_text
from .layout import GdnBackwardLayout

__all__ = ["GdnGrads", "empty", "pack", "unpack", "zeros"]

#: tuple.__new__, to build a GdnGrads from a list of six without its keyword handling.
_new_tuple = tuple.__new__

Casting = Literal["no", "equiv", "safe", "same_kind", "unsafe"]
_CASTINGS = ("no", "equiv", "safe", "same_kind", "unsafe")


class GdnGrads(NamedTuple):
    """The gradients of ``GatedDeltaNetBackward``, in packing order.

    ``dq, dk, dv`` are ``[B, S, H, N]``; ``dg`` is ``[B, S, H]`` or ``[B, S, H, N]``;
    ``dbeta`` is ``[B, S, H]``; ``dstate`` is ``[B, H, N, N]``, or None when the state is not
    carried.

    See Also
    --------
    unpack : A packed buffer as these views.
    pack : These gradients into a packed buffer.
    """

    dq: NDArray[Any]
    dk: NDArray[Any]
    dv: NDArray[Any]
    dg: NDArray[Any]
    dbeta: NDArray[Any]
    dstate: NDArray[Any] | None = None

    def __str__(self) -> str:
        """Per-gradient statistics: shape, dtype, min, max, mean, RMS, NaN and Inf counts."""
        return grads_text(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return grads_html(self)


def unpack(flat: NDArray[Any], layout: GdnBackwardLayout) -> GdnGrads:
    """Split a packed gradient buffer into shaped views. Never copies.

    Every field of the result is a view of ``flat``: writing to it writes to ``flat``, a
    read-only ``flat`` gives read-only views, and a memory-mapped one gives file-backed views.
    Any dtype and any strides work. Leading axes are kept: a ``(..., total_elems)`` input gives
    fields of shape ``(..., *shape)``.

    Parameters
    ----------
    flat : numpy.ndarray
        The packed buffer, ``(..., layout.total_elems)``.
    layout : GdnBackwardLayout
        Where each gradient sits.

    Returns
    -------
    GdnGrads
        Views of ``flat``; ``dstate`` is None when the state is not carried.

    Raises
    ------
    TypeError
        ``flat`` is not an ndarray, or ``layout`` not a :class:`GdnBackwardLayout`.
    ValueError
        The last axis of ``flat`` is not ``layout.total_elems`` long.

    See Also
    --------
    pack : The inverse: gradients into one buffer.
    GdnBackwardLayout : Where each gradient sits.

    Examples
    --------
    >>> import numpy as np
    >>> layout = GdnBackwardLayout(batch=1, seq=2, heads=1, state_size=2, carry_state=True)
    >>> flat = np.arange(layout.total_elems, dtype=np.float32)
    >>> grads = unpack(flat, layout)
    >>> grads.dk
    array([[[[4., 5.]],
    <BLANKLINE>
            [[6., 7.]]]], dtype=float32)
    >>> grads.dstate.shape, np.shares_memory(grads.dstate, flat)
    ((1, 1, 2, 2), True)
    """
    if not isinstance(flat, np.ndarray):
        raise TypeError(f"unpack: flat must be a NumPy array, got {type(flat).__name__}")
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "unpack")
    shape = flat.shape
    if not shape or shape[-1] != layout.total_elems:
        received = "a 0-d array" if not shape else f"shape {shape}"
        raise ValueError(
            f"unpack: flat must have layout.total_elems = {layout.total_elems} elements "
            f"along its last axis, got {received}, for {layout!r}"
        )
    # Splitting one axis into several is always expressible with strides, so each reshape
    # below returns a view of the slice; it never copies.
    if len(shape) == 1:
        # Written out, as hand slicing would be: a comprehension costs a fifth of the views.
        cuts = layout.cuts
        (q, q_shape), (k, k_shape), (v, v_shape), (g, g_shape), (b, b_shape) = cuts[:5]
        dstate = None
        if len(cuts) == 6:
            state, state_shape = cuts[5]
            dstate = flat[state].reshape(state_shape)
        return _new_tuple(
            GdnGrads,
            (
                flat[q].reshape(q_shape),
                flat[k].reshape(k_shape),
                flat[v].reshape(v_shape),
                flat[g].reshape(g_shape),
                flat[b].reshape(b_shape),
                dstate,
            ),
        )
    lead = shape[:-1]
    views = [flat[..., cut].reshape(lead + grad_shape) for cut, grad_shape in layout.cuts]
    return GdnGrads(*views)


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
    """Pack gradients into one 1-D buffer in rlx-ir's order; the inverse of :func:`unpack`.

    The layout is inferred from the arrays unless given; every shape is checked against it.
    With ``out``, the result is written there and ``out`` is returned; otherwise a new array
    is allocated. Its dtype is ``dtype``, else ``out.dtype``, else ``np.result_type`` of the
    gradients, and each gradient is cast as ``np.copyto(..., casting=casting)`` would cast it.
    Inputs may overlap ``out``, as views from ``unpack(out, ...)`` do: each is read before
    its memory is written. Nothing is written unless every check passes.

    Parameters
    ----------
    dq, dk, dv, dg, dbeta : array_like
        The gradients, shaped as the layout says.
    dstate : array_like, optional
        The state's gradient: given exactly when the state is carried.
    layout : GdnBackwardLayout, optional
        The layout to pack into; inferred from ``dq``, ``dg`` and ``dstate`` when omitted.
    out : numpy.ndarray, optional
        A writeable 1-D array of ``layout.total_elems`` elements to write into.
    dtype : dtype_like, optional
        The packed dtype; must equal ``out.dtype`` when both are given.
    casting : {"no", "equiv", "safe", "same_kind", "unsafe"}
        How each gradient may be cast, as for :func:`numpy.copyto`.

    Returns
    -------
    numpy.ndarray
        The packed buffer: ``out`` when given.

    Raises
    ------
    TypeError
        ``layout`` or ``out`` has the wrong type, a cast is not allowed by ``casting``, ``dtype``
        conflicts with ``out``, or the packed dtype is not numeric.
    ValueError
        A shape does not match the layout, ``dstate`` does not match ``carry_state``, ``out``
        has the wrong shape or is read-only, or ``casting`` is unknown.

    See Also
    --------
    unpack : The inverse: views of a packed buffer.
    empty, zeros : A packed buffer to write gradients into, with no copy.

    Examples
    --------
    >>> import numpy as np
    >>> layout = GdnBackwardLayout(batch=1, seq=2, heads=1, state_size=2)
    >>> buf = np.arange(layout.total_elems, dtype=np.float64)
    >>> bool((pack(*unpack(buf, layout)) == buf).all())
    True
    >>> pack(*unpack(buf, layout), dtype=np.float32).dtype
    dtype('float32')
    """
    # The checks are written out rather than looped over: on a small buffer each generator,
    # comprehension or helper call costs as much as a fifth of the copy itself.
    nd = np.ndarray
    if not (type(dq) is nd and type(dk) is nd and type(dv) is nd and type(dg) is nd):
        dq, dk, dv, dg = _array(dq), _array(dk), _array(dv), _array(dg)
    if type(dbeta) is not nd:
        dbeta = _array(dbeta)
    if dstate is None:
        arrays = [dq, dk, dv, dg, dbeta]
        shapes: tuple[tuple[int, ...], ...] = (dq.shape, dk.shape, dv.shape, dg.shape, dbeta.shape)
    else:
        if type(dstate) is not nd:
            dstate = _array(dstate)
        arrays = [dq, dk, dv, dg, dbeta, dstate]
        shapes = (dq.shape, dk.shape, dv.shape, dg.shape, dbeta.shape, dstate.shape)
    if layout is None:
        # The layouts of recent calls by (dq's shape, gate rank, state). Shapes that do not
        # fit the one found are inferred again, for the error the inference raises.
        key = (shapes[0], len(shapes[3]), dstate is not None)
        layout = _LAYOUTS.get(key)
        if layout is None or shapes != layout.shapes:
            try:
                layout = GdnBackwardLayout.from_grads(*arrays)
            except (TypeError, ValueError) as error:
                if isinstance(error, ValueError):
                    _raise_if_dq_alone_is_wrong(arrays)
                raise type(error)(f"pack: {error}") from None
            if len(_LAYOUTS) >= 64:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
    elif not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "pack")
    elif (dstate is None) == layout.carry_state:
        wrong = "missing" if layout.carry_state else "given"
        raise ValueError(
            f"pack: dstate is {wrong}, but the layout has carry_state={layout.carry_state}: "
            f"{layout!r}"
        )
    if shapes != layout.shapes:
        _raise_shape_error(layout, arrays)
    if casting not in _CASTINGS:
        raise ValueError(f"pack: casting must be one of {_CASTINGS}, got {casting!r}")

    # concatenate(axis=None) flattens each input in C order straight into the result, strided
    # or not: one C-level pass over everything, with NumPy's own casting.
    if out is None:
        target = resolve(dtype, "pack: dtype") if dtype is not None else np.result_type(*arrays)
        if not (target.kind in "biufc" or is_floating(target)):
            raise TypeError(f"pack: gradients are numbers; the packed dtype would be {target}")
        _check_casts(layout, arrays, target, casting)
        return np.concatenate(arrays, axis=None, dtype=target, casting=casting)
    if type(out) is not nd or out.shape != (layout.total_elems,):
        check_out(out, layout, "pack")  # raises the error that says which
    flags = out.flags
    if not flags.writeable:
        check_out(out, layout, "pack")
    target = out.dtype
    if dtype is not None and (wanted := resolve(dtype, "pack: dtype")) != target:
        raise TypeError(f"pack: dtype={wanted} conflicts with out.dtype={target}; give one")
    # The usual case, fresh gradients of out's dtype, needs neither a cast check nor an
    # overlap check: a gradient that owns its memory cannot overlap an out that owns its own.
    usual = flags.owndata
    for array in arrays:
        if array.dtype is not target or array.base is not None:
            usual = False
            break
    if not usual:
        _check_casts(layout, arrays, target, casting)
        if _may_overlap(arrays, out):
            destinations = [view for view in unpack(out, layout) if view is not None]
            sources = _detach_overlaps(destinations, arrays, out)
            for dest, source in zip(destinations, sources, strict=True):
                if source is not None:
                    np.copyto(dest, source, casting=casting)
            return out
    np.concatenate(arrays, axis=None, out=out, casting=casting)
    return out


def _array(x: object) -> NDArray[Any]:
    """A gradient as an ndarray: a torch or JAX array (``__dlpack__``) read as
    :func:`~gdn_layout._arrays.as_packed` reads it (without a copy in host memory, with one
    from a device's), its bfloat16 included; anything else as :func:`numpy.asarray` reads it."""
    if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
        return as_packed(x, "a gradient", "pack")
    return np.asarray(x)


def _raise_shape_error(layout: GdnBackwardLayout, arrays: list[NDArray[Any]]) -> None:
    for seg, array in zip(layout.segments(), arrays, strict=True):
        if array.shape != seg.shape:
            raise ValueError(
                f"pack: {seg.name} has shape {array.shape}, expected {seg.shape} for {layout!r}"
            )


def _raise_if_dq_alone_is_wrong(arrays: list[NDArray[Any]]) -> None:
    """The layout is inferred from ``dq``, so a wrong ``dq`` makes the others look wrong: when
    the layout that ``dk`` gives fits every gradient but ``dq``, name ``dq``."""
    try:
        layout = GdnBackwardLayout.from_grads(arrays[1], *arrays[1:])
    except (TypeError, ValueError):
        return  # dk does not fit the others either: the inference's own error says which
    raise ValueError(
        f"pack: dq has shape {arrays[0].shape}, expected {layout.shape('dq')} for {layout!r}, "
        "the layout of the other gradients"
    )


def _may_overlap(arrays: list[NDArray[Any]], out: NDArray[Any]) -> bool:
    if out.flags.owndata:
        # Only a view of out can overlap memory that out owns: fresh gradients need no check.
        return any(a.base is not None and np.may_share_memory(a, out) for a in arrays)
    return any(np.may_share_memory(a, out) for a in arrays)


_LAYOUTS: dict[tuple[tuple[int, ...], int, bool], GdnBackwardLayout] = {}


def empty(
    layout: GdnBackwardLayout, dtype: DTypeLike = np.float32
) -> tuple[NDArray[Any], GdnGrads]:
    """An uninitialised packed buffer and its views, for a backward to write in place.

    Parameters
    ----------
    layout : GdnBackwardLayout
        The layout of the buffer.
    dtype : dtype_like
        Its dtype; ``"bfloat16"`` works as a name (it needs ml_dtypes).

    Returns
    -------
    flat : numpy.ndarray
        The uninitialised 1-D buffer of ``layout.total_elems`` elements.
    grads : GdnGrads
        ``unpack(flat, layout)``.

    Raises
    ------
    TypeError
        ``layout`` is not a :class:`GdnBackwardLayout`, or ``dtype`` is not a dtype.

    See Also
    --------
    zeros : The same, zeroed.
    unpack : Views of a buffer that already exists.

    Examples
    --------
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
    """A zeroed packed buffer and its views, for a backward that accumulates in place.

    Parameters, returns and raises as for :func:`empty`.

    See Also
    --------
    empty : The same, uninitialised.
    pack : Gradients that already exist into one buffer.

    Examples
    --------
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


def _check_casts(
    layout: GdnBackwardLayout, arrays: list[NDArray[Any]], target: np.dtype[Any], casting: str
) -> None:
    for array in arrays:
        if array.dtype is not target:
            break
    else:
        return  # the usual case: nothing to cast
    for seg, array in zip(layout.segments(), arrays, strict=True):
        if array.dtype is not target and not np.can_cast(array.dtype, target, casting=casting):  # type: ignore[arg-type]
            raise TypeError(
                f"pack: cannot cast {seg.name} from {array.dtype} to {target} "
                f"with casting={casting!r}"
            )


def _detach_overlaps(
    destinations: list[NDArray[Any]], arrays: list[NDArray[Any]], out: NDArray[Any]
) -> list[NDArray[Any] | None]:
    """Make every input safe to read while ``out`` is being written.

    An input that already is its own destination (the views of ``unpack(out, layout)``) needs
    no write at all: it is dropped. Any other input that may overlap ``out`` is copied first,
    so that no write can clobber memory that a later copy still has to read.
    """
    detached: list[NDArray[Any] | None] = []
    for dest, array in zip(destinations, arrays, strict=True):
        if not np.may_share_memory(array, out):
            detached.append(array)
        elif _same_memory(array, dest):
            detached.append(None)
        else:
            detached.append(array.copy())
    return detached


def _same_memory(a: NDArray[Any], b: NDArray[Any]) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.strides == b.strides
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )

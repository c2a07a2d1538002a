"""The reference's inputs checked and converted (time on axis 2), their parts per worker, and
the check of what comes back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from .._dtypes import is_floating
from ..layout import GdnBackwardLayout
from ..packing import GdnGrads

_Array = NDArray[Any]


class Inputs(NamedTuple):
    """Validated inputs in the internal layout: time on axis 2, computation dtype, C order."""

    q: _Array  # [B, H, S, N]
    k: _Array  # [B, H, S, N]
    v: _Array  # [B, H, S, N]
    g: _Array  # [B, H, S, Ng], Ng = N with a per-channel gate, else 1
    beta: _Array  # [B, H, S]
    state: _Array | None  # [B, H, N, N]
    dy: _Array | None  # [B, H, S, N]
    layout: GdnBackwardLayout
    scale: float


#: How the shape of each input is named in errors; the shapes themselves are the layout's.
_SHAPES = {"k": "[B, S, H, N] of q", "v": "[B, S, H, N] of q", "dy": "[B, S, H, N] of q"}
_SHAPES["beta"] = "[B, S, H]"


def _converted(
    name: str, value: ArrayLike, dtype: np.dtype[Any], axes: tuple[int, ...], checked: bool
) -> _Array:
    """A C-ordered copy of ``value`` in ``dtype`` with its axes permuted, checked finite unless not
    ``checked``."""
    array = np.asarray(value)
    with np.errstate(over="ignore"):  # an overflow is reported below as a non-finite value
        converted = np.array(array.transpose(axes), dtype=dtype, order="C", copy=True)
    if checked and not (finite := np.isfinite(converted)).all():
        index = tuple(int(i) for i in np.argwhere(~finite.transpose(np.argsort(axes)))[0])
        raise ValueError(f"{name} must be finite in {dtype}, got {array[index]} at index {index}")
    return converted


def validate(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    state: ArrayLike | None,
    dy: ArrayLike | None,
    dtype: DTypeLike,
    finite: bool = True,
) -> Inputs:
    """The inputs checked (finite unless not ``finite``) and converted, in the order named."""
    try:
        compute = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if compute not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype must be float32 or float64, got {compute}")
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state, "dy": dy}
    arrays = {name: np.asarray(value) for name, value in named.items() if value is not None}
    for name, array in arrays.items():
        if not is_floating(array.dtype):
            raise TypeError(
                f"{name} must have a floating dtype (float16, bfloat16, float32, float64, ...), "
                f"got {array.dtype}"
            )
    layout = GdnBackwardLayout.from_inputs(arrays["q"], arrays["g"], arrays.get("state"))
    for name, what in _SHAPES.items():
        if name in arrays and arrays[name].shape != (want := layout.input_shape(name)):
            raise ValueError(f"{name} must have shape {what} = {want}, got {arrays[name].shape}")
    seq_axes, per_channel = (0, 2, 1, 3), arrays["g"].ndim == 4
    axes = {"g": seq_axes if per_channel else (0, 2, 1), "q": seq_axes, "k": seq_axes}
    axes |= {"v": seq_axes, "beta": (0, 2, 1), "state": (0, 1, 2, 3), "dy": seq_axes}
    done = {n: _converted(n, arrays[n], compute, axes[n], finite) for n in axes if n in arrays}
    n = layout.state_size
    return Inputs(
        q=done["q"],
        k=done["k"],
        v=done["v"],
        g=done["g"] if per_channel else done["g"][..., None],
        beta=done["beta"],
        state=done.get("state"),
        dy=done.get("dy"),
        layout=layout,
        scale=1.0 / math.sqrt(n) if n else 1.0,
    )


def part_inputs(x: Inputs, batch: slice, heads: slice) -> Inputs:
    """The inputs of the batch elements ``batch`` and heads ``heads``, as views."""
    parts: Any = zip(x._fields[:7], x, strict=False)
    views: dict[str, Any] = {f: None if a is None else a[batch, heads] for f, a in parts}
    b, h = views["q"].shape[:2]
    return x._replace(**views, layout=dataclasses.replace(x.layout, batch=b, heads=h))


def part_grads(grads: GdnGrads, batch: slice, heads: slice) -> GdnGrads:
    """The gradients of the batch elements ``batch`` and heads ``heads``, as views."""
    parts: Any = zip(grads._fields[:5], grads, strict=False)
    views: dict[str, Any] = {f: grad[batch, :, heads] for f, grad in parts}
    return grads._replace(
        **views, dstate=None if grads.dstate is None else grads.dstate[batch, heads]
    )


def check_result(func: str, name: str, array: _Array) -> None:
    """Refuse a non-finite result: from finite inputs the recurrence itself blew up."""
    finite = np.isfinite(array)
    if not finite.all():
        index = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise FloatingPointError(
            f"{func}: {name} is {array[index]} at index {index} in {array.dtype}: "
            "the delta rule overflows for inputs outside the op's regime (keys L2-normalised, "
            "beta in [0, 1])"
        )

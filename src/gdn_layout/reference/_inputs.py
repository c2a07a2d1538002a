"""The reference's inputs, checked, converted to the computation dtype, time on axis 2; the parts
that workers take of them and of the gradients; and the check of what comes back."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from .._dtypes import is_floating
from ..layout import GdnBackwardLayout
from ..packing import GdnGrads
from ._threads import mapped

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
_SHAPES = {
    "k": "[B, S, H, N] of q",
    "v": "[B, S, H, N] of q",
    "dy": "[B, S, H, N] of q",
    "beta": "[B, S, H]",
}


def _computation_dtype(dtype: DTypeLike) -> np.dtype[Any]:
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if resolved not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype must be float32 or float64, got {resolved}")
    return resolved


def _as_floating(name: str, value: ArrayLike) -> _Array:
    array = np.asarray(value)
    if not is_floating(array.dtype):
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32, float64, ...), "
            f"got {array.dtype}"
        )
    return array


def _expect_shape(name: str, array: _Array, expected: tuple[int, ...], what: str) -> None:
    if array.shape != expected:
        raise ValueError(f"{name} must have shape {what} = {expected}, got {array.shape}")


def _converted(
    name: str, array: _Array, dtype: np.dtype[Any], axes: tuple[int, ...], checked: bool = True
) -> _Array:
    """A C-ordered copy of ``array`` in ``dtype`` with its axes permuted, checked finite unless
    not ``checked``."""
    with np.errstate(over="ignore"):  # an overflow is reported below as a non-finite value
        converted = np.array(array.transpose(axes), dtype=dtype, order="C", copy=True)
    if not checked:
        return converted
    finite = np.isfinite(converted)
    if not finite.all():
        bad = np.argwhere(~finite.transpose(np.argsort(axes)))[0]
        index = tuple(int(i) for i in bad)
        original = array[index]
        raise ValueError(f"{name} must be finite in {dtype}, got {original} at index {index}")
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
    threads: int = 1,
    finite: bool = True,
) -> Inputs:
    """The inputs checked and converted, on up to ``threads`` threads; their values checked
    finite unless not ``finite`` (an op read otherwise may step through infinities)."""
    compute = _computation_dtype(dtype)
    named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
    if state is not None:
        named.append(("state", state))
    if dy is not None:
        named.append(("dy", dy))
    arrays = {name: _as_floating(name, value) for name, value in named}

    qa, ga = arrays["q"], arrays["g"]
    layout = GdnBackwardLayout.from_inputs(qa, ga, arrays.get("state"))
    for name, what in _SHAPES.items():
        if name in arrays:
            _expect_shape(name, arrays[name], layout.input_shape(name), what)
    n = layout.state_size

    seq_axes = (0, 2, 1, 3)
    axes = {
        "g": seq_axes if ga.ndim == 4 else (0, 2, 1),
        "q": seq_axes,
        "k": seq_axes,
        "v": seq_axes,
        "beta": (0, 2, 1),
        "state": (0, 1, 2, 3),
        "dy": seq_axes,
    }
    # In this order the plain loop converts them, and so names the first bad one.
    order = [name for name in axes if name in arrays]
    done = dict(
        zip(
            order,
            mapped(
                lambda name: _converted(name, arrays[name], compute, axes[name], finite),
                order,
                threads,
            ),
            strict=True,
        )
    )
    gate = done["g"] if ga.ndim == 4 else done["g"][..., None]
    return Inputs(
        q=done["q"],
        k=done["k"],
        v=done["v"],
        g=gate,
        beta=done["beta"],
        state=done.get("state"),
        dy=done.get("dy"),
        layout=layout,
        scale=1.0 / math.sqrt(n) if n else 1.0,
    )


def part_inputs(x: Inputs, batch: slice, heads: slice) -> Inputs:
    """The inputs of the batch elements ``batch`` and heads ``heads``, as views."""
    b = len(range(*batch.indices(x.q.shape[0])))
    h = len(range(*heads.indices(x.q.shape[1])))
    layout = GdnBackwardLayout(
        b,
        x.layout.seq,
        h,
        x.layout.state_size,
        gate_per_channel=x.layout.gate_per_channel,
        carry_state=x.layout.carry_state,
    )
    return Inputs(
        q=x.q[batch, heads],
        k=x.k[batch, heads],
        v=x.v[batch, heads],
        g=x.g[batch, heads],
        beta=x.beta[batch, heads],
        state=None if x.state is None else x.state[batch, heads],
        dy=None if x.dy is None else x.dy[batch, heads],
        layout=layout,
        scale=x.scale,
    )


def part_grads(grads: GdnGrads, batch: slice, heads: slice) -> GdnGrads:
    """The gradients of the batch elements ``batch`` and heads ``heads``, as views."""
    return GdnGrads(
        grads.dq[batch, :, heads],
        grads.dk[batch, :, heads],
        grads.dv[batch, :, heads],
        grads.dg[batch, :, heads],
        grads.dbeta[batch, :, heads],
        None if grads.dstate is None else grads.dstate[batch, heads],
    )


def check_result(func: str, name: str, array: _Array) -> None:
    """Refuse to hand back a non-finite result: from finite inputs it means the recurrence
    itself blew up, which happens when the inputs are outside the op's regime."""
    finite = np.isfinite(array)
    if not finite.all():
        index = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise FloatingPointError(
            f"{func}: {name} is {array[index]} at index {index} in {array.dtype}: "
            "the delta rule overflows for inputs outside the op's regime (keys L2-normalised, "
            "beta in [0, 1])"
        )

"""The reference forward and backward of the gated delta-net in NumPy: docs/reference.md."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from .._checks import integer
from ..packing import check_out, unpack
from . import _chunked, _recurrent
from ._inputs import Inputs, check_result, part_grads, part_inputs, validate
from ._recurrent import default_checkpoint_every
from ._states import chunk_states
from ._threads import groups, resolve_workers, spread

__all__ = [
    "Method",
    "backward",
    "chunk_states",
    "default_checkpoint_every",
    "forward",
    "resolve_workers",
]

Method = Literal["chunked", "recurrent"]
_METHODS = ("chunked", "recurrent")

_Array = NDArray[Any]


@overload
def forward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    state: None = None,
    *,
    dtype: DTypeLike = np.float64,
    method: Method = "chunked",
    workers: int | None = 1,
) -> _Array: ...


@overload
def forward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    state: ArrayLike,
    *,
    dtype: DTypeLike = np.float64,
    method: Method = "chunked",
    workers: int | None = 1,
) -> tuple[_Array, _Array]: ...


def forward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    state: ArrayLike | None = None,
    *,
    dtype: DTypeLike = np.float64,
    method: Method = "chunked",
    workers: int | None = 1,
) -> _Array | tuple[_Array, _Array]:
    """Run the gated delta-net forward (docs/reference.md).

    Parameters
    ----------
    q, k, v : array_like
        ``[B, S, H, N]``, any floating dtype.
    g : array_like
        Log-gates ``[B, S, H]``, or ``[B, S, H, N]`` per channel.
    beta : array_like
        ``[B, S, H]``.
    state : array_like, optional
        The initial state ``[B, H, N, N]``; zero when not given.
    dtype : {float64, float32}
        The computation dtype, and that of the results.
    method : {"chunked", "recurrent"}
        The formulation: the same function.
    workers : int or None
        Threads (None: one per core this process may use); the same result bit for bit.

    Returns
    -------
    ndarray or tuple of ndarray
        ``y`` ``[B, S, H, N]``; ``(y, final_state)`` when a state is given.

    Raises
    ------
    TypeError
        An input is not floating, or a bad ``dtype`` or ``workers``.
    ValueError
        A shape does not fit ``q``'s, a value is not finite, or a bad ``method`` or ``workers``.
    FloatingPointError
        The recurrence overflows; the message names where.

    See Also
    --------
    reference.backward : Its gradient.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 6, 2, 4)) for _ in range(3))
    >>> k /= np.linalg.norm(k, axis=-1, keepdims=True)
    >>> g, beta = -rng.random((1, 6, 2)), rng.random((1, 6, 2))
    >>> y, final = forward(q, k, v, g, beta, np.zeros((1, 2, 4, 4)))
    >>> y.shape, final.shape
    ((1, 6, 2, 4), (1, 2, 4, 4))
    """
    carried = state is not None
    threads = resolve_workers(workers, "forward")
    inputs = validate(q, k, v, g, beta, state, None, dtype)
    _check_method(method)
    b, h, s, n = inputs.q.shape
    y = np.empty((b, s, h, n), dtype=inputs.q.dtype)
    final = np.zeros((b, h, n, n), inputs.q.dtype) if inputs.state is None else inputs.state.copy()
    if b * h * n == 0:  # no state element: y is zeros, whatever S; nothing to step through
        y[...] = 0
        return (y, final) if carried else y
    recurrent = _form(method, inputs) == "recurrent"
    stacks = [] if recurrent else _chunked.plan(inputs, threads=threads)

    def run(batch: slice, heads: slice) -> None:
        part = part_inputs(inputs, batch, heads)
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, with a location
            if recurrent:
                _recurrent.forward_steps(part, final[batch, heads], 0, s, y=y[batch, :, heads])
            else:
                plan = _chunked.part_of(stacks, batch, heads)
                _chunked.forward(part, final[batch, heads], y[batch, :, heads], plan)

    spread(run, b, h, threads)
    check_result("forward", "y", y)
    check_result("forward", "the final state", final)
    return (y, final) if carried else y


def backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    dy: ArrayLike,
    state: ArrayLike | None = None,
    *,
    dtype: DTypeLike = np.float64,
    out: _Array | None = None,
    checkpoint_every: int | None = None,
    method: Method = "chunked",
    progress: Callable[[float], object] | None = None,
    workers: int | None = 1,
) -> _Array:
    """The packed gradient of ``sum(forward(q, k, v, g, beta, state) * dy)`` (docs/reference.md).

    Parameters
    ----------
    q, k, v, g, beta, state : array_like
        As :func:`forward`.
    dy : array_like
        ``[B, S, H, N]``, the cotangent of ``y``.
    dtype : {float64, float32}
        The computation dtype, and that of the result.
    out : ndarray, optional
        A writable 1-D array of ``dtype`` and ``layout.total_elems`` elements to fill.
    checkpoint_every : int, optional
        The recurrent form's checkpoint interval, the chunked form's batch of steps.
    method, workers
        As :func:`forward`.
    progress : callable, optional
        Called with the fraction done, rising to 1.0.

    Returns
    -------
    ndarray
        ``dq, dk, dv, dg, dbeta`` (and ``dstate`` with a state), flattened and concatenated.

    Raises
    ------
    TypeError, ValueError, FloatingPointError
        As :func:`forward`, and for a bad ``out``, ``checkpoint_every`` or ``progress``.

    See Also
    --------
    unpack : The packed result as shaped views.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout, unpack
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dy = (rng.standard_normal((1, 6, 2, 4)) for _ in range(4))
    >>> k /= np.linalg.norm(k, axis=-1, keepdims=True)
    >>> g, beta = -rng.random((1, 6, 2)), rng.random((1, 6, 2))
    >>> state = rng.standard_normal((1, 2, 4, 4))
    >>> flat = backward(q, k, v, g, beta, dy, state)
    >>> unpack(flat, GdnBackwardLayout.from_inputs(q, g, state)).dstate.shape
    (1, 2, 4, 4)
    """
    threads = resolve_workers(workers, "backward")
    inputs = validate(q, k, v, g, beta, state, dy, dtype)
    _check_method(method)
    layout = inputs.layout
    every = _checkpoint_interval(checkpoint_every, layout.seq)
    if out is None:
        flat = np.empty(layout.total_elems, dtype=inputs.q.dtype)
    else:
        check_out(out, layout, "backward")
        if out.dtype != inputs.q.dtype:
            raise TypeError(
                f"backward: out must have dtype {inputs.q.dtype} (the computation dtype), "
                f"got {out.dtype}"
            )
        flat = out
    if layout.batch * layout.heads * layout.state_size == 0:
        flat[...] = 0  # no state element: every gradient is zeros, whatever S
        _ticker(progress, 1)()  # all of it done
        return flat
    form = _form(method, inputs)  # once every argument is checked: it reads all of k
    if checkpoint_every is None and form == "chunked":
        every = _chunked.default_interval(layout.seq, layout.state_size)
    grads = unpack(flat, layout)
    stacks = [] if form == "recurrent" else _chunked.plan(inputs, every, threads)
    parts = groups(layout.batch, layout.heads, threads)
    tick = _ticker(progress, 2 * math.ceil(layout.seq / every) * len(parts))

    def run(batch: slice, heads: slice) -> None:
        part = part_inputs(inputs, batch, heads)
        views = part_grads(grads, batch, heads)
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, with a location
            if form == "recurrent":
                _recurrent.backward(part, views, every, tick)
            else:
                _chunked.backward(part, views, _chunked.part_of(stacks, batch, heads), tick)

    spread(run, layout.batch, layout.heads, threads)
    for name, grad in zip(layout.names, grads, strict=False):
        if grad is not None:
            check_result("backward", name, grad)
    return flat


def _form(method: Method, inputs: Inputs) -> Method:
    """The form that computes ``method`` on ``inputs``: the chunked one where it suits them."""
    return "chunked" if method == "chunked" and _chunked.suits(inputs) else "recurrent"


def _check_method(method: object) -> None:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


def _checkpoint_interval(value: object, seq: int) -> int:
    if value is None:
        return default_checkpoint_every(seq)
    return integer(value, "checkpoint_every", least=1, or_none=True)


def _ticker(progress: Callable[[float], object] | None, total: int) -> Callable[[], None]:
    """A callback per unit of work reporting the fraction done to ``progress``; thread-safe."""
    if progress is None:
        return lambda: None
    if not callable(progress):
        raise TypeError(f"progress must be callable or None, got {type(progress).__name__}")
    done = 0
    lock = threading.Lock()

    def tick() -> None:
        nonlocal done
        with lock:
            done += 1
            progress(done / total)

    return tick

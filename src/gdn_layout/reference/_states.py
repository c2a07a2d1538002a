"""The states at chunk boundaries and their cotangents (:func:`chunk_states`), and everything
one step-by-step run gives for a fixture's floors (:func:`step_by_step`).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from .._checks import integer
from ..packing import empty
from . import _chunked, _recurrent
from ._inputs import check_result, part_grads, part_inputs, validate
from ._threads import resolve_workers, spread

_Array = NDArray[Any]


def chunk_states(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    dy: ArrayLike,
    state: ArrayLike | None = None,
    *,
    chunk: int = 64,
    dtype: DTypeLike = np.float64,
    method: Literal["chunked", "recurrent"] = "chunked",
    workers: int | None = 1,
) -> tuple[_Array, _Array, _Array]:
    """The state entering every chunk, its cotangent, and the final state.

    Parameters
    ----------
    q, k, v, g, beta, dy, state : array_like
        As :func:`backward`.
    chunk : int
        The chunk length: chunk ``c`` holds steps ``c*chunk`` to ``(c+1)*chunk - 1``.
    dtype : {float64, float32}
        The computation dtype, and that of the results (``dh`` of the chunked form is its
        float64 cotangent rounded once).
    method : {"chunked", "recurrent"}
        As in :func:`backward`.
    workers : int or None
        As in :func:`backward`: the results are the same bit for bit.

    Returns
    -------
    h : ndarray
        ``[B, K, H, N, N]``, ``K = ceil(S / chunk)``: the state entering each chunk (row a key
        channel, column a value channel); ``h[:, 0]`` is the initial state (or zeros).
    dh : ndarray
        ``[B, K, H, N, N]``: the gradient of ``sum(y * dy)`` with respect to ``h``;
        ``dh[:, 0]`` is :func:`backward`'s ``dstate`` (also when no state is given).
    final_state : ndarray
        ``[B, H, N, N]``, the state after the last step.

    Raises
    ------
    TypeError, ValueError, FloatingPointError
        As :func:`backward`; also for a ``chunk`` that is not a positive integer.

    See Also
    --------
    reference.backward : The gradients.
    suites.compare_states : Judge a kernel's states against a fixture's.

    Notes
    -----
    The results are :func:`backward`'s run with ``checkpoint_every=chunk``, its backward sweep
    skipping the inputs' gradients where the chunked form is taken.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout.reference import backward, chunk_states, forward
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dy = (rng.standard_normal((1, 10, 2, 4)) for _ in range(4))
    >>> k /= np.linalg.norm(k, axis=-1, keepdims=True)  # keys of unit norm
    >>> g, beta = -rng.random((1, 10, 2)), rng.random((1, 10, 2))
    >>> state = rng.standard_normal((1, 2, 4, 4))
    >>> h, dh, final = chunk_states(q, k, v, g, beta, dy, state, chunk=4)
    >>> h.shape, dh.shape, final.shape  # chunks of steps 0-3, 4-7 and 8-9
    ((1, 3, 2, 4, 4), (1, 3, 2, 4, 4), (1, 2, 4, 4))
    >>> bool(np.array_equal(h[:, 0], state))
    True
    >>> _, after = forward(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], state)
    >>> bool(np.allclose(after, h[:, 1], rtol=1e-12, atol=1e-12))
    True
    >>> dstate = backward(q, k, v, g, beta, dy, state)[-32:].reshape(1, 2, 4, 4)
    >>> bool(np.allclose(dh[:, 0], dstate, rtol=1e-12, atol=1e-12))
    True
    """
    threads = resolve_workers(workers, "chunk_states")
    inputs = validate(q, k, v, g, beta, state, dy, dtype, threads)
    size = _chunk_length(chunk)
    b, heads, seq, n = inputs.q.shape
    count = -(-seq // size)
    every = min(size, max(seq, 1))  # the same chunks, without a huge interval's buffers
    compute = inputs.q.dtype
    h, dh = (np.empty((b, count, heads, n, n), compute) for _ in range(2))
    record = _recurrent.Boundaries(h, dh, np.empty((b, heads, n, n), compute))
    if method not in ("chunked", "recurrent"):
        raise ValueError(f"chunk_states: method must be 'chunked' or 'recurrent', got {method!r}")
    if b * heads * n == 0:  # no state element: nothing to record, whatever S
        return h, dh, record.final
    chunked = method == "chunked" and _chunked.suits(inputs)
    stacks = _chunked.backward_plan(inputs, every, threads) if chunked else []

    def run(batch: slice, heads: slice) -> None:
        part = part_inputs(inputs, batch, heads)
        views = record.part(batch, heads)
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, with a location
            if chunked:
                plan = _chunked.part_of(stacks, batch, heads)
                _chunked.backward(part, None, plan, _nothing, views)
            else:  # the step-by-step form computes the gradients too: into a scratch buffer
                _, scratch = empty(part.layout, compute)
                _recurrent.backward(part, scratch, every, _nothing, views)

    spread(run, b, heads, threads)
    for name, array in (("h", h), ("dh", dh), ("final_state", record.final)):
        check_result("chunk_states", name, array)
    return h, dh, record.final


def step_by_step(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    dy: ArrayLike,
    state: ArrayLike | None = None,
    *,
    chunk: int | None = None,
    dtype: DTypeLike = np.float32,
    workers: int | None = 1,
) -> tuple[_Array, dict[str, _Array]]:
    """The packed gradients and ``{"y", "final_state", "h", "dh"}`` of one step-by-step run.

    ``final_state`` with ``state`` or ``chunk``, ``h`` and ``dh`` with ``chunk``: each bit for bit
    what ``backward``, ``forward`` and :func:`chunk_states` give with ``method="recurrent"``.

    >>> import numpy as np
    >>> from gdn_layout.reference import backward, forward
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dy = (rng.standard_normal((1, 10, 2, 4)) for _ in range(4))
    >>> k /= np.linalg.norm(k, axis=-1, keepdims=True)
    >>> g, beta = -rng.random((1, 10, 2)), rng.random((1, 10, 2))
    >>> packed, outputs = step_by_step(q, k, v, g, beta, dy, chunk=4)
    >>> sorted(outputs)
    ['dh', 'final_state', 'h', 'y']
    >>> y = forward(q, k, v, g, beta, dtype=np.float32, method="recurrent")
    >>> bool(np.array_equal(outputs["y"], y))
    True
    >>> same = backward(q, k, v, g, beta, dy, dtype=np.float32, method="recurrent")
    >>> bool(np.array_equal(packed, same))
    True
    """
    threads = resolve_workers(workers, "step_by_step")
    inputs = validate(q, k, v, g, beta, state, dy, dtype, threads)
    layout = inputs.layout
    b, heads, seq, n = inputs.q.shape
    compute = inputs.q.dtype
    if chunk is None:
        every = _recurrent.default_checkpoint_every(seq)
    else:
        every = min(_chunk_length(chunk), max(seq, 1))
    count = -(-seq // every)
    record = _recurrent.Boundaries(
        h=np.empty((b, count, heads, n, n), compute),  # the checkpoints: kept in any case
        dh=None if chunk is None else np.empty((b, count, heads, n, n), compute),
        final=np.empty((b, heads, n, n), compute),
    )
    flat, grads = empty(layout, compute)
    y = np.empty((b, seq, heads, n), compute)

    def run(batch: slice, heads: slice) -> None:
        part, out = part_inputs(inputs, batch, heads), part_grads(grads, batch, heads)
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, with a location
            _recurrent.backward(
                part, out, every, _nothing, record.part(batch, heads), y[batch, :, heads]
            )

    spread(run, b, heads, threads)
    outputs = {"y": y}
    if record.dh is not None:
        outputs.update(h=record.h, dh=record.dh)
    if chunk is not None or state is not None:
        outputs["final_state"] = record.final
    for name, array in (*zip(layout.names, grads, strict=False), *outputs.items()):
        if array is not None:
            check_result("the step-by-step form", name, array)
    return flat, outputs


def _nothing() -> None:
    return None


def _chunk_length(value: object) -> int:
    return integer(value, "chunk", least=1)

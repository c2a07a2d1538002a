"""The states at chunk boundaries (:func:`chunk_states`) and one step-by-step run's results."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from .._checks import integer
from ..packing import empty
from . import _chunked, _recurrent
from ._inputs import check_result, part_inputs, validate
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
    """The state entering every chunk, its cotangent, and the final state (docs/reference.md).

    Parameters
    ----------
    q, k, v, g, beta, dy, state : array_like
        As :func:`backward`.
    chunk : int
        The chunk length: chunk ``c`` holds steps ``c*chunk`` to ``(c+1)*chunk - 1``.
    dtype, method, workers
        As :func:`backward`.

    Returns
    -------
    h, dh : ndarray
        ``[B, K, H, N, N]``, ``K = ceil(S / chunk)``: the state entering each chunk (``h[:, 0]``
        the initial state or zeros) and its cotangent (``dh[:, 0]`` is ``dstate``).
    final_state : ndarray
        ``[B, H, N, N]``.

    Raises
    ------
    TypeError, ValueError, FloatingPointError
        As :func:`backward`, and for a ``chunk`` that is not a positive integer.

    See Also
    --------
    suites.compare_states : Judge a kernel's states against a fixture's.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dy = (rng.standard_normal((1, 10, 2, 4)) for _ in range(4))
    >>> k /= np.linalg.norm(k, axis=-1, keepdims=True)
    >>> g, beta = -rng.random((1, 10, 2)), rng.random((1, 10, 2))
    >>> h, dh, final = chunk_states(q, k, v, g, beta, dy, chunk=4)
    >>> h.shape, dh.shape, final.shape  # chunks of steps 0-3, 4-7 and 8-9
    ((1, 3, 2, 4, 4), (1, 3, 2, 4, 4), (1, 2, 4, 4))
    """
    threads = resolve_workers(workers, "chunk_states")
    inputs = validate(q, k, v, g, beta, state, dy, dtype)
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
    stacks = _chunked.plan(inputs, every, threads) if chunked else []

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
) -> tuple[_Array, dict[str, _Array]]:
    """The packed gradients and ``{"y", "final_state", "h", "dh"}`` of one step-by-step run,
    each bit for bit what ``method="recurrent"`` gives; ``final_state`` with ``state`` or
    ``chunk``, ``h`` and ``dh`` with ``chunk``."""
    inputs = validate(q, k, v, g, beta, state, dy, dtype)
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
    with np.errstate(over="ignore", invalid="ignore"):  # reported below, with a location
        _recurrent.backward(inputs, grads, every, _nothing, record, y)
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

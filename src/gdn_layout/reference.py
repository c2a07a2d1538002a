"""Reference forward and backward of the gated delta-net, in NumPy.

The math is that of RLX's ``Op::GatedDeltaNet`` and ``Op::GatedDeltaNetBackward``. For every
batch element and head, with ``c = 1 / sqrt(N)`` and ``S_prev`` the ``N x N`` state entering
step ``t`` (row ``i`` a key channel, column ``j`` a value channel)::

    A    = exp(g[t])            a scalar, or with a per-channel gate one factor per key row
    P    = A * S_prev           per channel: row i of S_prev scaled by A[i]
    m    = k[t] @ P
    u    = (v[t] - m) * beta[t]
    S_t  = P + outer(k[t], u)
    y[t] = c * q[t] @ S_t

The backward returns the gradients of ``sum(y * dy)`` with respect to ``q, k, v, g, beta`` and,
when the initial state is given, that state, packed into one 1-D buffer in rlx-ir's order (see
:class:`~gdn_layout.GdnBackwardLayout`). The gradient of the initial state comes from ``dy``
alone: the final state has no cotangent.

Two formulations compute the same function and are tested against each other:

``method="recurrent"``
    The recurrence above, one step at a time, vectorised over batch and heads; the backward is
    the spec's step-by-step backward.
``method="chunked"`` (the default)
    The same recurrence rewritten per chunk of up to ``min(C, 4*N, 64)`` steps: the delta rule
    inside a chunk is a unit lower-triangular system (the WY/UT form used by chunked delta-rule
    kernels), so a chunk costs a few matrix products instead of sequential state updates. The
    system grows worse conditioned with the chunk's length the smaller ``N`` is, hence the
    ``4*N`` bound, which keeps float32 within a few times the recurrence's own rounding. Inside
    a chunk
    the decays are formed as ``exp(H_t) * exp(-H_s)``, with ``H`` the cumulative log-gate since
    the chunk's first step; a chunk is cut short wherever ``|H|`` would exceed 20 on any batch
    element, head or channel, so no factor can overflow, and a one-step chunk needs no such
    factor at all. Gates that decay that fast only make the chunks shorter (and the method
    slower), never less accurate.

Memory of the backward: the state is checkpointed every ``C = checkpoint_every`` steps
(default ``ceil(sqrt(S))``) in a forward sweep, and each checkpoint interval is recomputed from
its checkpoint in the backward sweep. Beyond the inputs' converted copies and the packed output
(both ``O(B*S*H*N)``), the working memory is ``O(B*H*N*N*(ceil(S/C) + C))`` elements: the
checkpoints, plus at most ``C + 1`` states for the interval being recomputed. The recurrent
method keeps every state of the interval; the chunked method keeps only the entry state of each
chunk in it (one chunk per interval when ``C <= min(4*N, 64)`` and the gates do not decay
very fast)
and ``O(B*H*C*(C + N))`` elements for the chunk's matrices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from ._dtypes import is_floating
from .layout import GdnBackwardLayout
from .packing import GdnGrads, check_out, unpack

__all__ = ["Method", "backward", "default_checkpoint_every", "forward"]

Method = Literal["chunked", "recurrent"]
_METHODS = ("chunked", "recurrent")

#: Largest ``|cumulative log-gate|`` allowed inside one chunk of the chunked method. Decays are
#: formed as ``exp(H_t) * exp(-H_s)``, so each factor stays within ``exp(+-20)`` (about
#: ``5e8``), far from overflow in float32 and float64, while the product keeps full relative
#: precision.
_MAX_LOG_DRIFT = 20.0

#: Longest chunk of the chunked method, per unit of the state size N. The unit lower-triangular
#: system of a chunk grows worse conditioned with its length the smaller N is (its strictly
#: lower part has rank at most N): chunks of up to 4*N steps (and 64 at most) keep float32
#: results within a few times the step-by-step method's own rounding, measured for N = 1 to 16.
_CHUNK_PER_STATE_SIZE = 4
_MAX_CHUNK = 64

_Array = NDArray[Any]


class _Inputs(NamedTuple):
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


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


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
) -> _Array | tuple[_Array, _Array]:
    """Run the gated delta-net forward.

    ``q, k, v`` are ``[B, S, H, N]``; ``g`` is ``[B, S, H]`` (one gate per head) or
    ``[B, S, H, N]`` (a per-channel gate, decaying key rows); ``beta`` is ``[B, S, H]``;
    ``state``, when given, is the initial state ``[B, H, N, N]`` (otherwise it is zero). Inputs
    may have any floating dtype (float16 and ml_dtypes' bfloat16 included); the computation
    runs in ``dtype``, float64 or float32, and the results are in ``dtype``.

    Returns ``y`` ``[B, S, H, N]`` when ``state`` is None, and the pair ``(y, final_state)``
    (``final_state`` ``[B, H, N, N]``) when a state is given. ``method`` selects the
    formulation (see the module docstring); both compute the same function. A result that is
    not finite, which finite inputs give only when the recurrence overflows (keys far from unit
    norm, say), raises FloatingPointError naming the first such element.

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 6, 2, 4)) for _ in range(3))
    >>> g, beta = -rng.random((1, 6, 2)), rng.random((1, 6, 2))
    >>> y = forward(q, k, v, g, beta)
    >>> y.shape, y.dtype
    ((1, 6, 2, 4), dtype('float64'))
    >>> y2, final = forward(q, k, v, g, beta, np.zeros((1, 2, 4, 4)), method="recurrent")
    >>> final.shape, bool(np.allclose(y, y2))
    ((1, 2, 4, 4), True)
    """
    carried = state is not None
    inputs = _validate(q, k, v, g, beta, state, None, dtype)
    _check_method(method)
    b, h, s, n = inputs.q.shape
    y = np.empty((b, s, h, n), dtype=inputs.q.dtype)
    final = (
        np.zeros((b, h, n, n), dtype=inputs.q.dtype)
        if inputs.state is None
        else (inputs.state.copy())
    )
    with np.errstate(over="ignore", invalid="ignore"):  # reported below, with a location
        if method == "recurrent":
            _recurrent_forward(inputs, final, 0, s, y=y)
        else:
            for t0, t1 in _chunks(inputs.g, 0, s, _chunk_length(n)):
                _chunk_forward(inputs, final, t0, t1, y=y)
    _check_result("forward", "y", y)
    _check_result("forward", "the final state", final)
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
) -> _Array:
    """The packed gradient of ``sum(forward(q, k, v, g, beta, state) * dy)``.

    Returns a 1-D buffer of ``dtype`` holding ``dq, dk, dv, dg, dbeta`` and, when ``state`` is
    given, ``dstate``, each flattened in C order and concatenated in that order, exactly as
    rlx-ir's ``GatedDeltaNetBackward``. The gradients are written straight into the views of
    that buffer. Get the shaped views with
    ``unpack(flat, GdnBackwardLayout.from_inputs(q, g, state))``.

    ``out``, when given, must be a writable 1-D array of ``dtype`` with
    ``layout.total_elems`` elements; it is filled and returned. ``checkpoint_every`` is the
    checkpoint interval ``C`` (default :func:`default_checkpoint_every`, about ``sqrt(S)``):
    the extra memory is ``O(B*H*N*N*(ceil(S/C) + C))`` elements, see the module docstring.
    Shapes, dtypes and finiteness are checked as in :func:`forward`, ``dy`` being
    ``[B, S, H, N]``. ``progress``, when given, is called with the fraction of the work done
    (rising to 1.0) after each checkpoint interval of the forward and the backward sweep: a
    long run can draw a progress bar with it. A gradient that is not finite raises
    FloatingPointError, as in :func:`forward`.

    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout, unpack
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dy = (rng.standard_normal((1, 6, 2, 4)) for _ in range(4))
    >>> g, beta = -rng.random((1, 6, 2)), rng.random((1, 6, 2))
    >>> state = rng.standard_normal((1, 2, 4, 4))
    >>> flat = backward(q, k, v, g, beta, dy, state)
    >>> grads = unpack(flat, GdnBackwardLayout.from_inputs(q, g, state))
    >>> flat.shape, grads.dg.shape, grads.dstate.shape
    ((200,), (1, 6, 2), (1, 2, 4, 4))
    >>> slow = backward(q, k, v, g, beta, dy, state, method="recurrent", checkpoint_every=1)
    >>> bool(np.allclose(flat, slow, rtol=1e-12, atol=1e-12))
    True
    """
    inputs = _validate(q, k, v, g, beta, state, dy, dtype)
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
    grads = unpack(flat, layout)
    sweep = _recurrent_backward if method == "recurrent" else _chunked_backward
    with np.errstate(over="ignore", invalid="ignore"):  # reported below, with a location
        sweep(inputs, grads, every, _ticker(progress, 2 * math.ceil(layout.seq / every)))
    for name, grad in zip(layout.names, grads, strict=False):
        if grad is not None:
            _check_result("backward", name, grad)
    return flat


def _check_result(func: str, name: str, array: _Array) -> None:
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


def default_checkpoint_every(seq: int) -> int:
    """The default checkpoint interval for a sequence of ``seq`` steps: ``ceil(sqrt(seq))``.

    >>> default_checkpoint_every(512), default_checkpoint_every(4096), default_checkpoint_every(0)
    (23, 64, 1)
    """
    return max(1, math.isqrt(max(seq, 1) - 1) + 1)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


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


def _converted(name: str, array: _Array, dtype: np.dtype[Any], axes: tuple[int, ...]) -> _Array:
    """A C-ordered copy of ``array`` in ``dtype`` with its axes permuted, checked finite."""
    with np.errstate(over="ignore"):  # an overflow is reported below as a non-finite value
        converted = np.array(array.transpose(axes), dtype=dtype, order="C", copy=True)
    finite = np.isfinite(converted)
    if not finite.all():
        bad = np.argwhere(~finite.transpose(np.argsort(axes)))[0]
        index = tuple(int(i) for i in bad)
        original = array[index]
        raise ValueError(f"{name} must be finite in {dtype}, got {original} at index {index}")
    return converted


def _validate(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    state: ArrayLike | None,
    dy: ArrayLike | None,
    dtype: DTypeLike,
) -> _Inputs:
    compute = _computation_dtype(dtype)
    named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
    if state is not None:
        named.append(("state", state))
    if dy is not None:
        named.append(("dy", dy))
    arrays = {name: _as_floating(name, value) for name, value in named}

    qa = arrays["q"]
    if qa.ndim != 4:
        raise ValueError(f"q must have shape [B, S, H, N] (4 dimensions), got {qa.shape}")
    b, s, h, n = qa.shape
    for name in ("k", "v", "dy"):
        if name in arrays:
            _expect_shape(name, arrays[name], qa.shape, "[B, S, H, N] of q")
    ga = arrays["g"]
    if ga.shape not in ((b, s, h), (b, s, h, n)):
        raise ValueError(
            f"g must have shape [B, S, H] = {(b, s, h)} or [B, S, H, N] = {(b, s, h, n)}, "
            f"got {ga.shape}"
        )
    _expect_shape("beta", arrays["beta"], (b, s, h), "[B, S, H]")
    if "state" in arrays:
        _expect_shape("state", arrays["state"], (b, h, n, n), "[B, H, N, N]")

    seq_axes = (0, 2, 1, 3)
    gate = _converted("g", ga, compute, seq_axes if ga.ndim == 4 else (0, 2, 1))
    if ga.ndim == 3:
        gate = gate[..., None]
    return _Inputs(
        q=_converted("q", qa, compute, seq_axes),
        k=_converted("k", arrays["k"], compute, seq_axes),
        v=_converted("v", arrays["v"], compute, seq_axes),
        g=gate,
        beta=_converted("beta", arrays["beta"], compute, (0, 2, 1)),
        state=(
            _converted("state", arrays["state"], compute, (0, 1, 2, 3))
            if "state" in arrays
            else None
        ),
        dy=_converted("dy", arrays["dy"], compute, seq_axes) if "dy" in arrays else None,
        layout=GdnBackwardLayout(
            b, s, h, n, gate_per_channel=ga.ndim == 4, carry_state="state" in arrays
        ),
        scale=1.0 / math.sqrt(n) if n else 1.0,
    )


def _check_method(method: object) -> None:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


def _checkpoint_interval(value: object, seq: int) -> int:
    if value is None:
        return default_checkpoint_every(seq)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"checkpoint_every must be a positive integer or None, got "
            f"{type(value).__name__} {value!r}"
        )
    if value < 1:
        raise ValueError(f"checkpoint_every must be a positive integer or None, got {value}")
    return int(value)


# --------------------------------------------------------------------------------------------
# The recurrence, one step at a time
# --------------------------------------------------------------------------------------------


def _row_scale(a: _Array) -> _Array:
    """``[B, H, Ng]`` decay factors shaped to scale the rows of ``[B, H, N, N]`` states."""
    return a[..., :, None]


def _recurrent_forward(
    x: _Inputs,
    state: _Array,
    t0: int,
    t1: int,
    *,
    y: _Array | None = None,
    states: _Array | None = None,
) -> None:
    """Advance ``state`` in place through steps ``t0 .. t1-1``.

    Writes ``y[:, t]`` when ``y`` is given and ``states[t - t0 + 1]`` (the state after step
    ``t``) when ``states`` is given.
    """
    for t in range(t0, t1):
        kt, vt = x.k[:, :, t], x.v[:, :, t]
        state *= _row_scale(np.exp(x.g[:, :, t]))  # P
        m = np.matmul(kt[..., None, :], state)[..., 0, :]
        u = (vt - m) * x.beta[:, :, t, None]
        state += kt[..., :, None] * u[..., None, :]  # S_t
        if y is not None:
            y[:, t] = x.scale * np.matmul(x.q[:, :, t, None, :], state)[..., 0, :]
        if states is not None:
            states[t - t0 + 1] = state


def _recurrent_backward(x: _Inputs, grads: GdnGrads, every: int, tick: Callable[[], None]) -> None:
    """The spec's backward, step by step, from checkpoints taken every ``every`` steps."""
    assert x.dy is not None
    b, h, s, n = x.q.shape
    c = x.scale
    per_channel = x.layout.gate_per_channel
    state = np.zeros((b, h, n, n), x.q.dtype) if x.state is None else x.state.copy()
    starts = list(range(0, s, every))
    checkpoints = np.empty((len(starts), b, h, n, n), x.q.dtype)
    for index, t0 in enumerate(starts):
        checkpoints[index] = state
        _recurrent_forward(x, state, t0, min(t0 + every, s))
        tick()
    del state

    d_state = np.zeros((b, h, n, n), x.q.dtype)  # dS: gradient reaching S_t from later steps
    states = np.empty((every + 1, b, h, n, n), x.q.dtype)
    for index in reversed(range(len(starts))):
        t0 = starts[index]
        t1 = min(t0 + every, s)
        states[0] = checkpoints[index]
        _recurrent_forward(x, states[0].copy(), t0, t1, states=states)
        for t in reversed(range(t0, t1)):
            s_prev, s_t = states[t - t0], states[t - t0 + 1]
            qt, kt, vt, dyt = x.q[:, :, t], x.k[:, :, t], x.v[:, :, t], x.dy[:, :, t]
            bt = x.beta[:, :, t, None]
            a = _row_scale(np.exp(x.g[:, :, t]))
            p = a * s_prev
            m = np.matmul(kt[..., None, :], p)[..., 0, :]
            u = (vt - m) * bt

            grads.dq[:, t] = c * np.matmul(s_t, dyt[..., None])[..., 0]
            d_state += c * qt[..., :, None] * dyt[..., None, :]
            dk = np.matmul(d_state, u[..., None])[..., 0]
            du = np.matmul(kt[..., None, :], d_state)[..., 0, :]
            grads.dv[:, t] = bt * du
            grads.dbeta[:, t] = np.sum((vt - m) * du, axis=-1)
            dm = -bt * du
            dk += np.matmul(p, dm[..., None])[..., 0]
            grads.dk[:, t] = dk
            d_state += kt[..., :, None] * dm[..., None, :]  # now dP
            dg = a[..., 0] * np.sum(s_prev * d_state, axis=-1)
            grads.dg[:, t] = dg if per_channel else np.sum(dg, axis=-1)
            d_state *= a
        tick()
    if grads.dstate is not None:
        grads.dstate[...] = d_state


# --------------------------------------------------------------------------------------------
# The recurrence, chunk by chunk
# --------------------------------------------------------------------------------------------


def _chunks(g: _Array, t0: int, t1: int, length: int) -> list[tuple[int, int]]:
    """Split ``[t0, t1)`` into chunks of at most ``length`` steps whose log-gate drift is bounded.

    Inside a chunk starting at ``a``, ``H_t = sum(g[a+1 .. t])`` must stay within
    ``+-_MAX_LOG_DRIFT`` for every batch element, head and channel.
    """
    bounds = []
    start = t0
    while start < t1:
        stop = min(start + length, t1)
        if stop - start > 1:
            drift = np.cumsum(g[:, :, start + 1 : stop], axis=2)
            worst = np.abs(drift).max(axis=(0, 1, 3)) if drift.size else np.zeros(0)
            over = np.flatnonzero(~(worst <= _MAX_LOG_DRIFT))
            if over.size:
                stop = start + 1 + int(over[0])
        bounds.append((start, stop))
        start = stop
    return bounds


def _reduce_gate(x: _Array, ng: int) -> _Array:
    """Sum ``[..., N]`` gate contributions down to ``[..., Ng]``."""
    return x if x.shape[-1] == ng else np.sum(x, axis=-1, keepdims=True)


@functools.lru_cache(maxsize=16)
def _lower_mask(size: int, dtype: np.dtype[Any], with_q: bool) -> _Array:
    """The 0/1 mask of the chunk matrix ``lx`` (see :class:`_Chunk`), ``[C, C]`` or ``[2C, C]``.

    The strict lower triangle for ``lk``, below the lower triangle with its diagonal for ``lq``
    when ``with_q``.
    """
    strict = np.tri(size, k=-1, dtype=dtype)
    mask = np.concatenate((np.tri(size, dtype=dtype), strict)) if with_q else strict
    mask.flags.writeable = False
    return mask


def _unit_lower_inverse(lower: _Array) -> _Array:
    """``inv(I + lower)`` for strictly lower-triangular ``lower``, ``[..., C, C]``.

    ``lower`` is nilpotent (``lower^C = 0``), so the inverse is the finite series
    ``sum_j (-lower)^j``, which is the product ``(I - lower)(I + lower^2)(I + lower^4)...``:
    ``ceil(log2(C)) - 1`` doublings of two matrix products each, in the computation dtype.
    """
    size = lower.shape[-1]
    power = -lower
    inverse: _Array = power + np.eye(size, dtype=lower.dtype)
    reach = 2  # inverse holds the powers below reach
    while reach < size:
        power = np.matmul(power, power)
        inverse += np.matmul(inverse, power)
        reach *= 2
    return inverse


def _stepwise(a: _Array, rows: _Array) -> _Array:
    """``a * rows`` for per-step factors ``a`` ``[B, H, C, Ng]`` and ``rows`` ``[B, H, m*C, N]``.

    ``rows`` stacks ``m`` blocks of ``C`` steps (``[q; k]`` or ``k`` alone); each block is scaled
    by ``a``.
    """
    b, h, size, _ = a.shape
    blocks = rows.reshape(b, h, rows.shape[2] // size, size, rows.shape[-1])
    return (blocks * a[:, :, None]).reshape(rows.shape)


def _block_sum(rows: _Array, size: int) -> _Array:
    """Sum the stacked blocks of ``size`` steps of ``rows`` ``[B, H, m*C, N]``: ``[B, H, C, N]``."""
    b, h, length, n = rows.shape
    summed: _Array = np.sum(rows.reshape(b, h, length // size, size, n), axis=2)
    return summed


class _Chunk(NamedTuple):
    """The delta rule over one chunk of ``C`` steps: what its forward and backward share.

    ``rows`` is ``[q; k]`` (``q`` above ``k`` along time, ``2C`` rows) when the chunk is solved
    ``with_q``, else ``k`` alone; ``lk``, ``ke`` and ``kf`` are the last ``C`` rows of ``lx``,
    ``xe`` and ``xf``.
    """

    e: _Array  # exp(G): decay from the chunk's entry state to step t, [B, H, C, Ng]
    f: _Array  # exp(H), H = G - G[0], [B, H, C, Ng]
    fi: _Array  # exp(-H)
    xe: _Array  # e * rows: [qe; ke]
    xf: _Array  # f * rows: [qf; kf]
    kb: _Array  # fi * k
    lx: _Array  # [lq; lk]: tril(qf @ kb^T) above tril(kf @ kb^T, -1)
    r: _Array  # v - ke @ S0
    inv: _Array  # inv(I + beta * lk), unit lower-triangular, [B, H, C, C]
    u: _Array  # inv @ (beta * r)


def _transposed(x: _Array) -> _Array:
    return np.swapaxes(x, -1, -2)


def _chunk_solve(x: _Inputs, state: _Array, t0: int, t1: int, *, with_q: bool) -> _Chunk:
    """The delta rule over steps ``t0 .. t1-1`` entered with ``state``: ``u`` for every step."""
    span = slice(t0, t1)
    size = t1 - t0
    k, v = x.k[:, :, span], x.v[:, :, span]
    beta = x.beta[:, :, span, None]
    rows = np.concatenate((x.q[:, :, span], k), axis=2) if with_q else k
    big_g = np.cumsum(x.g[:, :, span], axis=2)
    big_h = big_g - big_g[:, :, :1]
    e, f, fi = np.exp(big_g), np.exp(big_h), np.exp(-big_h)
    xe, xf, kb = _stepwise(e, rows), _stepwise(f, rows), fi * k
    lx = np.matmul(xf, _transposed(kb))
    lx *= _lower_mask(size, lx.dtype, with_q)
    r = v - np.matmul(xe[:, :, -size:], state)
    inv = _unit_lower_inverse(beta * lx[:, :, -size:])
    u = np.matmul(inv, beta * r)
    return _Chunk(e, f, fi, xe, xf, kb, lx, r, inv, u)


def _chunk_forward(x: _Inputs, state: _Array, t0: int, t1: int, *, y: _Array | None = None) -> None:
    """One chunk's forward: advances ``state`` in place from step ``t0`` to the end of the chunk.

    Writes ``y[:, t0:t1]`` when ``y`` is given.
    """
    size = t1 - t0
    ch = _chunk_solve(x, state, t0, t1, with_q=y is not None)
    if y is not None:  # y = c * (qe @ S0 + lq @ u)
        out = np.matmul(ch.xe[:, :, :size], state)
        out += np.matmul(ch.lx[:, :, :size], ch.u)
        out *= x.scale
        y[:, t0:t1] = np.swapaxes(out, 1, 2)
    # S_end = e_end * S0 + f_end * (kb^T @ u), rows scaled
    grown = np.matmul(_transposed(ch.kb), ch.u)
    grown *= _row_scale(ch.f[:, :, -1])
    state *= _row_scale(ch.e[:, :, -1])
    state += grown


def _chunk_backward(
    x: _Inputs, grads: GdnGrads, state: _Array, d_state: _Array, t0: int, t1: int
) -> None:
    """Backward of one chunk entered with ``state``; ``d_state`` goes from end to entry.

    Products that share an operand are done once on stacked rows: ``[q; k]`` for the decayed
    copies, and their cotangents likewise.
    """
    assert x.dy is not None
    span = slice(t0, t1)
    size = t1 - t0
    ch = _chunk_solve(x, state, t0, t1, with_q=True)
    beta = x.beta[:, :, span, None]
    dy = x.dy[:, :, span]
    ng = x.g.shape[-1]
    lq, lk = ch.lx[:, :, :size], ch.lx[:, :, size:]

    # S_end = e_end * S0 + f_end * X, X = kb^T @ u, rows scaled. With ud = u @ dS_end^T,
    # dkb = ud * f_end (columns are key channels) and df_end = sum(kb * ud) over time.
    f_end = ch.f[:, :, -1]
    ud = np.matmul(ch.u, _transposed(d_state))
    d_f_end = _reduce_gate(np.sum(ch.kb * ud, axis=2), ng)
    d_e_end = _reduce_gate(np.sum(state * d_state, axis=-1), ng)
    d_kb = ud * f_end[:, :, None, :]
    d_u = np.matmul(ch.kb, _row_scale(f_end) * d_state)
    d_state *= _row_scale(ch.e[:, :, -1])  # now the part of dS0 that comes from S_end

    # y = c * (qe @ S0 + lq @ u): the lq @ u part
    d_u += x.scale * np.matmul(_transposed(lq), dy)

    # u = inv @ w, w = beta * r, inv = inv(am), am = I + beta * lk. Stacked cotangent rows:
    # [c * dy; d_w] @ u^T holds d_lq and -d_am.
    d_w = np.matmul(_transposed(ch.inv), d_u)
    cot = np.empty_like(ch.xe)
    np.multiply(dy, x.scale, out=cot[:, :, :size])
    cot[:, :, size:] = d_w
    d_lx = np.matmul(cot, _transposed(ch.u))
    d_beta = np.sum(d_w * ch.r, axis=-1)
    d_beta -= np.sum(d_lx[:, :, size:] * lk, axis=-1)
    d_lx *= _lower_mask(size, d_lx.dtype, True)
    d_lx[:, :, size:] *= -beta  # d_lk = tril(beta * d_am, -1)
    d_r = beta * d_w

    # y = c * qe @ S0 and r = v - ke @ S0: cotangent rows [c * dy; -d_r] against S0
    np.negative(d_r, out=cot[:, :, size:])
    d_xe = np.matmul(cot, _transposed(state))
    d_state += np.matmul(_transposed(ch.xe), cot)

    # [lq; lk] = [qf; kf] @ kb^T, masked
    d_xf = np.matmul(d_lx, ch.kb)
    d_kb += np.matmul(_transposed(d_lx), ch.xf)

    # the decayed copies [qe; ke], [qf; kf] and kb of q and k
    d_rows = _stepwise(ch.e, d_xe)
    d_rows += _stepwise(ch.f, d_xf)
    d_k = d_rows[:, :, size:]
    d_k += ch.fi * d_kb
    # with e = exp(G): e * de = sum of d_xe * xe over the q and k blocks, likewise f and fi
    e_de = _reduce_gate(_block_sum(d_xe * ch.xe, size), ng)
    e_de[:, :, -1] += ch.e[:, :, -1] * d_e_end
    f_df = _reduce_gate(_block_sum(d_xf * ch.xf, size), ng)
    f_df[:, :, -1] += f_end * d_f_end
    fi_dfi = _reduce_gate(d_kb * ch.kb, ng)

    # e = exp(G), f = exp(H), fi = exp(-H), H = G - G[0], G = cumsum(g). H does not depend on
    # the chunk's first gate, so that gate's gradient is e's alone: adding the d_h terms and
    # taking them out again would bury a tiny gradient under their rounding.
    d_h = f_df - fi_dfi
    d_g = np.flip(np.cumsum(np.flip(e_de + d_h, axis=2), axis=2), axis=2)
    d_g[:, :, 0] = np.sum(e_de, axis=2)

    grads.dq[:, span] = np.swapaxes(d_rows[:, :, :size], 1, 2)
    grads.dk[:, span] = np.swapaxes(d_k, 1, 2)
    grads.dv[:, span] = np.swapaxes(d_r, 1, 2)
    grads.dbeta[:, span] = np.swapaxes(d_beta, 1, 2)
    if x.layout.gate_per_channel:
        grads.dg[:, span] = np.swapaxes(d_g, 1, 2)
    else:
        grads.dg[:, span] = np.swapaxes(d_g[..., 0], 1, 2)


def _chunk_length(state_size: int) -> int:
    return max(1, min(_MAX_CHUNK, _CHUNK_PER_STATE_SIZE * state_size))


def _chunked_backward(x: _Inputs, grads: GdnGrads, every: int, tick: Callable[[], None]) -> None:
    """Backward by chunks, from checkpoints taken every ``every`` steps."""
    b, h, s, n = x.q.shape
    state = np.zeros((b, h, n, n), x.q.dtype) if x.state is None else x.state.copy()
    # The chunks of every checkpoint interval, limited in length and in gate drift.
    length = min(every, _chunk_length(n))
    intervals = [_chunks(x.g, t0, min(t0 + every, s), length) for t0 in range(0, s, every)]
    checkpoints = np.empty((len(intervals), b, h, n, n), x.q.dtype)
    for index, chunks in enumerate(intervals):
        checkpoints[index] = state
        if index + 1 < len(intervals):  # the state after the last interval is not needed
            for c0, c1 in chunks:
                _chunk_forward(x, state, c0, c1)
        tick()
    del state

    d_state = np.zeros((b, h, n, n), x.q.dtype)
    for index in reversed(range(len(intervals))):
        chunks = intervals[index]
        # The entry state of every chunk of the interval; usually there is just one chunk.
        entries = [checkpoints[index]]
        for c0, c1 in chunks[:-1]:
            nxt = entries[-1].copy()
            _chunk_forward(x, nxt, c0, c1)
            entries.append(nxt)
        for (c0, c1), entry in zip(reversed(chunks), reversed(entries), strict=True):
            _chunk_backward(x, grads, entry, d_state, c0, c1)
        tick()
    if grads.dstate is not None:
        grads.dstate[...] = d_state


def _ticker(progress: Callable[[float], object] | None, total: int) -> Callable[[], None]:
    """A callback for each unit of work, reporting the fraction done to ``progress``."""
    if progress is None:
        return lambda: None
    if not callable(progress):
        raise TypeError(f"progress must be callable or None, got {type(progress).__name__}")
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        progress(done / total)

    return tick

"""The recurrence one step at a time, vectorised over batch and heads: the spec's NumPy operations
in its order, bit for bit, into buffers allocated once; :func:`step_gradients` and
:func:`step_ends` run it on the op read otherwise (:class:`Variant`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from ..packing import GdnGrads, empty
from ._inputs import Inputs, validate

_Array = NDArray[Any]

#: Below this size an element of an outer product's factor may make a product round to zero.
_TINY = 2.0**-62

#: Most steps whose inputs are gathered at once by :func:`forward_steps`.
_SPAN = 256


class Boundaries(NamedTuple):
    """The states a backward records at its intervals' (or stacks') starts: ``h`` ``[B, K, H, N,
    N]`` entering each, ``dh`` their cotangents (None: not kept), ``final`` ``[B, H, N, N]``.
    """

    h: _Array
    dh: _Array | None
    final: _Array

    def part(self, batch: slice, heads: slice) -> Boundaries:
        """Those of the batch elements ``batch`` and heads ``heads``, as views."""
        dh = None if self.dh is None else self.dh[batch, :, heads]
        return Boundaries(self.h[batch, :, heads], dh, self.final[batch, heads])


class Variant(NamedTuple):
    """The op read otherwise; the defaults are the op. ``decay``: the gate input holds decay factors
    (and ``dg`` is theirs); ``columns``: a per-channel decay scales value columns; ``cotangent``
    ``[B, H, N, N]``: one on the final state.
    """

    decay: bool = False
    columns: bool = False
    cotangent: _Array | None = None


_OP = Variant()


def row_scale(a: _Array) -> _Array:
    """``[B, H, Ng]`` decay factors shaped to scale the rows of ``[B, H, N, N]`` states."""
    return a[..., :, None]


def _clear_of_zero(a: _Array, scratch: _Array | None = None) -> bool:
    """Whether every element of ``a`` is at least ``_TINY`` in size (NaN is not)."""
    if a.size == 0:
        return True
    magnitude = np.abs(a, out=scratch)
    return bool(magnitude.min() >= _TINY)


def _padded(a: _Array, axis: int) -> _Array:
    """``a`` ``[..., N]`` beside zeros: ``[..., N, 2]`` (``axis=-1``) or ``[..., 2, N]``."""
    out = np.zeros((*a.shape, 2) if axis == -1 else (*a.shape[:-1], 2, a.shape[-1]), a.dtype)
    if axis == -1:
        out[..., 0] = a
    else:
        out[..., 0, :] = a
    return out


class _Outer:
    """``out = outer(col, row)`` for ``[B, H, N]`` factors kept padded: the matrix product
    ``[a, 0] @ [b; 0]`` is several times faster than broadcasting and differs only in the sign
    of a zero product, so it is taken only where no factor is below ``_TINY``."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.fast = shape[-1] > 1
        self.scratch = np.empty(shape, dtype)

    def __call__(self, out: _Array, col: _Array, row: _Array, exact: bool) -> None:
        # col [B, H, N, 2], row [B, H, 2, N]: the factors in column and row 0.
        if exact and self.fast:
            np.matmul(col, row, out=out)
        else:
            np.multiply(col[..., :, :1], row[..., :1, :], out=out)

    def clear(self, a: _Array) -> bool:
        """Whether the matrix product may form outer products with ``a`` ``[B, H, N]``."""
        return self.fast and _clear_of_zero(a, self.scratch)


class _Interval:
    """What the steps ``t0 .. t1-1`` read, taken for all of them at once."""

    def __init__(self, x: Inputs, t0: int, t1: int, variant: Variant) -> None:
        self.t0 = t0
        span = slice(t0, t1)
        gates = x.g[:, :, span]
        self.decay = gates if variant.decay else np.exp(gates)  # [B, H, T, Ng]
        # shaped to scale [B, H, N, N] states, step t at index t - t0 of axis 2
        self.factors = self.decay[..., None, :] if variant.columns else row_scale(self.decay)
        self.k_cols = _padded(x.k[:, :, span], -1)  # [B, H, T, N, 2]
        self.k_clear = x.q.shape[3] > 1 and _clear_of_zero(x.k[:, :, span])


class _Stepper:
    """Buffers for stepping ``[B, H, N, N]`` states, reused from step to step."""

    def __init__(self, x: Inputs, variant: Variant = _OP) -> None:
        b, h, _, n = x.q.shape
        dtype = x.q.dtype
        self.x, self.variant = x, variant
        self.outer = _Outer((b, h, n), dtype)
        self.update = np.empty((b, h, n, n), dtype)  # an outer product
        self.m = np.empty((b, h, 1, n), dtype)
        self.r = np.empty((b, h, n), dtype)
        self.u_rows = np.zeros((b, h, 2, n), dtype)
        self.y = np.empty((b, h, 1, n), dtype)

    def step(
        self,
        span: _Interval,
        t: int,
        prev: _Array,
        state: _Array,
        m: _Array | None = None,
        r: _Array | None = None,
        u_rows: _Array | None = None,
    ) -> None:
        """``state = S_t`` from ``prev = S_{t-1}`` (may be the same array)."""
        x, i = self.x, t - span.t0
        m = self.m if m is None else m
        r = self.r if r is None else r
        u_rows = self.u_rows if u_rows is None else u_rows
        u = u_rows[..., 0, :]
        np.multiply(prev, span.factors[:, :, i], out=state)  # P
        np.matmul(x.k[:, :, t, None, :], state, out=m)
        np.subtract(x.v[:, :, t], m[..., 0, :], out=r)
        np.multiply(r, x.beta[:, :, t, None], out=u)
        exact = span.k_clear and self.outer.clear(u)
        self.outer(self.update, span.k_cols[:, :, i], u_rows, exact)
        np.add(state, self.update, out=state)  # S_t

    def output(self, t: int, state: _Array, y: _Array) -> None:
        """``y[:, t] = c * q[t] @ S_t``."""
        np.matmul(self.x.q[:, :, t, None, :], state, out=self.y)
        np.multiply(self.y[..., 0, :], self.x.scale, out=y[:, t])


def forward_steps(
    x: Inputs,
    state: _Array,
    t0: int,
    t1: int,
    *,
    y: _Array | None = None,
    stepper: _Stepper | None = None,
) -> None:
    """Advance ``state`` in place through steps ``t0 .. t1-1``, writing ``y[:, t]`` if given."""
    if t1 <= t0:
        return
    stepper = _Stepper(x) if stepper is None else stepper
    for start in range(t0, t1, _SPAN):
        span = _Interval(x, start, min(start + _SPAN, t1), stepper.variant)
        for t in range(start, min(start + _SPAN, t1)):
            stepper.step(span, t, state, state)
            if y is not None:
                stepper.output(t, state, y)


def default_checkpoint_every(seq: int) -> int:
    """The default checkpoint interval for a sequence of ``seq`` steps: ``ceil(sqrt(seq))``.

    See Also
    --------
    reference.backward : Takes it as ``checkpoint_every``.

    Examples
    --------
    >>> default_checkpoint_every(512), default_checkpoint_every(4096), default_checkpoint_every(0)
    (23, 64, 1)
    """
    return max(1, math.isqrt(max(seq, 1) - 1) + 1)


def backward(
    x: Inputs,
    grads: GdnGrads,
    every: int,
    tick: Callable[[], None],
    record: Boundaries | None = None,
    y: _Array | None = None,
    variant: Variant = _OP,
) -> None:
    """The spec's backward, from checkpoints every ``every`` steps; with ``record`` they are kept
    there (:class:`Boundaries`); with ``y`` the forward sweep writes the outputs, bit for bit
    :func:`forward_steps`' whatever ``every``.
    """
    assert x.dy is not None
    b, h, s, n = x.q.shape
    dtype = x.q.dtype
    state = np.zeros((b, h, n, n), dtype) if x.state is None else x.state.copy()
    starts = list(range(0, s, every))
    checkpoints = (
        np.empty((len(starts), b, h, n, n), dtype)
        if record is None
        else np.moveaxis(record.h, 1, 0)  # a view: the checkpoints are written to h
    )
    stepper = _Stepper(x, variant)
    for index, t0 in enumerate(starts):
        checkpoints[index] = state
        forward_steps(x, state, t0, min(t0 + every, s), y=y, stepper=stepper)
        tick()
    if record is not None:
        record.final[...] = state
    del state

    back = _Backward(x, grads, every, stepper)
    for index in reversed(range(len(starts))):
        t0 = starts[index]
        back.interval(checkpoints[index], t0, min(t0 + every, s))
        if record is not None and record.dh is not None:
            record.dh[:, index] = back.d_state
        tick()
    if grads.dstate is not None:
        grads.dstate[...] = back.d_state


def step_gradients(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike | None,
    beta: ArrayLike,
    dy: ArrayLike,
    state: ArrayLike | None = None,
    *,
    decay: ArrayLike | None = None,
    columns: bool = False,
    cotangent: ArrayLike | None = None,
    dtype: DTypeLike = np.float64,
    checkpoint_every: int | None = None,
    record: Boundaries | None = None,
) -> GdnGrads:
    """The step-by-step backward of the op read otherwise (:class:`Variant`), in the op's shapes.

    With the defaults it is ``backward(..., method="recurrent")`` unpacked, bit for bit. ``decay``,
    given instead of ``g``: the decay factors themselves, any sign. ``dstate`` is always given
    (for a zero initial state when ``state`` is None); nothing is checked finite.
    """
    x, variant = _read(
        "step_gradients", q, k, v, g, beta, dy, state, decay, columns, cotangent, dtype
    )
    flat, grads = empty(x.layout, x.q.dtype)
    b, _, h, n = x.layout.batch, x.layout.seq, x.layout.heads, x.layout.state_size
    if b * h * n == 0:  # no state element: every gradient is zeros
        flat[...] = 0
        return grads
    every = default_checkpoint_every(x.layout.seq) if checkpoint_every is None else checkpoint_every
    with np.errstate(over="ignore", invalid="ignore"):  # a reading's op may overflow
        backward(x, grads, every, lambda: None, record=record, variant=variant)
    return grads


def _read(
    func: str,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike | None,
    beta: ArrayLike,
    dy: ArrayLike,
    state: ArrayLike | None,
    decay: ArrayLike | None,
    columns: bool,
    cotangent: ArrayLike | None,
    dtype: DTypeLike,
) -> tuple[Inputs, Variant]:
    """The inputs of ``func``'s run of the op read otherwise; a zero state where none is given."""
    if (g is None) == (decay is None):
        raise ValueError(f"{func}: give the log-gate g or the decay, not both")
    gate = decay if g is None else g
    assert gate is not None
    b, _, h, n = np.shape(q)
    start = np.zeros((b, h, n, n)) if state is None else state
    x = validate(q, k, v, gate, beta, start, dy, dtype, finite=False)
    if cotangent is not None:
        cotangent = np.asarray(cotangent)
        if cotangent.shape != (b, h, n, n):
            raise ValueError(f"cotangent must have shape {(b, h, n, n)}, got {cotangent.shape}")
    return x, Variant(decay is not None, columns, cotangent)


class Part(NamedTuple):
    """Steps ``t0 .. t1-1`` run apart (:func:`step_ends`), from the state ``entering`` them (None:
    none stepped) and the cotangent ``leaving`` them (None: no sweep).
    """

    t0: int
    t1: int
    entering: ArrayLike | None
    leaving: ArrayLike | None


def step_ends(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike | None,
    beta: ArrayLike,
    dy: ArrayLike,
    state: ArrayLike | None = None,
    *,
    decay: ArrayLike | None = None,
    columns: bool = False,
    cotangent: ArrayLike | None = None,
    dtype: DTypeLike = np.float64,
    steps: int = 16,
    parts: Sequence[Part] = (),
) -> GdnGrads:
    """:func:`step_gradients`' ``dq`` on the first ``steps`` steps and ``dv`` on the last, NaN
    elsewhere, from twice ``steps`` steps' work; its values (but the sign of a zero). ``parts``
    (:class:`Part`) run more steps apart: ``dq`` from an entering state, ``dv`` from a leaving
    cotangent, every gradient but ``dstate`` from both.
    """
    x, variant = _read("step_ends", q, k, v, g, beta, dy, state, decay, columns, cotangent, dtype)
    flat, grads = empty(x.layout, x.q.dtype)
    flat[...] = np.nan
    b, seq, h, n = x.layout.batch, x.layout.seq, x.layout.heads, x.layout.state_size
    if b * h * n * seq == 0:
        return grads
    steps = max(1, min(steps, seq))
    assert x.state is not None
    last = np.zeros((b, h, n, n)) if variant.cotangent is None else variant.cotangent
    every = (Part(0, steps, x.state, None), Part(seq - steps, seq, None, last), *parts)
    back = _Backward(x, grads, max(p.t1 - p.t0 for p in every), _Stepper(x, variant))
    with np.errstate(over="ignore", invalid="ignore"):  # a reading's op may overflow
        for part in every:
            if part.t1 <= part.t0:
                continue
            if part.entering is None:
                span = _Interval(x, part.t0, part.t1, variant)
            else:  # dq of these steps, and the states a full sweep reads
                span = back.recompute(np.asarray(part.entering, x.q.dtype), part.t0, part.t1)
            if part.leaving is not None:
                back.d_state[...] = part.leaving
                back.sweep(span, part.t0, part.t1, full=part.entering is not None)
    return grads


class _Backward:
    """The backward sweep's buffers and steps; ``d_state`` reaches ``S_t`` from later steps."""

    def __init__(self, x: Inputs, grads: GdnGrads, every: int, stepper: _Stepper) -> None:
        b, h, _, n = x.q.shape
        dtype = x.q.dtype
        assert x.dy is not None
        self.x, self.grads, self.stepper, self.dy = x, grads, stepper, x.dy
        cotangent = stepper.variant.cotangent
        if cotangent is None:
            self.d_state = np.zeros((b, h, n, n), dtype)
        else:
            self.d_state = np.array(cotangent, dtype, order="C", copy=True)
        # the gradient of the decay itself, not of its log; summed over value columns, or rows
        self.given = stepper.variant.decay
        self.axis = -2 if stepper.variant.columns else -1
        self.states = np.empty((every + 1, b, h, n, n), dtype)
        # What the recomputation keeps of each step: m, v - m and u (row 0 of u_rows).
        self.m = np.empty((every, b, h, 1, n), dtype)
        self.r = np.empty((every, b, h, n), dtype)
        self.u_rows = np.zeros((every, b, h, 2, n), dtype)
        self.p = np.empty((b, h, n, n), dtype)
        self.prod = np.empty((b, h, n, n), dtype)
        self.vec = np.empty((b, h, n, 1), dtype)
        self.dk = np.empty((b, h, n, 1), dtype)
        self.du = np.empty((b, h, 1, n), dtype)
        self.dm_rows = np.zeros((b, h, 2, n), dtype)
        self.small = np.empty((b, h, n), dtype)
        self.dg = np.empty((b, h, n), dtype)

    def interval(self, checkpoint: _Array, t0: int, t1: int) -> None:
        span = self.recompute(checkpoint, t0, t1)
        self.sweep(span, t0, t1)

    def recompute(self, checkpoint: _Array, t0: int, t1: int) -> _Interval:
        """The states of steps ``t0 .. t1-1`` from the state entering them, and their dq."""
        x, states = self.x, self.states
        span = _Interval(x, t0, t1, self.stepper.variant)
        states[0] = checkpoint
        for t in range(t0, t1):
            i = t - t0
            s_t = states[i + 1]
            self.stepper.step(span, t, states[i], s_t, self.m[i], self.r[i], self.u_rows[i])
            # dq = c * S_t @ dy while S_t is in cache
            np.matmul(s_t, self.dy[:, :, t, :, None], out=self.vec)
            np.multiply(self.vec[..., 0], x.scale, out=self.grads.dq[:, t])
        return span

    def sweep(self, span: _Interval, t0: int, t1: int, full: bool = True) -> None:
        """The backward through steps ``t1-1 .. t0``; unless ``full``, only dv and ``d_state``."""
        x = self.x
        dy = self.dy[:, :, t0:t1]
        c_q = x.scale * x.q[:, :, t0:t1]  # c * q[t], as the spec's c * q[t] * dy[t] rounds it
        q_cols = _padded(c_q, -1)
        dy_rows = _padded(dy, -2)
        q_clear = self.stepper.outer.fast and _clear_of_zero(c_q) and _clear_of_zero(dy)
        neg_beta = -x.beta[:, :, t0:t1, None]
        for t in reversed(range(t0, t1)):
            self.step(span, t, q_cols, dy_rows, q_clear, neg_beta, full)

    def step(
        self,
        span: _Interval,
        t: int,
        q_cols: _Array,
        dy_rows: _Array,
        q_clear: bool,
        neg_beta: _Array,
        full: bool = True,
    ) -> None:
        x, grads, outer, d_state = self.x, self.grads, self.stepper.outer, self.d_state
        i = t - span.t0
        s_prev = self.states[i]
        a = span.decay[:, :, i]  # [B, H, Ng]
        scale = span.factors[:, :, i]  # a, shaped to scale the state
        kt, bt = x.k[:, :, t], x.beta[:, :, t, None]

        outer(self.stepper.update, q_cols[:, :, i], dy_rows[:, :, i], q_clear)
        np.add(d_state, self.stepper.update, out=d_state)
        if full:
            np.matmul(d_state, self.u_rows[i, :, :, 0, :, None], out=self.dk)
        np.matmul(kt[..., None, :], d_state, out=self.du)
        du = self.du[..., 0, :]
        np.multiply(bt, du, out=grads.dv[:, t])
        if full:
            np.multiply(self.r[i], du, out=self.small)
            np.sum(self.small, axis=-1, out=grads.dbeta[:, t])
        dm = self.dm_rows[..., 0, :]
        np.multiply(neg_beta[:, :, i], du, out=dm)
        exact = span.k_clear and outer.clear(dm)
        outer(self.stepper.update, span.k_cols[:, :, i], self.dm_rows, exact)
        np.add(d_state, self.stepper.update, out=d_state)  # now dP
        if not full:
            np.multiply(d_state, scale, out=d_state)
            return
        np.multiply(s_prev, d_state, out=self.prod)
        # P = a * S_{t-1} after the product above, which brought S_{t-1} into cache
        p = np.multiply(scale, s_prev, out=self.p)
        np.matmul(p, dm[..., None], out=self.vec)
        np.add(self.dk[..., 0], self.vec[..., 0], out=grads.dk[:, t])
        np.sum(self.prod, axis=self.axis, out=self.small)
        if self.given:  # d/da of a * S_prev: no factor a
            if x.layout.gate_per_channel:
                grads.dg[:, t] = self.small
            else:
                np.sum(self.small, axis=-1, out=grads.dg[:, t])
        elif x.layout.gate_per_channel:
            np.multiply(a, self.small, out=grads.dg[:, t])
        else:
            np.multiply(a, self.small, out=self.dg)
            np.sum(self.dg, axis=-1, out=grads.dg[:, t])
        np.multiply(d_state, scale, out=d_state)

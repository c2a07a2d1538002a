"""The recurrence one step at a time, vectorised over batch and heads: the spec's own form."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..packing import GdnGrads
from ._inputs import Inputs

_Array = NDArray[Any]


class Boundaries(NamedTuple):
    """Where a backward records the states at the boundaries of its intervals (or stacks).

    ``h`` is ``[B, K, H, N, N]`` for ``K`` intervals: the state entering each; ``dh`` the same
    shape: the cotangent of that state, from the steps at and after its interval's start;
    ``final`` is ``[B, H, N, N]``: the state after the last step.
    """

    h: _Array
    dh: _Array
    final: _Array


def row_scale(a: _Array) -> _Array:
    """``[B, H, Ng]`` decay factors shaped to scale the rows of ``[B, H, N, N]`` states."""
    return a[..., :, None]


def forward_steps(
    x: Inputs,
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
        state *= row_scale(np.exp(x.g[:, :, t]))  # P
        m = np.matmul(kt[..., None, :], state)[..., 0, :]
        u = (vt - m) * x.beta[:, :, t, None]
        state += kt[..., :, None] * u[..., None, :]  # S_t
        if y is not None:
            y[:, t] = x.scale * np.matmul(x.q[:, :, t, None, :], state)[..., 0, :]
        if states is not None:
            states[t - t0 + 1] = state


def backward(
    x: Inputs,
    grads: GdnGrads,
    every: int,
    tick: Callable[[], None],
    record: Boundaries | None = None,
) -> None:
    """The spec's backward, step by step, from checkpoints taken every ``every`` steps.

    With ``record``, the checkpoints are kept in ``record.h``, and the state's cotangent at
    each checkpoint and the final state are written to ``record``.
    """
    assert x.dy is not None
    b, h, s, n = x.q.shape
    c = x.scale
    per_channel = x.layout.gate_per_channel
    state = np.zeros((b, h, n, n), x.q.dtype) if x.state is None else x.state.copy()
    starts = list(range(0, s, every))
    checkpoints = (
        np.empty((len(starts), b, h, n, n), x.q.dtype)
        if record is None
        else np.moveaxis(record.h, 1, 0)  # a view: the checkpoints are written to h
    )
    for index, t0 in enumerate(starts):
        checkpoints[index] = state
        forward_steps(x, state, t0, min(t0 + every, s))
        tick()
    if record is not None:
        record.final[...] = state
    del state

    d_state = np.zeros((b, h, n, n), x.q.dtype)  # dS: gradient reaching S_t from later steps
    states = np.empty((every + 1, b, h, n, n), x.q.dtype)
    for index in reversed(range(len(starts))):
        t0 = starts[index]
        t1 = min(t0 + every, s)
        states[0] = checkpoints[index]
        forward_steps(x, states[0].copy(), t0, t1, states=states)
        for t in reversed(range(t0, t1)):
            s_prev, s_t = states[t - t0], states[t - t0 + 1]
            qt, kt, vt, dyt = x.q[:, :, t], x.k[:, :, t], x.v[:, :, t], x.dy[:, :, t]
            bt = x.beta[:, :, t, None]
            a = row_scale(np.exp(x.g[:, :, t]))
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
        if record is not None:
            record.dh[:, index] = d_state
        tick()
    if grads.dstate is not None:
        grads.dstate[...] = d_state

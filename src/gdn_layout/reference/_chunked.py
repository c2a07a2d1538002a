"""The recurrence chunk by chunk: the delta rule of a chunk as one triangular system.

Inside a chunk of ``C`` steps entered with the state ``S0``, with ``G`` the cumulative log-gate
since the chunk's entry, every step's write ``u`` solves the unit lower-triangular system
``(I + beta * lk) u = beta * (v - ke @ S0)`` (the WY/UT form of chunked delta-rule kernels),
where ``ke[t] = exp(G_t) k[t]`` and ``lk[t, s] = exp(G_t - G_s) k[t] . k[s]`` for ``s < t``.
Then ``y = c * (qe @ S0 + lq @ u)`` and ``S_end = exp(G_end) S0 + sum_s exp(G_end - G_s)
outer(k[s], u[s])``: a chunk costs a few matrix products instead of ``C`` sequential updates.

The chunks of one batch of steps are stacked, padded to one length with steps that change
nothing (``k = q = v = beta = g = 0``), so that what does not depend on the state runs once
for all of them; only the state's own recurrence, forward and backward, steps from chunk to
chunk. A batch holds one chunk's worth of steps by default: full chunks stay one to a batch,
whose matrices fit in cache, and the short chunks of fast per-channel decay share one.

Four choices keep its rounding near the step-by-step form's in every gate regime:

* Every decay factor is ``exp(g[s+1] + ... + g[t])``, its exponent summed in float64 from the
  gates it spans, so a factor is rounded once and, for decaying gates, never exceeds 1. A
  per-channel gate decays key channels apart, so its ``lk`` is the product
  ``(exp(H) k) @ (exp(-H) k)^T``, ``H`` the log-gate since the chunk's first step; its chunks
  are cut where ``|H|`` would pass ``_MAX_LOG_DRIFT``, so no factor overflows.
* The triangular system is inverted by halves (see :func:`unit_lower_inverse`), which rounds
  like substitution, not by a power series, whose terms grow and cancel.
* The gate gradient sums, for each step, only the couplings that pass through that step's
  decay (see :func:`gate_gradient`): under strong decay it is tiny, and a form that adds and
  takes away large couplings would bury it in their rounding.
* The backward sweep runs in float64 even in a float32 computation: from the float32 inputs
  and the state entering each stack, kept by the float32 forward sweep, it steps through the
  stack's chunks again. Its sums can cancel many times over: a gate's couplings 35- to
  45-fold under fast decay, and the state's cotangent, stepped back through chunks whose
  updates nearly erase the state (keys near unit norm, ``beta = 1``, small N). Rounded to
  float32 term by term, their errors can outweigh the result; products of float32 numbers
  are exact in float64, which leaves the inputs' and the entry states' own rounding.

Inputs it does not suit (:func:`suits`: a single key channel, or a step whose update expands
the state) are left to the step-by-step form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..packing import GdnGrads
from ._chunk_math import (
    block_sum,
    cumulative,
    decays,
    exp_to,
    gate_gradient,
    lower_mask,
    pair_decay,
    reduce_gate,
    stepwise,
    straddling,
    straddling_split,
    transposed,
    unit_lower_inverse,
)
from ._inputs import Inputs
from ._recurrent import Boundaries, row_scale
from ._threads import mapped

_Array = NDArray[Any]

#: Largest growth ``exp(G_t - G_s)`` of a decay factor inside a chunk, and largest
#: ``|H|`` of a per-channel chunk: factors stay within ``exp(20)`` (about ``5e8``), far from
#: overflow in float32. Decaying gates never reach it with a per-head gate.
_MAX_LOG_DRIFT = 20.0

#: Longest chunk. Longer chunks trade sequential steps for larger matrix products.
_MAX_CHUNK = 64

#: Chunks stacked into one batch by default: enough to amortise the per-call cost of NumPy,
#: few enough that a stack's temporaries stay a small part of the inputs.
_STACK = 1

#: Longest chunk per unit of the state size N. A chunk's system couples its steps through
#: keys in N dimensions; for a small N they overlap more, and float32 rounding grows with the
#: chunk's length: 4*N keeps it within a few times the step-by-step form's (N = 1 to 16, g = 0).
_CHUNK_PER_STATE_SIZE = 4


#: Largest ``beta |k|^2`` of a step the chunked form takes. For ``0 <= beta |k|^2 <= 2`` a
#: step's map of the state, ``I - beta k k^T``, does not expand it; beyond, the state grows step
#: after step and the chunk's triangular system amplifies rounding that the step-by-step form
#: does not make.
_MAX_STEP_GAIN = 2.0


def suits(x: Inputs) -> bool:
    """Whether the chunked form is worth taking on ``x`` and as exact as the step-by-step one:
    more than one key channel (with one, a chunk's products are scalars: there is nothing to
    gain) and no step with ``beta |k|^2 > 2`` (keys of unit norm with ``beta <= 1`` have none)."""
    if x.q.shape[3] <= 1:
        return False
    with np.errstate(over="ignore", invalid="ignore"):  # a huge key counts as over 2
        gain = np.einsum("bhsn,bhsn->bhs", x.k, x.k, dtype=np.float64) * x.beta
        return not np.any(gain > _MAX_STEP_GAIN)


def chunk_length(state_size: int) -> int:
    """The longest chunk for states of ``state_size``."""
    return max(1, min(_MAX_CHUNK, _CHUNK_PER_STATE_SIZE * state_size))


def default_interval(seq: int, state_size: int) -> int:
    """How many steps to stack: ``_STACK`` whole chunks of the longest length."""
    return min(max(seq, 1), _STACK * chunk_length(state_size))


def chunk_bounds(g: _Array, t0: int, t1: int, length: int) -> list[tuple[int, int]]:
    """Split ``[t0, t1)`` into chunks of at most ``length`` steps whose factors stay bounded.

    A chunk's decay factors ``exp(G_t - G_s)``, ``t >= s`` (the entry counting as a step with
    ``G = 0``), may grow by at most ``exp(_MAX_LOG_DRIFT)``; with a per-channel gate
    ``|H_t|``, ``H`` the log-gate since the chunk's first step, is bounded likewise. A
    one-step chunk is always allowed: it is the step-by-step form.
    """
    per_channel = g.shape[-1] > 1
    bounds = []
    start = t0
    while start < t1:
        stop = min(start + length, t1)
        if stop - start > 1 and g.size:
            big_g = cumulative(g[:, :, start:stop])
            entry = np.zeros_like(big_g[:, :, :1])
            lowest = np.minimum.accumulate(np.concatenate((entry, big_g), axis=2), axis=2)
            bad = big_g - lowest[:, :, :-1] > _MAX_LOG_DRIFT
            if per_channel:
                bad |= np.abs(big_g - big_g[:, :, :1]) > _MAX_LOG_DRIFT
            over = np.flatnonzero(bad.any(axis=(0, 1, 3)))
            if over.size:
                stop = start + max(1, int(over[0]))
        bounds.append((start, stop))
        start = stop
    return bounds


class _Stack(NamedTuple):
    """The chunks of one interval, padded to ``length`` steps and stacked on the head axis.

    Arrays are ``[B, V, L, ...]`` with ``V = H * count``: head ``h``'s chunk ``j`` is at
    ``h * count + j``.
    """

    bounds: list[tuple[int, int]]
    heads: int
    length: int
    q: _Array | None
    k: _Array
    v: _Array
    g: _Array
    beta: _Array  # [B, V, L, 1]
    dy: _Array | None

    def split(self, a: _Array) -> _Array:
        """``[B, V, ...]`` as ``[B, H, count, ...]``."""
        return a.reshape(a.shape[0], self.heads, len(self.bounds), *a.shape[2:])


def _gather(a: _Array, bounds: list[tuple[int, int]], length: int) -> _Array:
    """The chunks ``bounds`` of ``a`` ``[B, H, S, ...]``, padded with zeros: ``[B, V, L, ...]``."""
    b, h, rest, count = a.shape[0], a.shape[1], a.shape[3:], len(bounds)
    t0, t1 = bounds[0][0], bounds[-1][1]
    if t1 - t0 == count * length:  # every chunk is full
        return a[:, :, t0:t1].reshape(b, h * count, length, *rest)
    out = np.zeros((b, h, count, length, *rest), a.dtype)
    for j, (c0, c1) in enumerate(bounds):
        out[:, :, j, : c1 - c0] = a[:, :, c0:c1]
    return out.reshape(b, h * count, length, *rest)


def _scatter(grad: _Array, values: _Array, st: _Stack) -> None:
    """Write ``values`` ``[B, V, L, ...]`` to the steps of ``st``'s chunks of ``grad``
    ``[B, S, H, ...]``, dropping the padding."""
    b, count, length = values.shape[0], len(st.bounds), st.length
    rest = values.shape[3:]
    t0, t1 = st.bounds[0][0], st.bounds[-1][1]
    if t1 - t0 == count * length:
        grad[:, t0:t1] = np.swapaxes(values.reshape(b, st.heads, t1 - t0, *rest), 1, 2)
        return
    split = st.split(values)
    for j, (c0, c1) in enumerate(st.bounds):
        grad[:, c0:c1] = np.swapaxes(split[:, :, j, : c1 - c0], 1, 2)


def _stack(x: Inputs, bounds: list[tuple[int, int]], *, backward: bool) -> _Stack:
    length = max(c1 - c0 for c0, c1 in bounds)
    pick = functools.partial(_gather, bounds=bounds, length=length)
    return _Stack(
        bounds,
        x.q.shape[1],
        length,
        pick(x.q) if backward else None,
        pick(x.k),
        pick(x.v),
        pick(x.g),
        pick(x.beta[..., None]),
        pick(x.dy) if backward and x.dy is not None else None,
    )


class _Prepared(NamedTuple):
    """What the chunks of a stack share that does not depend on the state."""

    rows: _Array  # [q; k] (q above k along time) with q, else k: [B, V, m*L, N]
    e: _Array  # exp(G): decay from the chunk's entry through step t, [B, V, L, Ng]
    to_end: _Array  # exp(G_end - G): decay from step t to the chunk's end, [B, V, L, Ng]
    xe: _Array  # e * rows: [qe; ke]
    lx: _Array  # [lq; lk]: decayed products of rows with k, masked; [B, V, m*L, L]
    pairs: _Array | None  # per-head gate: the decay from step s to t >= s, float64, [B, V, L, L]
    f: _Array | None  # per-channel gate: exp(H), H = G - G[0], [B, V, L, N]
    fi: _Array | None  # exp(-H); then lx = (f * rows) @ (fi * k)^T, masked
    inv: _Array  # inv(I + beta * lk), unit lower-triangular, [B, V, L, L]
    kd: _Array  # to_end * k: k decayed to the chunk's end

    @property
    def k(self) -> _Array:
        """The keys: the last block of ``rows``."""
        return self.rows[:, :, -self.lx.shape[-1] :]


class _Kept(NamedTuple):
    """What the forward sweep keeps of a stack for the backward sweep."""

    bounds: list[tuple[int, int]]
    pairs: _Array | None  # per-head gate: the pair decays, float64, [B, V, L, L]
    entry: _Array  # the state entering the stack, [B, H, N, N]


#: The dtype of the backward sweep.
_WIDE = np.dtype(np.float64)


def _prepare(st: _Stack, kept: _Kept, rows: _Array | None = None) -> _Prepared:
    """The stack's state-independent matrices, with the pair decays of ``kept``. ``rows``,
    ``[q; k]`` already formed, sets the dtype."""
    size = st.length
    if rows is None:
        rows = st.k if st.q is None else np.concatenate((st.q, st.k), axis=2)
    dtype = rows.dtype
    k = rows[:, :, -size:]
    mask = lower_mask(size, dtype, st.q is not None)
    e, to_end = decays(st.g, dtype)
    pairs = f = fi = None
    if st.g.shape[-1] == 1:
        pairs = kept.pairs
        assert pairs is not None
        lx = np.matmul(rows, transposed(k))
        _by_pair(lx, pairs)
        lx *= mask
    else:
        big_h = np.zeros(st.g.shape, np.float64)
        np.cumsum(st.g[:, :, 1:], axis=2, dtype=np.float64, out=big_h[:, :, 1:])
        f, fi = exp_to(big_h, dtype), exp_to(-big_h, dtype)
        lx = np.matmul(stepwise(f, rows), transposed(fi * k))
        lx *= mask
    system = st.beta * lx[:, :, -size:]
    system[..., np.arange(size), np.arange(size)] = 1
    inv = unit_lower_inverse(system)
    xe = stepwise(e, rows)
    return _Prepared(rows, e, to_end, xe, lx, pairs, f, fi, inv, to_end * k)


def _by_pair(lx: _Array, pairs: _Array) -> None:
    """Scale each ``[C, C]`` block of ``lx`` ``[B, V, m*C, C]`` by the pair decays, in place."""
    b, v, size = pairs.shape[:3]
    assert lx.flags.c_contiguous  # so that the reshape is a view, which the update goes through
    blocks = lx.reshape(b, v, lx.shape[2] // size, size, size)
    np.multiply(blocks, pairs[:, :, None], out=blocks, casting="same_kind")


class _Solved(NamedTuple):
    """What the stacked chunks solved from the state entering each of them."""

    entries: _Array  # the state entering each chunk, [B, V, N, N]
    u: _Array  # inv @ (beta * r), r = v - ke @ S0: what each step writes, [B, V, L, N]


def _advance(st: _Stack, pre: _Prepared, state: _Array) -> _Solved:
    """Step ``state`` through the stack's chunks in place, keeping what they solved."""
    size = st.length
    ke, kd, inv = st.split(pre.xe[:, :, -size:]), st.split(pre.kd), st.split(pre.inv)
    v, beta, e_end = st.split(st.v), st.split(st.beta), st.split(pre.e[:, :, -1])
    entries = np.empty((*v.shape[:3], *state.shape[2:]), state.dtype)
    u = np.empty(v.shape, state.dtype)
    for j in range(len(st.bounds)):
        entries[:, :, j] = state
        r_j = v[:, :, j] - np.matmul(ke[:, :, j], state)
        u[:, :, j] = np.matmul(inv[:, :, j], beta[:, :, j] * r_j)
        state *= row_scale(e_end[:, :, j])
        state += np.matmul(transposed(kd[:, :, j]), u[:, :, j])
    heads = pre.e.shape[1]
    return _Solved(_merge(entries, heads), _merge(u, heads))


def _merge(a: _Array, heads: int) -> _Array:
    """``[B, H, count, ...]`` as ``[B, V, ...]``."""
    return a.reshape(a.shape[0], heads, *a.shape[3:])


class Stack(NamedTuple):
    """One stack of the plan: its chunks and, with a per-head gate, their pair decays for
    every batch element and head, float64 ``[B, H * count, L, L]``."""

    bounds: list[tuple[int, int]]
    pairs: _Array | None


def plan(x: Inputs, every: int, length: int, threads: int = 1) -> list[Stack]:
    """The stacks of ``every`` steps, in chunks of at most ``length``, that :func:`forward` and
    :func:`backward` take: formed for all batch elements and heads at once, so that a part of
    them (:func:`part_of`) is computed exactly as the whole would be. A chunk is cut short
    where any head's decay calls for it, and the pair decays' exponents are one matrix
    product over all heads. Stacks are independent: ``threads`` form them side by side."""
    seq = x.q.shape[2]

    def stack(t0: int) -> Stack:
        bounds = chunk_bounds(x.g, t0, min(t0 + every, seq), length)
        pairs = None
        if x.g.shape[-1] == 1:
            gates = _gather(x.g, bounds, max(c1 - c0 for c0, c1 in bounds))
            pairs = pair_decay(gates[..., 0], _WIDE)
        return Stack(bounds, pairs)

    return mapped(stack, range(0, seq, every), threads)


def forward_plan(x: Inputs, threads: int = 1) -> list[Stack]:
    """The plan of :func:`forward`."""
    n = x.q.shape[3]
    return plan(x, default_interval(x.q.shape[2], n), chunk_length(n), threads)


def backward_plan(x: Inputs, every: int, threads: int = 1) -> list[Stack]:
    """The plan of :func:`backward` for stacks of ``every`` steps."""
    return plan(x, every, min(every, chunk_length(x.q.shape[3])), threads)


def part_of(stacks: list[Stack], batch: slice, heads: slice) -> list[Stack]:
    """The plan of the batch elements ``batch`` and heads ``heads`` (steps ``1``)."""
    part = []
    for stack in stacks:
        pairs = stack.pairs
        if pairs is not None:
            count = len(stack.bounds)
            assert heads.start is not None
            assert heads.stop is not None
            pairs = pairs[batch, heads.start * count : heads.stop * count]
        part.append(Stack(stack.bounds, pairs))
    return part


def forward(x: Inputs, state: _Array, y: _Array, stacks: list[Stack]) -> None:
    """The forward over the whole sequence: writes ``y`` and advances ``state`` to the end."""
    for stack in stacks:
        st = _stack(x, stack.bounds, backward=True)
        pre = _prepare(st, _Kept(stack.bounds, stack.pairs, state))
        solved = _advance(st, pre, state)
        size = st.length
        out = np.matmul(pre.xe[:, :, :size], solved.entries)  # y = c * (qe @ S0 + lq @ u)
        out += np.matmul(pre.lx[:, :, :size], solved.u)
        out *= x.scale
        _scatter(y, out, st)


def backward(
    x: Inputs,
    grads: GdnGrads | None,
    stacks: list[Stack],
    tick: Callable[[], None],
    record: Boundaries | None = None,
) -> None:
    """Backward by chunks, one stack of ``stacks`` at a time.

    The forward sweep keeps, for the backward sweep, the state entering every stack:
    ``O(B*H*N*N*S/C)`` elements for stacks of ``C`` steps; the plan holds the pair decays,
    ``O(B*S*H*L)`` for chunks of ``L`` steps; about the size of the inputs. The backward sweep
    forms the rest again, in float64: each chunk's system, the state entering it, and what each
    step wrote.

    With ``record``, the states entering the stacks are kept in ``record.h``, and the state's
    cotangent entering each stack and the final state are written to ``record``. Without
    ``grads`` (only with ``record``), the backward sweep steps only the state's cotangent back.
    """
    assert grads is not None or record is not None
    b, h, _, n = x.q.shape
    state = np.zeros((b, h, n, n), x.q.dtype) if x.state is None else x.state.copy()
    kept = []
    for index, stack in enumerate(stacks):
        if record is None:
            held = state.copy()
        else:  # h is the store of the entry states
            held = record.h[:, index]
            held[...] = state
        entry = _Kept(stack.bounds, stack.pairs, held)
        pre = _prepare(st := _stack(x, stack.bounds, backward=False), entry)
        kept.append(entry)
        _advance(st, pre, state)
        tick()
    if record is not None:
        record.final[...] = state
    del state

    d_state = np.zeros((b, h, n, n), _WIDE)
    wide = _Widener()
    while kept:
        entry = kept.pop()
        st = _stack(x, entry.bounds, backward=True)
        assert st.q is not None
        assert st.dy is not None
        rows = wide.rows(st.q, st.k)
        st = st._replace(
            v=wide("v", st.v), g=wide("g", st.g), beta=wide("beta", st.beta), dy=wide("dy", st.dy)
        )
        pre = _prepare(st, entry, rows)
        if grads is None:
            _step_back(st, pre, d_state, np.empty_like(pre.xe), x.scale)
        else:
            start = wide("entry", entry.entry)
            if record is not None and start is entry.entry:
                start = start.copy()  # stepped in place below: h keeps its own
            solved = _advance(st, pre, start)
            _backward_stack(x, grads, st, pre, solved, d_state)
        if record is not None and record.dh is not None:
            record.dh[:, len(kept)] = d_state
        tick()
    if grads is not None and grads.dstate is not None:
        grads.dstate[...] = d_state


class _Widener:
    """Float64 copies of a stack's arrays, made into buffers reused from stack to stack.

    A fresh copy for every stack is mapped and faulted in anew each time: in float32 at S=512,
    H=8, N=64 per head, 9,000 minor page faults per backward against 3,700 with the buffers.
    Each buffer holds one stack's copy at a time.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, _Array] = {}

    def _buffer(self, name: str, shape: tuple[int, ...]) -> _Array:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != shape:
            buffer = self._buffers[name] = np.empty(shape, _WIDE)
        return buffer

    def __call__(self, name: str, a: _Array) -> _Array:
        """``a`` in float64: ``a`` itself if it is, else its copy in the buffer ``name``."""
        if a.dtype == _WIDE:
            return a
        buffer = self._buffer(name, a.shape)
        np.copyto(buffer, a)
        return buffer

    def rows(self, q: _Array, k: _Array) -> _Array:
        """``[q; k]`` along time, in float64."""
        b, v, size, n = k.shape
        return np.concatenate((q, k), axis=2, out=self._buffer("rows", (b, v, 2 * size, n)))


def _step_back(
    st: _Stack, pre: _Prepared, d_state: _Array, cot: _Array, c: float
) -> tuple[_Array, _Array]:
    """Step the state's cotangent ``d_state`` back through the stack's chunks, in place.

    Writes ``c * dy`` to the first half of ``cot`` (``[B, V, 2L, N]``); returns the cotangent
    at each chunk's end and ``d_w``, both ``[B, V, ...]``.
    """
    assert st.dy is not None
    size = st.length
    lq = pre.lx[:, :, :size]
    qe, ke = pre.xe[:, :, :size], pre.xe[:, :, size:]

    # dS steps back: dS_entry = e_end * dS + qe^T @ (c dy) - ke^T @ (beta * d_w), with
    # d_w = inv^T @ d_u and d_u = kd @ dS + c * lq^T @ dy.
    c_dy = np.multiply(st.dy, c, out=cot[:, :, :size])
    d_u_local = st.split(np.matmul(transposed(lq), c_dy))
    from_dy = st.split(np.matmul(transposed(qe), c_dy))
    kd, inv_t = st.split(pre.kd), st.split(transposed(pre.inv))
    ke_t, beta_s, e_end = st.split(transposed(ke)), st.split(st.beta), st.split(pre.e[:, :, -1])
    d_ends = np.empty((*kd.shape[:3], *d_state.shape[2:]), d_state.dtype)
    d_w = np.empty(kd.shape, d_state.dtype)
    for j in reversed(range(len(st.bounds))):
        d_ends[:, :, j] = d_state
        d_w[:, :, j] = np.matmul(
            inv_t[:, :, j], np.matmul(kd[:, :, j], d_state) + d_u_local[:, :, j]
        )
        d_state *= row_scale(e_end[:, :, j])
        d_state += from_dy[:, :, j]
        d_state -= np.matmul(ke_t[:, :, j], beta_s[:, :, j] * d_w[:, :, j])
    heads = pre.e.shape[1]
    return _merge(d_ends, heads), _merge(d_w, heads)


def _backward_stack(
    x: Inputs, grads: GdnGrads, st: _Stack, pre: _Prepared, solved: _Solved, d_state: _Array
) -> None:
    """Backward of the stacked chunks ``st``; ``d_state`` goes from their end to their entry.

    The state's cotangent steps back chunk by chunk; everything else is done for all the
    chunks at once, on rows stacked as ``[q; k]`` where products share an operand.
    """
    size, c, ng = st.length, x.scale, st.g.shape[-1]
    beta, k = st.beta, pre.k
    lk = pre.lx[:, :, size:]
    ke = pre.xe[:, :, size:]
    s0, u = solved
    cot = np.empty_like(pre.xe)  # [c * dy; d_w], then [c * dy; -d_r]
    d_end, d_w = _step_back(st, pre, d_state, cot, c)
    r = st.v - np.matmul(ke, s0)  # u = inv @ (beta * r)

    # S_end = e_end * S0 + kd^T @ u: the couplings with the chunk's exit
    ud = np.matmul(u, transposed(d_end))  # d kd
    through = pre.e[:, :, -1] * reduce_gate(np.sum(s0 * d_end, axis=-1), ng)
    d_k = pre.to_end * ud
    exit_terms = np.multiply(ud, pre.kd, out=ud)

    # u = inv @ (beta * r) and y = c * (qe @ S0 + lq @ u): stacked cotangent rows
    # [c * dy; d_w] @ u^T hold d_lq and -d_am, with am = I + beta * lk.
    cot[:, :, size:] = d_w
    d_lx = np.matmul(cot, transposed(u))
    d_beta = np.sum(d_w * r, axis=-1)
    del r
    d_beta -= np.sum(d_lx[:, :, size:] * lk, axis=-1)
    d_lx *= lower_mask(size, d_lx.dtype, True)
    d_lx[:, :, size:] *= -beta  # d_lk = tril(beta * d_am, -1)
    d_r = beta * d_w

    # y = c * qe @ S0 and r = v - ke @ S0: cotangent rows [c * dy; -d_r] against S0
    np.negative(d_r, out=cot[:, :, size:])
    d_xe = np.matmul(cot, transposed(s0))
    del cot
    d_rows = stepwise(pre.e, d_xe)
    entry = block_sum(np.multiply(d_xe, pre.xe, out=d_xe), size)
    del d_xe

    # [lq; lk]: decayed products of [q; k] with k
    if pre.pairs is not None:
        couplings = straddling(pre.lx * d_lx)
        _by_pair(d_lx, pre.pairs)  # now the gradient of rows @ k^T
        d_rows += np.matmul(d_lx, k)
        d_k += np.matmul(transposed(d_lx), pre.rows)
    else:
        assert pre.f is not None
        assert pre.fi is not None
        xf, kb = stepwise(pre.f, pre.rows), pre.fi * k
        d_rows += stepwise(pre.f, np.matmul(d_lx, kb))
        d_k += pre.fi * np.matmul(transposed(d_lx), xf)
        couplings = straddling_split(d_lx, xf, kb)  # lx[t, s] split by key channel
    del d_lx
    d_k += d_rows[:, :, size:]

    d_g = gate_gradient(
        entry=reduce_gate(entry, ng),
        straddling=couplings,
        exit_=reduce_gate(exit_terms, ng),
        through=through,
    )
    _scatter(grads.dq, d_rows[:, :, :size], st)
    _scatter(grads.dk, d_k, st)
    _scatter(grads.dv, d_r, st)
    _scatter(grads.dbeta, d_beta, st)
    _scatter(grads.dg, d_g if x.layout.gate_per_channel else d_g[..., 0], st)

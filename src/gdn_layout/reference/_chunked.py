"""The recurrence chunk by chunk, a chunk's delta rule one unit lower-triangular system (WY/UT):
docs/reference.md, "The chunked form's rounding"."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..packing import GdnGrads
from ._inputs import Inputs
from ._recurrent import Boundaries, row_scale
from ._threads import mapped

_Array = NDArray[Any]

#: Largest growth ``exp(G_t - G_s)`` of a decay factor in a chunk, and largest ``|H|`` of a
#: per-channel chunk: within ``exp(20)``, far from float32's overflow.
_MAX_LOG_DRIFT = 20.0
#: Longest chunk; and per unit of N, as float32 rounding grows with the chunk's length where a
#: small N's keys overlap: 4*N keeps it within a few times the step-by-step form's.
_MAX_CHUNK, _CHUNK_PER_STATE_SIZE = 64, 4
#: Largest ``beta |k|^2`` of a step taken: up to 2, ``I - beta k k^T`` does not expand the state.
_MAX_STEP_GAIN = 2.0
#: Block length of :func:`straddling_split`.
_BLOCK = 8
#: The dtype of the backward sweep.
_WIDE = np.dtype(np.float64)


def exp_to(exponent: _Array, dtype: np.dtype[Any], where: _Array | bool = True) -> _Array:
    """``exp`` of a float64 exponent, rounded once to ``dtype``; 0 off ``where``."""
    out = np.zeros(exponent.shape, np.float64)
    np.exp(exponent, where=where, out=out)
    return out.astype(dtype, copy=False)


def reduce_gate(x: _Array, ng: int) -> _Array:
    """Sum ``[..., N]`` gate contributions down to ``[..., Ng]``."""
    return x if x.shape[-1] == ng else np.sum(x, axis=-1, keepdims=True)


def lower_mask(size: int, dtype: np.dtype[Any], with_q: bool) -> _Array:
    """The 0/1 mask of ``lk`` (strict lower triangle), below that of ``lq`` with ``with_q``."""
    strict = np.tri(size, k=-1, dtype=dtype)
    return np.concatenate((np.tri(size, dtype=dtype), strict)) if with_q else strict


def unit_lower_inverse(unit_lower: _Array) -> _Array:
    """``inv`` of unit lower-triangular ``[..., C, C]``, by halves: every level multiplies computed
    inverses, so it rounds like substitution (a power series would cancel)."""
    size = unit_lower.shape[-1]
    full = 1 << max(size - 1, 0).bit_length()  # the next power of two
    padded = np.zeros((*unit_lower.shape[:-2], full, full), unit_lower.dtype)
    padded[..., :size, :size] = unit_lower
    inverse = np.zeros_like(padded)
    diagonal = np.arange(full)
    padded[..., diagonal[size:], diagonal[size:]] = 1
    inverse[..., diagonal, diagonal] = 1
    half = 1
    while half < full:
        a, inv = _diagonal_blocks(padded, 2 * half), _diagonal_blocks(inverse, 2 * half)
        lower = np.matmul(inv[..., half:, half:], a[..., half:, :half])
        inv[..., half:, :half] = -np.matmul(lower, inv[..., :half, :half])
        half *= 2
    return inverse[..., :size, :size]


def _diagonal_blocks(square: _Array, size: int) -> _Array:
    """The ``size x size`` blocks on the diagonal of C-contiguous ``[..., F, F]``, as a view."""
    full, item = square.shape[-1], square.itemsize
    return np.ndarray(
        (*square.shape[:-2], full // size, size, size),
        square.dtype,
        buffer=square,
        strides=(*square.strides[:-2], size * (full + 1) * item, full * item, item),
    )


def stepwise(a: _Array, rows: _Array) -> _Array:
    """``a * rows``: factors ``a`` ``[B, H, C, Ng]`` on each block of ``C`` steps of ``rows``."""
    b, h, size, _ = a.shape
    blocks = rows.reshape(b, h, rows.shape[2] // size, size, rows.shape[-1])
    return (blocks * a[:, :, None]).reshape(rows.shape)


def block_sum(rows: _Array, size: int) -> _Array:
    """The sum of the blocks of ``size`` steps of ``rows`` ``[B, H, m*C, N]``."""
    b, h, length, n = rows.shape
    summed: _Array = np.sum(rows.reshape(b, h, length // size, size, n), axis=2)
    return summed


def transposed(x: _Array) -> _Array:
    return np.swapaxes(x, -1, -2)


def decays(gates: _Array, dtype: np.dtype[Any]) -> tuple[_Array, _Array]:
    """``exp(G)`` and ``exp(G_end - G)`` of chunks' gates ``[B, V, C, Ng]``, each exponent a sum of
    the gates it spans (a difference of cumulative sums would carry the whole chunk's rounding)."""
    to_end = np.zeros(gates.shape, np.float64)
    np.cumsum(gates[:, :, :0:-1], axis=2, dtype=np.float64, out=to_end[:, :, -2::-1])
    return exp_to(np.cumsum(gates, axis=2, dtype=np.float64), dtype), exp_to(to_end, dtype)


def pair_decay(gates: _Array, dtype: np.dtype[Any]) -> _Array:
    """``[t, s]``: ``exp(g[s+1] + ... + g[t])`` for ``t >= s``, else 0; ``gates`` ``[B, H, C]``."""
    size = gates.shape[-1]
    upto = lower_mask(size, np.dtype(np.float64), True)[:size]  # [t, r]: r <= t
    terms = upto * gates.astype(np.float64, copy=False)[..., None, :]
    after = _before(size, np.dtype(np.float64)).T  # [r, s]: r > s
    spans = np.matmul(terms.reshape(-1, size), after).reshape(terms.shape)  # one product
    return exp_to(spans, dtype, where=upto.astype(bool))


def straddling(couplings: _Array) -> _Array:
    """Per step ``t``, the sum of couplings ``[B, H, 2C, C]`` of a row ``t'`` with ``s`` where ``s
    < t <= t'``: ``[B, H, C, 1]``."""
    b, h, _, size = couplings.shape
    by_step = couplings.reshape(b, h, 2, size, size).sum(axis=2)  # q and k rows of step t'
    before = np.matmul(by_step, _before(size, couplings.dtype))  # [t', t]: s < t
    summed: _Array = np.sum(before * np.tri(size, dtype=couplings.dtype), axis=2)  # t' >= t
    return summed[..., None]


def _before(size: int, dtype: np.dtype[Any]) -> _Array:
    """``[s, t]``: 1 where ``s < t``. A row times it sums, for each ``t``, what comes before."""
    return np.triu(np.ones((size, size), dtype), 1)


def straddling_split(w: _Array, x: _Array, y: _Array) -> _Array:
    """:func:`straddling` of couplings split by key channel, ``x[t', i] w[t', s] y[s, i]``,
    without forming ``[C, C, N]``: in blocks of ``_BLOCK`` steps, couplings inside ``t``'s block
    from a small tensor, those with one end in it from masked products, those that leap over it
    from block totals. Returns ``[B, H, C, N]``.
    """
    batch, heads, _, size = w.shape
    n = y.shape[-1]
    count = -(-size // _BLOCK)
    full = count * _BLOCK
    wp = np.zeros((batch, heads, 2, full, full), w.dtype)
    wp[:, :, :, :size, :size] = w.reshape(batch, heads, 2, size, size)
    xp = np.zeros((batch, heads, 2, full, n), x.dtype)
    xp[:, :, :, :size] = x.reshape(batch, heads, 2, size, n)
    yp = np.zeros((batch, heads, full, n), y.dtype)
    yp[:, :, :size] = y
    xb = xp.reshape(batch, heads, 2, count, _BLOCK, n)
    yb = yp.reshape(batch, heads, count, _BLOCK, n)
    p_, t_, s_ = np.meshgrid(*(np.arange(_BLOCK),) * 3, indexing="ij")
    inside = ((s_ < t_) & (t_ <= p_)).astype(w.dtype)  # [t', t, s]: s < t <= t' in a block
    of = np.arange(full) // _BLOCK
    earlier = (of[None, :] < of[:, None]).astype(w.dtype)  # [t', s]: s in an earlier block
    k_, j_, l_ = np.meshgrid(*(np.arange(count),) * 3, indexing="ij")
    leap = ((k_ < j_) & (j_ < l_)).astype(w.dtype)  # [K, J, L]: K < J < L
    blocks = np.arange(count)

    # t', s and t in one block: for each row t' of the [q; k] blocks, its couplings with
    # s < t <= t' against y, times x[t'] (one row at a time keeps the temporaries small)
    out = np.zeros((batch, heads, count, _BLOCK, n), np.result_type(w, x, y))
    for c in range(2):
        square = wp[:, :, c].reshape(batch, heads, count, _BLOCK, count, _BLOCK)
        diagonal = np.moveaxis(square[..., blocks, :, blocks, :], 0, 2)  # [B, H, K, t', s]
        for row in range(_BLOCK):
            couplings = diagonal[:, :, :, row, None, :] * inside[row]  # [B, H, K, t, s]
            out += np.matmul(couplings, yb) * xb[:, :, c, :, row, None, :]
    # t' in t's block (t' >= t), s in an earlier block
    wm = wp * earlier
    xv = np.sum(xp * np.matmul(wm, yp[:, :, None]), axis=2).reshape(out.shape)
    out += np.flip(np.cumsum(np.flip(xv, axis=3), axis=3), axis=3)
    # s in t's block (s < t), t' in a later block
    yu = yp * np.sum(np.matmul(transposed(wm), xp), axis=2)
    out[:, :, :, 1:] += np.cumsum(yu.reshape(out.shape)[:, :, :, :-1], axis=3)
    # s in a block before t's, t' in a block after it: block-to-block totals
    totals = np.zeros((batch, heads, count, count, n), w.dtype)  # [K, L]: s in K, t' in L
    for block in range(count):
        cols = slice(block * _BLOCK, (block + 1) * _BLOCK)
        for c in range(2):
            partial = np.matmul(wp[:, :, c, :, cols], yb[:, :, block])  # [B, H, full, N]
            partial = partial.reshape(xb[:, :, c].shape)
            totals[:, :, block] += np.einsum("bhlpi,bhlpi->bhli", partial, xb[:, :, c])
    out += np.einsum("kjl,bhkli->bhji", leap, totals)[:, :, :, None]
    result: _Array = out.reshape(batch, heads, full, n)[:, :, :size]
    return result


def gate_gradient(*, entry: _Array, straddling: _Array, exit_: _Array, through: _Array) -> _Array:
    """A chunk's log-gate gradient, each gate's summed only from the couplings it decays.

    A coupling of a later point with an earlier one (the entry E, the steps, the exit X) has the
    coupling itself as log-derivative in every gate between them; so gate ``t`` sums the couplings
    of ``t' >= t`` or X with E or ``s < t``. The textbook reverse cumulative sum also adds terms
    that cancel in pairs, burying a tiny gradient under fast decay in their rounding.
    ``entry``, ``straddling``, ``exit_``: ``[B, H, C, Ng]``; ``through`` (X with E): ``[B, H, Ng]``.
    """
    d_g = straddling
    d_g += np.flip(np.cumsum(np.flip(entry, axis=2), axis=2), axis=2)  # t' >= t, with E
    d_g[:, :, 1:] += np.cumsum(exit_[:, :, :-1], axis=2)  # X, with s < t
    d_g += through[:, :, None]
    return d_g


def suits(x: Inputs) -> bool:
    """Whether to take the chunked form: more than one key channel, and no step with ``beta |k|^2 >
    2`` (an expanding update, which the triangular system would amplify)."""
    if x.q.shape[3] <= 1:
        return False
    with np.errstate(over="ignore", invalid="ignore"):  # a huge key counts as over 2
        gain = np.einsum("bhsn,bhsn->bhs", x.k, x.k, dtype=np.float64) * x.beta
        return not np.any(gain > _MAX_STEP_GAIN)


def chunk_length(state_size: int) -> int:
    """The longest chunk for states of ``state_size``."""
    return max(1, min(_MAX_CHUNK, _CHUNK_PER_STATE_SIZE * state_size))


def default_interval(seq: int, state_size: int) -> int:
    """How many steps to stack: one longest chunk (its matrices fit in cache)."""
    return min(max(seq, 1), chunk_length(state_size))


def _cut_chunks(g: _Array, t0: int, t1: int, length: int) -> list[tuple[int, int]]:
    """``[t0, t1)`` cut into chunks of at most ``length`` steps within which no decay factor grows
    by more than ``exp(_MAX_LOG_DRIFT)`` (nor, per channel, ``|H|`` passes it)."""
    per_channel = g.shape[-1] > 1
    bounds = []
    start = t0
    while start < t1:
        stop = min(start + length, t1)
        if stop - start > 1 and g.size:
            big_g = np.cumsum(g[:, :, start:stop], axis=2, dtype=np.float64)
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
    """A stack's chunks padded to ``length``, stacked: ``[B, V, L, ...]``, ``V = H * count``."""

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
    """Write ``values`` ``[B, V, L, ...]`` to ``st``'s steps of ``grad`` ``[B, S, H, ...]``."""
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


def _wide(a: _Array) -> _Array:
    return a.astype(_WIDE, copy=False)


def _prepare(st: _Stack, pairs: _Array | None, rows: _Array | None = None) -> _Prepared:
    """The stack's state-independent matrices; ``rows`` (``[q; k]``, if formed) sets the dtype."""
    size = st.length
    if rows is None:
        rows = st.k if st.q is None else np.concatenate((st.q, st.k), axis=2)
    dtype = rows.dtype
    k = rows[:, :, -size:]
    mask = lower_mask(size, dtype, st.q is not None)
    e, to_end = decays(st.g, dtype)
    f = fi = None
    if st.g.shape[-1] == 1:
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
    """Scale each ``[C, C]`` block of ``lx`` by the pair decays, in place."""
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
    """A stack of the plan: its chunks and (per-head gate) pair decays ``[B, H * count, L, L]``."""

    bounds: list[tuple[int, int]]
    pairs: _Array | None


def plan(x: Inputs, every: int | None = None, threads: int = 1) -> list[Stack]:
    """The stacks of ``every`` steps (default :func:`default_interval`) in chunks of at most
    :func:`chunk_length`, for all batch elements and heads at once, so that a part
    (:func:`part_of`) computes as the whole would."""
    seq, n = x.q.shape[2:]
    every = default_interval(seq, n) if every is None else every
    length = min(every, chunk_length(n))

    def stack(t0: int) -> Stack:
        bounds = _cut_chunks(x.g, t0, min(t0 + every, seq), length)
        pairs = None
        if x.g.shape[-1] == 1:
            gates = _gather(x.g, bounds, max(c1 - c0 for c0, c1 in bounds))
            pairs = pair_decay(gates[..., 0], _WIDE)
        return Stack(bounds, pairs)

    return mapped(stack, range(0, seq, every), threads)


def part_of(stacks: list[Stack], batch: slice, heads: slice) -> list[Stack]:
    """The plan of the batch elements ``batch`` and heads ``heads`` (steps ``1``)."""
    return [
        Stack(
            bounds,
            None
            if pairs is None
            else pairs[batch, heads.start * len(bounds) : heads.stop * len(bounds)],
        )
        for bounds, pairs in stacks
    ]


def forward(x: Inputs, state: _Array, y: _Array, stacks: list[Stack]) -> None:
    """The forward over the whole sequence: writes ``y`` and advances ``state`` to the end."""
    for stack in stacks:
        st = _stack(x, stack.bounds, backward=True)
        pre = _prepare(st, stack.pairs)
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
    """Backward by chunks, one stack at a time; its memory: reference's module docstring.

    The forward sweep keeps the state entering every stack; the backward sweep forms the rest
    again in float64. With ``record``, the entry states go to ``record.h``, their cotangents and
    the final state to ``record``; without ``grads`` only the state's cotangent steps back.
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
        pre = _prepare(st := _stack(x, stack.bounds, backward=False), stack.pairs)
        kept.append((stack, held))
        _advance(st, pre, state)
        tick()
    if record is not None:
        record.final[...] = state
    del state

    d_state = np.zeros((b, h, n, n), _WIDE)
    while kept:
        stack, held = kept.pop()
        st = _stack(x, stack.bounds, backward=True)
        assert st.q is not None
        assert st.dy is not None
        rows = np.concatenate((st.q, st.k), axis=2).astype(_WIDE, copy=False)
        st = st._replace(v=_wide(st.v), g=_wide(st.g), beta=_wide(st.beta), dy=_wide(st.dy))
        pre = _prepare(st, stack.pairs, rows)
        if grads is None:
            _step_back(st, pre, d_state, np.empty_like(pre.xe), x.scale)
        else:
            start = _wide(held)
            if record is not None and start is held:
                start = start.copy()  # stepped in place below: h keeps its own
            solved = _advance(st, pre, start)
            _backward_stack(x, grads, st, pre, solved, d_state)
        if record is not None and record.dh is not None:
            record.dh[:, len(kept)] = d_state
        tick()
    if grads is not None and grads.dstate is not None:
        grads.dstate[...] = d_state


def _step_back(
    st: _Stack, pre: _Prepared, d_state: _Array, cot: _Array, c: float
) -> tuple[_Array, _Array]:
    """Step ``d_state`` back through the stack's chunks in place."""
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
    """Backward of the stacked chunks ``st``; ``d_state`` goes from their end to their entry."""
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

"""The recurrence chunk by chunk: the delta rule of a chunk as one triangular system.

Inside a chunk of ``C`` steps entered with the state ``S0``, with ``G`` the cumulative log-gate
since the chunk's entry, every step's write ``u`` solves the unit lower-triangular system
``(I + beta * lk) u = beta * (v - ke @ S0)`` (the WY/UT form of chunked delta-rule kernels),
where ``ke[t] = exp(G_t) k[t]`` and ``lk[t, s] = exp(G_t - G_s) k[t] . k[s]`` for ``s < t``.
Then ``y = c * (qe @ S0 + lq @ u)`` and ``S_end = exp(G_end) S0 + sum_s exp(G_end - G_s)
outer(k[s], u[s])``: a chunk costs a few matrix products instead of ``C`` sequential updates.

Three choices keep it as exact as the step-by-step form in every gate regime:

* Every decay factor is ``exp(G_t - G_s)`` with ``t >= s``, formed from the difference of
  cumulative gates summed in a wider precision (float64 for float32, long double for float64),
  so a factor is rounded once and, for decaying gates, never exceeds 1. A per-channel gate
  decays key channels apart, so its ``lk`` is the product ``(exp(H) k) @ (exp(-H) k)^T``,
  ``H`` the log-gate since the chunk's first step; its chunks are cut where ``|H|`` would pass
  ``_MAX_LOG_DRIFT``, so no factor overflows.
* The triangular system is inverted by halves (see :func:`unit_lower_inverse`), which rounds
  like substitution, not by a power series, whose terms grow and cancel.
* The gate gradient sums, for each step, only the couplings that pass through that step's
  decay (see :func:`_gate_gradient`): under strong decay it is tiny, and a form that adds and
  takes away large couplings would bury it in their rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..packing import GdnGrads
from ._inputs import Inputs
from ._recurrent import row_scale

_Array = NDArray[Any]

#: Largest growth ``exp(G_t - G_s)`` of a decay factor inside a chunk, and largest
#: ``|H|`` of a per-channel chunk: factors stay within ``exp(20)`` (about ``5e8``), far from
#: overflow in float32. Decaying gates never reach it with a per-head gate.
_MAX_LOG_DRIFT = 20.0

#: Longest chunk. Longer chunks trade sequential steps for larger matrix products.
_MAX_CHUNK = 64

#: Longest chunk per unit of the state size N. A chunk's system couples its steps through
#: keys in N dimensions; for a small N they overlap more, and float32 rounding grows with the
#: chunk's length: 4*N keeps it within a few times the step-by-step form's (N = 1 to 16, g = 0).
_CHUNK_PER_STATE_SIZE = 4


def chunk_length(state_size: int) -> int:
    """The longest chunk for states of ``state_size``."""
    return max(1, min(_MAX_CHUNK, _CHUNK_PER_STATE_SIZE * state_size))


def default_interval(seq: int, state_size: int, sqrt_interval: int) -> int:
    """The checkpoint interval: ``sqrt_interval`` rounded up to whole chunks.

    The chunked sweep keeps one state per chunk anyway, so an interval shorter than a chunk
    would only cut chunks short.
    """
    length = chunk_length(state_size)
    return min(max(seq, 1), -(-sqrt_interval // length) * length)


def chunks(g: _Array, t0: int, t1: int, length: int) -> list[tuple[int, int]]:
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
            big_g = _cumulative(g[:, :, start:stop])
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


def _cumulative(gates: _Array) -> _Array:
    """Cumulative log-gates along time (axis 2), summed in float64."""
    summed: _Array = np.cumsum(gates, axis=2, dtype=np.float64)
    return summed


def _exp(exponent: _Array, dtype: np.dtype[Any]) -> _Array:
    """``exp`` of a float64 exponent, rounded once to ``dtype``."""
    return np.exp(exponent).astype(dtype, copy=False)


def _reduce_gate(x: _Array, ng: int) -> _Array:
    """Sum ``[..., N]`` gate contributions down to ``[..., Ng]``."""
    return x if x.shape[-1] == ng else np.sum(x, axis=-1, keepdims=True)


@functools.lru_cache(maxsize=16)
def _lower_mask(size: int, dtype: np.dtype[Any], with_q: bool) -> _Array:
    """The 0/1 mask of the chunk matrix ``lx``, ``[C, C]`` or ``[2C, C]``.

    The strict lower triangle for ``lk``, below the lower triangle with its diagonal for ``lq``
    when ``with_q``.
    """
    strict = np.tri(size, k=-1, dtype=dtype)
    mask = np.concatenate((np.tri(size, dtype=dtype), strict)) if with_q else strict
    mask.flags.writeable = False
    return mask


def unit_lower_inverse(unit_lower: _Array) -> _Array:
    """``inv(unit_lower)`` for unit lower-triangular ``[..., C, C]`` matrices.

    Inverted by halves, ``inv([[A, 0], [B, D]]) = [[inv(A), 0], [-inv(D) B inv(A), inv(D)]]``,
    all blocks of one size at once: every level multiplies computed inverses, so the rounding
    is that of substitution. A power series in the strictly lower part would form powers whose
    entries grow combinatorially with ``C`` and cancel.

    >>> a = np.array([[1.0, 0, 0], [2, 1, 0], [3, 4, 1]])
    >>> unit_lower_inverse(a) @ a
    array([[1., 0., 0.],
           [0., 1., 0.],
           [0., 0., 1.]])
    """
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


def _transposed(x: _Array) -> _Array:
    return np.swapaxes(x, -1, -2)


class _Chunk(NamedTuple):
    """The delta rule over one chunk of ``C`` steps: what its forward and backward share.

    ``rows`` is ``[q; k]`` (``q`` above ``k`` along time, ``2C`` rows) when the chunk is solved
    ``with_q``, else ``k`` alone; ``lx`` and ``xe`` stack likewise.
    """

    rows: _Array  # [q; k]
    e: _Array  # exp(G): decay from the chunk's entry state through step t, [B, H, C, Ng]
    to_end: _Array  # exp(G_end - G): decay from step t to the chunk's end, [B, H, C, Ng]
    xe: _Array  # e * rows: [qe; ke]
    lx: _Array  # [lq; lk]: decayed products of rows with k, masked; [B, H, m*C, C]
    decay: _Array | None  # per-head gate: lx = (rows @ k^T) * decay
    f: _Array | None  # per-channel gate: exp(H), H = G - G[0], [B, H, C, N]
    fi: _Array | None  # exp(-H); then lx = (f * rows) @ (fi * k)^T, masked
    r: _Array  # v - ke @ S0
    inv: _Array  # inv(I + beta * lk), unit lower-triangular, [B, H, C, C]
    u: _Array  # inv @ (beta * r)


def _decays(x: Inputs, t0: int, t1: int) -> tuple[_Array, _Array]:
    """``exp(G)`` and ``exp(G_end - G)`` for the steps ``t0 .. t1-1`` of a chunk.

    Each exponent is a sum of the gates it spans, not a difference of cumulative sums: a
    difference would carry the rounding of the whole chunk's sum into every factor.
    """
    gates = x.g[:, :, t0:t1]
    to_end = np.zeros(gates.shape, np.float64)
    np.cumsum(gates[:, :, :0:-1], axis=2, dtype=np.float64, out=to_end[:, :, -2::-1])
    return _exp(_cumulative(gates), x.k.dtype), _exp(to_end, x.k.dtype)


def _pair_decay(gates: _Array, dtype: np.dtype[Any]) -> _Array:
    """``[t, s]``: ``exp(g[s+1] + ... + g[t])`` for ``t >= s``, 0 above the diagonal.

    ``gates`` is ``[B, H, C]``. Every exponent sums its own gates (see :func:`_decays`), as a
    product of the gates, masked to the steps up to ``t``, with the mask of steps after ``s``.
    """
    size = gates.shape[-1]
    upto = _lower_mask(size, np.dtype(np.float64), True)[:size]  # [t, r]: r <= t
    spans = np.matmul(
        upto * gates.astype(np.float64, copy=False)[..., None, :],
        _before(size, np.dtype(np.float64)).T,
    )
    decay: _Array = np.zeros_like(spans)
    np.exp(spans, where=upto.astype(bool), out=decay)
    return decay.astype(dtype, copy=False)


def _solve(x: Inputs, state: _Array, t0: int, t1: int, *, with_q: bool) -> _Chunk:
    """The delta rule over steps ``t0 .. t1-1`` entered with ``state``: ``u`` for every step."""
    span = slice(t0, t1)
    size = t1 - t0
    dtype = x.k.dtype
    k, v = x.k[:, :, span], x.v[:, :, span]
    beta = x.beta[:, :, span, None]
    rows = np.concatenate((x.q[:, :, span], k), axis=2) if with_q else k
    mask = _lower_mask(size, dtype, with_q)
    e, to_end = _decays(x, t0, t1)
    decay = f = fi = None
    if x.g.shape[-1] == 1:
        decay = _pair_decay(x.g[:, :, span, 0], dtype)
        decay = np.concatenate((decay, decay), axis=2) if with_q else decay
        decay *= mask
        lx = np.matmul(rows, _transposed(k))
        lx *= decay
    else:
        big_h = np.zeros(x.g[:, :, span].shape, np.float64)
        np.cumsum(x.g[:, :, t0 + 1 : t1], axis=2, dtype=np.float64, out=big_h[:, :, 1:])
        f, fi = _exp(big_h, dtype), _exp(-big_h, dtype)
        lx = np.matmul(_stepwise(f, rows), _transposed(fi * k))
        lx *= mask
    xe = _stepwise(e, rows)
    r = v - np.matmul(xe[:, :, -size:], state)
    system = beta * lx[:, :, -size:]
    system[..., np.arange(size), np.arange(size)] = 1
    inv = unit_lower_inverse(system)
    u = np.matmul(inv, beta * r)
    return _Chunk(rows, e, to_end, xe, lx, decay, f, fi, r, inv, u)


def _advance(x: Inputs, state: _Array, ch: _Chunk, t0: int, t1: int) -> None:
    """``state`` from the entry of the chunk ``t0 .. t1-1`` to its end, in place."""
    grown = np.matmul(_transposed(ch.to_end * x.k[:, :, t0:t1]), ch.u)
    state *= row_scale(ch.e[:, :, -1])
    state += grown


def forward_chunk(x: Inputs, state: _Array, t0: int, t1: int, *, y: _Array | None = None) -> None:
    """One chunk's forward: advances ``state`` in place from step ``t0`` to the end of the chunk.

    Writes ``y[:, t0:t1]`` when ``y`` is given.
    """
    size = t1 - t0
    ch = _solve(x, state, t0, t1, with_q=y is not None)
    if y is not None:  # y = c * (qe @ S0 + lq @ u)
        out = np.matmul(ch.xe[:, :, :size], state)
        out += np.matmul(ch.lx[:, :, :size], ch.u)
        out *= x.scale
        y[:, t0:t1] = np.swapaxes(out, 1, 2)
    _advance(x, state, ch, t0, t1)


def _backward_chunk(
    x: Inputs,
    grads: GdnGrads,
    state: _Array,
    d_state: _Array,
    t0: int,
    t1: int,
    ch: _Chunk,
) -> None:
    """Backward of the chunk ``ch`` entered with ``state``; ``d_state`` goes from end to entry.

    Products that share an operand are done once on stacked rows: ``[q; k]`` for the decayed
    copies, and their cotangents likewise.
    """
    assert x.dy is not None
    span = slice(t0, t1)
    size = t1 - t0
    k, beta, dy = x.k[:, :, span], x.beta[:, :, span, None], x.dy[:, :, span]
    ng = x.g.shape[-1]
    lq, lk = ch.lx[:, :, :size], ch.lx[:, :, size:]

    # S_end = e_end * S0 + kd^T @ u, rows scaled, with kd = to_end * k.
    kd = ch.to_end * k
    ud = np.matmul(ch.u, _transposed(d_state))  # d kd
    e_end = ch.e[:, :, -1]
    exit_terms = kd * ud
    through = e_end * _reduce_gate(np.sum(state * d_state, axis=-1), ng)
    d_k = ch.to_end * ud
    d_u = np.matmul(kd, d_state)
    d_state *= row_scale(e_end)  # now the part of dS0 that comes from S_end

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
    d_rows = _stepwise(ch.e, d_xe)

    # [lq; lk]: decayed products of [q; k] with k
    if ch.decay is not None:
        d_raw = d_lx * ch.decay
        d_rows += np.matmul(d_raw, k)
        d_k += np.matmul(_transposed(d_raw), ch.rows)
        straddling = _straddling(ch.lx * d_lx)
    else:
        assert ch.f is not None
        assert ch.fi is not None
        xf, kb = _stepwise(ch.f, ch.rows), ch.fi * k
        d_rows += _stepwise(ch.f, np.matmul(d_lx, kb))
        d_k += ch.fi * np.matmul(_transposed(d_lx), xf)
        # lx[t, s] splits over key channels i as xf[t, i] * kb[s, i]
        straddling = _straddling_split(d_lx, xf, kb)
    d_k += d_rows[:, :, size:]

    d_g = _gate_gradient(
        entry=_reduce_gate(_block_sum(d_xe * ch.xe, size), ng),
        straddling=straddling,
        exit_=_reduce_gate(exit_terms, ng),
        through=through,
    )
    grads.dq[:, span] = np.swapaxes(d_rows[:, :, :size], 1, 2)
    grads.dk[:, span] = np.swapaxes(d_k, 1, 2)
    grads.dv[:, span] = np.swapaxes(d_r, 1, 2)
    grads.dbeta[:, span] = np.swapaxes(d_beta, 1, 2)
    if x.layout.gate_per_channel:
        grads.dg[:, span] = np.swapaxes(d_g, 1, 2)
    else:
        grads.dg[:, span] = np.swapaxes(d_g[..., 0], 1, 2)


def _straddling(couplings: _Array) -> _Array:
    """For each step ``t``, the sum of the step-to-step couplings that straddle it.

    ``couplings[t', s]`` ``[B, H, 2C, C]`` couples the step ``t'`` of the stacked ``[q; k]``
    rows with an earlier step ``s``; it straddles ``t`` when ``s < t <= t'``. Returns
    ``[B, H, C, 1]``.
    """
    size = couplings.shape[3]
    later = _lower_mask(size, couplings.dtype, True).copy()
    later[size:] += np.eye(size, dtype=later.dtype)  # t' >= t, in both blocks
    summed: _Array = np.sum(np.matmul(couplings, _before(size, couplings.dtype)) * later, axis=2)
    return summed[..., None]


@functools.lru_cache(maxsize=16)
def _before(size: int, dtype: np.dtype[Any]) -> _Array:
    """``[s, t]``: 1 where ``s < t``. A row times it sums, for each ``t``, what comes before."""
    mask = np.triu(np.ones((size, size), dtype), 1)
    mask.flags.writeable = False
    return mask


#: Block length of :func:`_straddling_split`.
_BLOCK = 8


def _straddling_split(w: _Array, x: _Array, y: _Array) -> _Array:
    """:func:`_straddling` for couplings split by key channel: ``x[t', i] w[t', s] y[s, i]``.

    ``w`` ``[B, H, 2C, C]``, ``x`` ``[B, H, 2C, N]``, ``y`` ``[B, H, C, N]``; returns
    ``[B, H, C, N]``. The ``[C, C, N]`` tensor of split couplings is never formed: with the
    steps in blocks of ``_BLOCK``, couplings inside ``t``'s block are summed from a small
    tensor, those with one end in ``t``'s block from two masked products, and those that
    leap over it from block-to-block totals. Every part is a sum of straddling couplings only.
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
    masks = _block_masks(count, w.dtype)
    blocks = np.arange(count)

    # t', s and t in one block: [t', t, s] masked by s < t <= t', then against y
    inside = wp.reshape(batch, heads, 2, count, _BLOCK, count, _BLOCK)[..., blocks, :, blocks, :]
    inside = np.moveaxis(inside, 0, 3)[:, :, :, :, :, None, :] * masks.inside
    summed = np.matmul(inside.reshape(batch, heads, 2, count, _BLOCK**2, _BLOCK), yb[:, :, None])
    out = np.einsum(
        "bhcjpti,bhcjpi->bhjti", summed.reshape(batch, heads, 2, count, _BLOCK, _BLOCK, n), xb
    )
    # t' in t's block (t' >= t), s in an earlier block
    wm = wp * masks.earlier
    xv = np.sum(xp * np.matmul(wm, yp[:, :, None]), axis=2).reshape(out.shape)
    out += np.flip(np.cumsum(np.flip(xv, axis=3), axis=3), axis=3)
    # s in t's block (s < t), t' in a later block
    yu = yp * np.sum(np.matmul(_transposed(wm), xp), axis=2)
    out[:, :, :, 1:] += np.cumsum(yu.reshape(out.shape)[:, :, :, :-1], axis=3)
    # s in a block before t's, t' in a block after it: block-to-block totals
    by_block = np.moveaxis(wp.reshape(batch, heads, 2 * full, count, _BLOCK), 3, 2)
    partial = np.matmul(by_block, yb).reshape(batch, heads, count, 2, count, _BLOCK, n)
    totals = np.einsum("bhkclpi,bhclpi->bhkli", partial, xb)
    out += np.einsum("kjl,bhkli->bhji", masks.leap, totals)[:, :, :, None]
    result: _Array = out.reshape(batch, heads, full, n)[:, :, :size]
    return result


class _BlockMasks(NamedTuple):
    inside: _Array  # [t', t, s]: s < t <= t' within a block
    earlier: _Array  # [t', s]: s in a block before t''s
    leap: _Array  # [K, J, L]: K < J < L


@functools.lru_cache(maxsize=16)
def _block_masks(count: int, dtype: np.dtype[Any]) -> _BlockMasks:
    """The masks of :func:`_straddling_split` for ``count`` blocks."""
    p, t, s = np.meshgrid(*(np.arange(_BLOCK),) * 3, indexing="ij")
    block = np.arange(count * _BLOCK) // _BLOCK
    k, j, m = np.meshgrid(*(np.arange(count),) * 3, indexing="ij")
    masks = _BlockMasks(
        ((s < t) & (t <= p)).astype(dtype),
        (block[None, :] < block[:, None]).astype(dtype),
        ((k < j) & (j < m)).astype(dtype),
    )
    for mask in masks:
        mask.flags.writeable = False
    return masks


def _gate_gradient(*, entry: _Array, straddling: _Array, exit_: _Array, through: _Array) -> _Array:
    """The gradient of a chunk's log-gates, each summed only from the couplings it decays.

    The chunk couples the state it is entered with (E), its steps, and the state it leaves (X).
    A coupling of a later point with an earlier one decays by the gates of the steps in
    between, and its log-derivative is the coupling itself; so the gate of step ``t`` collects
    exactly the couplings that straddle it: of a step ``t' >= t`` or X with E or a step
    ``s < t``. Summed directly, a tiny gradient under fast decay stays exact. The textbook form
    (a reverse cumulative sum of per-step terms) also adds couplings on one side of ``t``,
    which cancel in pairs and bury it in their rounding.

    ``entry`` ``[B, H, C, Ng]``: step ``t'`` with E; ``straddling`` ``[B, H, C, Ng]``: the
    step-to-step couplings (:func:`_straddling`); ``exit_`` ``[B, H, C, Ng]``: X with step
    ``s``; ``through`` ``[B, H, Ng]``: X with E. Returns ``[B, H, C, Ng]``.
    """
    d_g = straddling
    d_g += np.flip(np.cumsum(np.flip(entry, axis=2), axis=2), axis=2)  # t' >= t, with E
    d_g[:, :, 1:] += np.cumsum(exit_[:, :, :-1], axis=2)  # X, with s < t
    d_g += through[:, :, None]
    return d_g


def forward(x: Inputs, state: _Array, y: _Array) -> None:
    """The forward over the whole sequence: writes ``y`` and advances ``state`` to the end."""
    seq, size = x.q.shape[2], x.q.shape[3]
    for t0, t1 in chunks(x.g, 0, seq, chunk_length(size)):
        forward_chunk(x, state, t0, t1, y=y)


def backward(x: Inputs, grads: GdnGrads, every: int, tick: Callable[[], None]) -> None:
    """Backward by chunks, from checkpoints taken every ``every`` steps.

    The forward sweep keeps every chunk's matrices for the backward sweep:
    ``O(B*S*H*(C + N))`` elements, about twice the inputs.
    """
    b, h, s, n = x.q.shape
    state = np.zeros((b, h, n, n), x.q.dtype) if x.state is None else x.state.copy()
    # The chunks of every checkpoint interval, limited in length and in gate drift.
    length = min(every, chunk_length(n))
    intervals = [chunks(x.g, t0, min(t0 + every, s), length) for t0 in range(0, s, every)]
    checkpoints = np.empty((len(intervals), b, h, n, n), x.q.dtype)
    solved: dict[int, _Chunk] = {}
    for index, bounds in enumerate(intervals):
        checkpoints[index] = state
        for c0, c1 in bounds:
            solved[c0] = _solve(x, state, c0, c1, with_q=True)
            if c1 < s:  # the final state is not needed
                _advance(x, state, solved[c0], c0, c1)
        tick()
    del state

    d_state = np.zeros((b, h, n, n), x.q.dtype)
    for index in reversed(range(len(intervals))):
        bounds = intervals[index]
        # The entry state of every chunk of the interval; usually there is just one chunk.
        entries = [checkpoints[index]]
        for c0, c1 in bounds[:-1]:
            nxt = entries[-1].copy()
            _advance(x, nxt, solved[c0], c0, c1)
            entries.append(nxt)
        for (c0, c1), entry in zip(reversed(bounds), reversed(entries), strict=True):
            _backward_chunk(x, grads, entry, d_state, c0, c1, solved.pop(c0))
        tick()
    if grads.dstate is not None:
        grads.dstate[...] = d_state

"""The chunked form's building blocks: masks, decays, the triangular inverse, gate sums.

Arrays carry two leading batch axes ``[B, V, ...]``: batch elements, and heads (or heads times
chunks, when the chunks of an interval are stacked).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

_Array = NDArray[Any]


def cumulative(gates: _Array) -> _Array:
    """Cumulative log-gates along time (axis 2), summed in float64."""
    summed: _Array = np.cumsum(gates, axis=2, dtype=np.float64)
    return summed


def exp_to(exponent: _Array, dtype: np.dtype[Any], where: _Array | bool = True) -> _Array:
    """``exp`` of a float64 exponent, rounded once to ``dtype``; 0 outside ``where``.

    A factor below ``dtype``'s smallest normal number stays subnormal, as the step-by-step
    form's would: where nothing else is written (``beta = 0``), a result of that size is made
    of such factors alone.
    """
    out = np.zeros(exponent.shape, np.float64)
    np.exp(exponent, where=where, out=out)
    return out.astype(dtype, copy=False)


def reduce_gate(x: _Array, ng: int) -> _Array:
    """Sum ``[..., N]`` gate contributions down to ``[..., Ng]``."""
    return x if x.shape[-1] == ng else np.sum(x, axis=-1, keepdims=True)


@functools.lru_cache(maxsize=16)
def lower_mask(size: int, dtype: np.dtype[Any], with_q: bool) -> _Array:
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


def stepwise(a: _Array, rows: _Array) -> _Array:
    """``a * rows`` for per-step factors ``a`` ``[B, H, C, Ng]`` and ``rows`` ``[B, H, m*C, N]``.

    ``rows`` stacks ``m`` blocks of ``C`` steps (``[q; k]`` or ``k`` alone); each block is scaled
    by ``a``.
    """
    b, h, size, _ = a.shape
    blocks = rows.reshape(b, h, rows.shape[2] // size, size, rows.shape[-1])
    return (blocks * a[:, :, None]).reshape(rows.shape)


def block_sum(rows: _Array, size: int) -> _Array:
    """Sum the stacked blocks of ``size`` steps of ``rows`` ``[B, H, m*C, N]``: ``[B, H, C, N]``."""
    b, h, length, n = rows.shape
    summed: _Array = np.sum(rows.reshape(b, h, length // size, size, n), axis=2)
    return summed


def transposed(x: _Array) -> _Array:
    return np.swapaxes(x, -1, -2)


def decays(gates: _Array, dtype: np.dtype[Any]) -> tuple[_Array, _Array]:
    """``exp(G)`` and ``exp(G_end - G)`` for the gates ``[B, V, C, Ng]`` of chunks.

    ``G`` is the cumulative log-gate from the chunk's entry. Each exponent is a sum of the
    gates it spans, not a difference of cumulative sums: a difference would carry the rounding
    of the whole chunk's sum into every factor.
    """
    to_end = np.zeros(gates.shape, np.float64)
    np.cumsum(gates[:, :, :0:-1], axis=2, dtype=np.float64, out=to_end[:, :, -2::-1])
    return exp_to(cumulative(gates), dtype), exp_to(to_end, dtype)


def pair_decay(gates: _Array, dtype: np.dtype[Any]) -> _Array:
    """``[t, s]``: ``exp(g[s+1] + ... + g[t])`` for ``t >= s``, 0 above the diagonal.

    ``gates`` is ``[B, H, C]``. Every exponent sums its own gates (see :func:`decays`), as a
    product of the gates, masked to the steps up to ``t``, with the mask of steps after ``s``.
    """
    size = gates.shape[-1]
    upto = lower_mask(size, np.dtype(np.float64), True)[:size]  # [t, r]: r <= t
    terms = upto * gates.astype(np.float64, copy=False)[..., None, :]
    after = _before(size, np.dtype(np.float64)).T  # [r, s]: r > s
    spans = np.matmul(terms.reshape(-1, size), after).reshape(terms.shape)  # one product
    return exp_to(spans, dtype, where=upto.astype(bool))


def straddling(couplings: _Array) -> _Array:
    """For each step ``t``, the sum of the step-to-step couplings that straddle it.

    ``couplings[t', s]`` ``[B, H, 2C, C]`` couples the step ``t'`` of the stacked ``[q; k]``
    rows with an earlier step ``s``; it straddles ``t`` when ``s < t <= t'``. Returns
    ``[B, H, C, 1]``.
    """
    b, h, _, size = couplings.shape
    by_step = couplings.reshape(b, h, 2, size, size).sum(axis=2)  # q and k rows of step t'
    before = np.matmul(by_step, _before(size, couplings.dtype))  # [t', t]: s < t
    summed: _Array = np.sum(before * _later(size, couplings.dtype), axis=2)
    return summed[..., None]


@functools.lru_cache(maxsize=16)
def _later(size: int, dtype: np.dtype[Any]) -> _Array:
    """``[t', t]``: 1 where ``t' >= t``."""
    mask = np.tri(size, dtype=dtype)
    mask.flags.writeable = False
    return mask


@functools.lru_cache(maxsize=16)
def _before(size: int, dtype: np.dtype[Any]) -> _Array:
    """``[s, t]``: 1 where ``s < t``. A row times it sums, for each ``t``, what comes before."""
    mask = np.triu(np.ones((size, size), dtype), 1)
    mask.flags.writeable = False
    return mask


#: Block length of :func:`straddling_split`.
_BLOCK = 8


def straddling_split(w: _Array, x: _Array, y: _Array) -> _Array:
    """:func:`straddling` for couplings split by key channel: ``x[t', i] w[t', s] y[s, i]``.

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

    # t', s and t in one block: for each row t' of the [q; k] blocks, its couplings with
    # s < t <= t' against y, times x[t'] (one row at a time keeps the temporaries small)
    out = np.zeros((batch, heads, count, _BLOCK, n), np.result_type(w, x, y))
    for c in range(2):
        square = wp[:, :, c].reshape(batch, heads, count, _BLOCK, count, _BLOCK)
        diagonal = np.moveaxis(square[..., blocks, :, blocks, :], 0, 2)  # [B, H, K, t', s]
        for row in range(_BLOCK):
            couplings = diagonal[:, :, :, row, None, :] * masks.inside[row]  # [B, H, K, t, s]
            out += np.matmul(couplings, yb) * xb[:, :, c, :, row, None, :]
    # t' in t's block (t' >= t), s in an earlier block
    wm = wp * masks.earlier
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
    out += np.einsum("kjl,bhkli->bhji", masks.leap, totals)[:, :, :, None]
    result: _Array = out.reshape(batch, heads, full, n)[:, :, :size]
    return result


class _BlockMasks(NamedTuple):
    inside: _Array  # [t', t, s]: s < t <= t' within a block
    earlier: _Array  # [t', s]: s in a block before t''s
    leap: _Array  # [K, J, L]: K < J < L


@functools.lru_cache(maxsize=16)
def _block_masks(count: int, dtype: np.dtype[Any]) -> _BlockMasks:
    """The masks of :func:`straddling_split` for ``count`` blocks."""
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


def gate_gradient(*, entry: _Array, straddling: _Array, exit_: _Array, through: _Array) -> _Array:
    """The gradient of a chunk's log-gates, each summed only from the couplings it decays.

    The chunk couples the state it is entered with (E), its steps, and the state it leaves (X).
    A coupling of a later point with an earlier one decays by the gates of the steps in
    between, and its log-derivative is the coupling itself; so the gate of step ``t`` collects
    exactly the couplings that straddle it: of a step ``t' >= t`` or X with E or a step
    ``s < t``. Summed directly, a tiny gradient under fast decay stays exact. The textbook form
    (a reverse cumulative sum of per-step terms) also adds couplings on one side of ``t``,
    which cancel in pairs and bury it in their rounding.

    ``entry`` ``[B, H, C, Ng]``: step ``t'`` with E; ``straddling`` ``[B, H, C, Ng]``: the
    step-to-step couplings (:func:`straddling`); ``exit_`` ``[B, H, C, Ng]``: X with step
    ``s``; ``through`` ``[B, H, Ng]``: X with E. Returns ``[B, H, C, Ng]``.
    """
    d_g = straddling
    d_g += np.flip(np.cumsum(np.flip(entry, axis=2), axis=2), axis=2)  # t' >= t, with E
    d_g[:, :, 1:] += np.cumsum(exit_[:, :, :-1], axis=2)  # X, with s < t
    d_g += through[:, :, None]
    return d_g

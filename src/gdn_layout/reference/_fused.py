"""The chunked form as fused kernels compute it (fla's ``chunk_gated_delta_rule``, transformers'
``torch_chunk_gated_delta_rule``): chunks of 64 steps, substitution, the gate's gradient a reverse
cumulative sum, products on operands rounded to a class's precision. It only sets floors."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._dtypes import round_mantissa
from ..packing import empty
from ._inputs import check_result, validate

_Array = NDArray[Any]

#: The chunk length of the field's fused kernels (flash-linear-attention's ``BT = 64``).
FUSED_CHUNK = 64
#: Bytes of the forward's chunks kept for the backward; past it, a chunk is formed again
#: (as the kernels do). A chunk's temporaries are for every batch row and head at once: with a
#: per-channel gate ``[B, H, C, C, N]``, 64 times the chunk's inputs.
KEEP_BYTES = 64 << 20


class _Products:
    """Matrix products on operands rounded to ``bits`` mantissa bits (None: not rounded)."""

    def __init__(self, bits: int | None) -> None:
        self.bits = bits

    def operand(self, a: _Array) -> _Array:
        return a if self.bits is None else round_mantissa(a, self.bits)

    def __call__(self, a: _Array, b: _Array, ta: bool = False, tb: bool = False) -> _Array:
        """``a @ b``, ``a`` transposed first with ``ta``, ``b`` with ``tb``."""
        ra, rb = self.operand(a), self.operand(b)
        product: _Array = np.matmul(_t(ra) if ta else ra, _t(rb) if tb else rb)
        return product


def _t(a: _Array) -> _Array:
    return np.swapaxes(a, -1, -2)


def _reverse_cumsum(a: _Array) -> _Array:
    """The sums from each step to the chunk's end, along axis 2."""
    out: _Array = np.flip(np.cumsum(np.flip(a, axis=2), axis=2), axis=2)
    return out


def _pairs(a: _Array, b: _Array, decay: _Array) -> _Array:
    """``sum_n a[t, n] b[s, n] decay[t, s, n]``: a product of decayed keys, per channel."""
    out: _Array = np.matmul(decay * b[:, :, None, :, :], a[..., None])[..., 0]
    return out


def _rows(w: _Array, b: _Array, decay: _Array) -> _Array:
    """``sum_s w[t, s] b[s, n] decay[t, s, n]``."""
    out: _Array = np.matmul(w[:, :, :, None, :], decay * b[:, :, None, :, :])[:, :, :, 0, :]
    return out


def _cols(w: _Array, a: _Array, decay: _Array) -> _Array:
    """``sum_t w[t, s] a[t, n] decay[t, s, n]``."""
    by_s = np.swapaxes(decay * a[:, :, :, None, :], 2, 3)  # [B, H, s, t, N]
    out: _Array = np.matmul(_t(w)[:, :, :, None, :], by_s)[:, :, :, 0, :]
    return out


def _unit_lower_inverse(lower: _Array) -> _Array:
    """``(I + lower)^-1`` of strictly lower-triangular ``lower`` ``[..., C, C]`` by forward
    substitution, row by row, as the kernels' ``solve_tril`` does within its blocks."""
    size = lower.shape[-1]
    inv = np.zeros_like(lower)
    eye = np.eye(size, dtype=lower.dtype)
    for i in range(size):
        inv[..., i, :] = eye[i] - np.matmul(lower[..., i : i + 1, :i], inv[..., :i, :])[..., 0, :]
    return inv


class _Chunk:
    """One chunk's state-independent quantities for every batch row and head."""

    def __init__(self, parts: tuple[_Array, ...], prod: _Products) -> None:
        q, k, v, g, beta = parts
        self.q, self.k, self.v, self.beta, self.prod = q, k, v, beta, prod
        size = q.shape[2]
        self.per_channel = g.ndim == 4
        gc = np.cumsum(g, axis=2, dtype=g.dtype)
        self.incl = incl = np.tril(np.ones((size, size), bool))
        self.strict = np.tril(incl, -1)
        self.eg = np.exp(gc)
        if self.per_channel:
            diff = gc[:, :, :, None, :] - gc[:, :, None, :, :]  # [B, H, t, s, N]
            mask = incl[:, :, None]
            self.decay = np.exp(np.where(mask, diff, 0)) * mask
            self.g_last = gc[:, :, -1]  # [B, H, N]
            rk, rq = prod.operand(k), prod.operand(q)
            self.kk = _pairs(rk, rk, self.decay)
            self.m = _pairs(rq, rk, self.decay)
            self.kd_factor = np.exp(self.g_last[:, :, None, :] - gc)
            self.egn = self.eg
        else:
            diff = gc[:, :, :, None] - gc[:, :, None, :]
            self.decay = np.exp(np.where(incl, diff, 0)) * incl
            self.g_last = gc[:, :, -1]  # [B, H]
            self.qk, self.kk_plain = prod(q, k, tb=True), prod(k, k, tb=True)
            self.kk = self.kk_plain * self.decay
            self.m = self.qk * self.decay
            self.kd_factor = np.exp(self.g_last[:, :, None] - gc)[..., None]
            self.egn = self.eg[..., None]
        self.kd = k * self.kd_factor
        self.inv = _unit_lower_inverse(beta[..., None] * self.kk * self.strict)
        self.bk = beta[..., None] * self.egn * k
        self.bv = beta[..., None] * v
        self.w = prod(self.inv, self.bk)
        self.u = prod(self.inv, self.bv)
        self.qg = q * self.egn
        exit_decay = np.exp(self.g_last)
        self.exit_decay = exit_decay[..., None] if self.per_channel else exit_decay[..., None, None]

    def nbytes(self) -> int:
        """The bytes of the arrays it holds."""
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))

    def forward(self, h: _Array, scale: float) -> tuple[_Array, _Array]:
        """The outputs and the exit state of the chunk entered with ``h``."""
        prod = self.prod
        writes = self.u - prod(self.w, h)
        y = scale * (prod(self.qg, h) + prod(self.m, writes))
        return y, self.exit_decay * h + prod(self.kd, writes, ta=True)

    def backward(
        self, h: _Array, dh_exit: _Array, dy: _Array, scale: float, sizes: dict[str, _Array] | None
    ) -> tuple[_Array, ...]:
        """``dq, dk, dv, dg, dbeta`` of the chunk and its entry state's cotangent; with ``sizes``,
        the sums of absolute terms of each one's last sums are written there.
        """
        prod, q, k, v, beta = self.prod, self.q, self.k, self.v, self.beta
        writes = self.u - prod(self.w, h)
        d_writes = scale * prod(self.m, dy, ta=True) + prod(self.kd, dh_exit)
        dh = (
            scale * prod(self.qg, dy, ta=True)
            + self.exit_decay * dh_exit
            - prod(self.w, d_writes, ta=True)
        )
        dqg = scale * prod(dy, h, tb=True)
        dm = scale * prod(dy, writes, tb=True) * self.incl
        dkd = prod(writes, dh_exit, tb=True)
        # T = (I + L)^-1, W = T bk and U = T bv: dL = -T^T dT T^T.
        dw = -prod(d_writes, h, tb=True)
        dt = prod(d_writes, self.bv, tb=True) + prod(dw, self.bk, tb=True)
        dbv, dbk = prod(self.inv, d_writes, ta=True), prod(self.inv, dw, ta=True)
        dl = -prod(prod(self.inv, dt, ta=True), self.inv, tb=True) * self.strict
        dbl = beta[..., None] * dl  # the cotangent of the decayed k . k
        if self.per_channel:
            decay = self.decay
            dq = _rows(dm, k, decay)
            dk = _cols(dm, q, decay)
            dk += _rows(dbl, k, decay)
            dk += _cols(dbl, k, decay)
            terms = dbl[..., None] * k[:, :, :, None, :] + dm[..., None] * q[:, :, :, None, :]
            terms *= k[:, :, None, :, :] * decay  # [B, H, t, s, N]
            dgc = terms.sum(axis=3) - terms.sum(axis=2)
            dgc += dqg * self.qg - dkd * self.kd + dbk * self.bk
            dg_last = np.sum(h * dh_exit, axis=-1) * np.exp(self.g_last)
            dg_last += np.sum(dkd * self.kd, axis=2)
        else:
            dmd, dbld = dm * self.decay, dbl * self.decay
            dq = prod(dmd, k)
            dk = prod(dmd, q, ta=True) + prod(dbld, k) + prod(dbld, k, ta=True)
            terms = (dm * self.qk + dbl * self.kk_plain) * self.decay
            dgc = terms.sum(axis=-1) - terms.sum(axis=-2)
            dgc += np.sum(dqg * self.qg - dkd * self.kd + dbk * self.bk, axis=-1)
            dg_last = np.sum(h * dh_exit, axis=(-2, -1)) * np.exp(self.g_last)
            dg_last += np.sum(dkd * self.kd, axis=(-2, -1))
        dq += dqg * self.egn
        dk += dkd * self.kd_factor + dbk * beta[..., None] * self.egn
        dbeta = np.sum(dl * self.kk, axis=-1) + np.sum(dbk * k * self.egn + dbv * v, axis=-1)
        dv = dbv * beta[..., None]
        dgc[:, :, -1] += dg_last
        dg = _reverse_cumsum(dgc)
        if sizes is not None:
            # The gate's terms: each decay's row and column sums, and the products with q, k.
            a = np.abs(terms)
            plain = np.abs(dqg * self.qg) + np.abs(dkd * self.kd) + np.abs(dbk * self.bk)
            if self.per_channel:
                size_c = a.sum(axis=3) + a.sum(axis=2) + plain
                last = np.sum(np.abs(h * dh_exit), axis=-1) * np.exp(self.g_last)
                last += np.sum(np.abs(dkd * self.kd), axis=2)
            else:
                size_c = a.sum(axis=-1) + a.sum(axis=-2) + plain.sum(axis=-1)
                last = np.sum(np.abs(h * dh_exit), axis=(-2, -1)) * np.exp(self.g_last)
                last += np.sum(np.abs(dkd * self.kd), axis=(-2, -1))
            size_c[:, :, -1] += last
            sizes["dg"] = _reverse_cumsum(size_c)
            self._sizes(sizes, h, dh_exit, dy, scale, writes, d_writes, dm, dw, dbk, dbv, dl)
        return dq, dk, dv, dg, dbeta, dh

    def _sizes(
        self,
        out: dict[str, _Array],
        h: _Array,
        dh_exit: _Array,
        dy: _Array,
        scale: float,
        writes: _Array,
        d_writes: _Array,
        dm: _Array,
        dw: _Array,
        dbk: _Array,
        dbv: _Array,
        dl: _Array,
    ) -> None:
        """The sums of absolute terms of the last sums that form each result."""
        a = np.abs
        k, q, beta = a(self.k), a(self.q), self.beta[..., None]
        if self.per_channel:
            dq = _rows(a(dm), k, self.decay)
            dk = _cols(a(dm), q, self.decay)
            dbl = a(self.beta[..., None] * dl)
            dk += _rows(dbl, k, self.decay)
            dk += _cols(dbl, k, self.decay)
        else:
            dmd, dbld = a(dm) * self.decay, a(beta * dl) * self.decay
            dq, dk = dmd @ k, _t(dmd) @ q + dbld @ k + _t(dbld) @ k
        dq += (a(dy) @ _t(a(h))) * scale * self.egn
        dk += (a(writes) @ _t(a(dh_exit))) * self.kd_factor
        dk += (_t(a(self.inv)) @ a(dw)) * beta * self.egn
        out["dq"], out["dk"] = dq, dk
        out["dv"] = (_t(a(self.inv)) @ a(d_writes)) * beta
        out["dbeta"] = np.sum(a(dl * self.kk), axis=-1) + np.sum(
            a(dbk * self.k * self.egn) + a(dbv * self.v), axis=-1
        )
        out["dh"] = scale * (_t(a(self.qg)) @ a(dy)) + self.exit_decay * a(dh_exit)
        out["dh"] += _t(a(self.w)) @ a(d_writes)
        out["y"] = scale * (a(self.qg) @ a(h) + a(self.m) @ a(writes))
        out["h"] = self.exit_decay * a(h) + _t(a(self.kd)) @ a(writes)


def fused_backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    dy: ArrayLike,
    state: ArrayLike | None = None,
    *,
    chunk: int | None = None,
    bits: int | None = None,
    dtype: Any = np.float32,
    sizes: bool = False,
    length: int = FUSED_CHUNK,
    cotangent: _Array | None = None,
    keep: int = KEEP_BYTES,
) -> tuple[_Array, dict[str, _Array], tuple[_Array, dict[str, _Array]] | None]:
    """The fused kernels' chunked form, returned as :func:`._states.step_by_step` returns it.

    In ``dtype``, the matrix products' operands rounded to ``bits`` mantissa bits; chunks of
    ``length`` steps, cut also at every multiple of ``chunk`` (whose states are recorded).
    ``cotangent`` ``[B, H, N, N]``: one on the final state (a misreading's re-run). The forward's
    chunks are kept for the backward within ``keep`` bytes, formed again past it. With ``sizes``,
    the third item is the same of the sums of absolute terms of each result's last sums, in
    float64 (what another order of those sums can change by ````u`` each); else None.
    """
    x = validate(q, k, v, g, beta, state, dy, dtype)
    assert x.dy is not None
    layout, seq = x.layout, x.q.shape[2]
    gate = x.g if layout.gate_per_channel else x.g[..., 0]
    prod = _Products(bits)
    starts = set(range(0, seq, length)) | set(range(0, seq, chunk or seq or 1))
    bounds = [*sorted(starts), seq]
    # The cotangent at every boundary where the states are recorded, else two in turn.
    turns = chunk is None
    run = _Run(layout, bounds, x.q.dtype, turns)
    sized = _Run(layout, bounds, np.dtype(np.float64), False) if sizes else None
    if x.state is not None:
        run.h[0] = x.state
    kept: dict[int, _Chunk] = {}  # the forward's chunks, for the backward, within a budget

    def part(i: int) -> _Chunk:
        if i in kept:
            return kept.pop(i)
        span = slice(bounds[i], bounds[i + 1])
        parts = (x.q, x.k, x.v, gate, x.beta)
        return _Chunk(tuple(a[:, :, span] for a in parts), prod)

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for i in range(len(bounds) - 1):
            chunk_i = part(i)
            run.y[:, :, bounds[i] : bounds[i + 1]], run.h[i + 1] = chunk_i.forward(
                run.h[i], x.scale
            )
            if (size := chunk_i.nbytes()) <= keep:
                kept[i], keep = chunk_i, keep - size
        if cotangent is not None:
            run.dh[(len(bounds) - 1) % 2 if turns else -1] = cotangent
        for i in reversed(range(len(bounds) - 1)):
            span = slice(bounds[i], bounds[i + 1])
            found: dict[str, _Array] | None = None if sized is None else {}
            at, exit_at = (i % 2, (i + 1) % 2) if turns else (i, i + 1)
            *values, run.dh[at] = part(i).backward(
                run.h[i], run.dh[exit_at], x.dy[:, :, span], x.scale, found
            )
            run.put(span, values)
            if sized is not None and found is not None:
                sized.put(span, [found[name] for name in _GRADS])
                sized.y[:, :, span] = found["y"]
                sized.h[i + 1], sized.dh[i] = found["h"], found["dh"]
    carried = x.state is not None
    flat, outputs = run.result(bounds, chunk, carried)
    for name, array in (*zip(layout.names, run.grads, strict=False), *outputs.items()):
        if array is not None:
            check_result("the fused chunked form", name, array)
    return flat, outputs, None if sized is None else sized.result(bounds, chunk, carried)


_GRADS = ("dq", "dk", "dv", "dg", "dbeta")


class _Run:
    """A run's gradients, ``y`` and states at every boundary, as they fill in."""

    def __init__(self, layout: Any, bounds: list[int], dtype: Any, turns: bool) -> None:
        self.flat, self.grads = empty(layout, dtype)
        self.out = [np.moveaxis(a, 1, 2) for a in self.grads[:5]]  # [B, H, S, ...] views
        batch, heads, n = layout.batch, layout.heads, layout.state_size
        states = (len(bounds), batch, heads, n, n)
        self.y = np.zeros((batch, heads, bounds[-1], n), dtype)
        self.h = np.zeros(states, dtype)
        self.dh = np.zeros((2, *states[1:]) if turns else states, dtype)

    def put(self, span: slice, values: list[_Array]) -> None:
        for target, value in zip(self.out, values, strict=True):
            target[:, :, span] = value

    def result(
        self, bounds: list[int], chunk: int | None, carried: bool
    ) -> tuple[_Array, dict[str, _Array]]:
        """The packed gradients and ``y`` and the states as :func:`._states.step_by_step` gives
        them."""
        if self.grads.dstate is not None:
            self.grads.dstate[...] = self.dh[0]
        outputs = {"y": np.moveaxis(self.y, 1, 2)}
        if chunk is not None:
            at = [i for i, t in enumerate(bounds[:-1]) if t % chunk == 0]
            outputs.update(h=np.moveaxis(self.h[at], 0, 1), dh=np.moveaxis(self.dh[at], 0, 1))
        if chunk is not None or carried:
            outputs["final_state"] = self.h[-1]
        return self.flat, outputs

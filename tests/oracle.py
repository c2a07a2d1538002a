"""The truth the tests measure the reference against: the spec's step-by-step forward and backward
(``shared/spec/gated-delta-net.md``) in ``np.longdouble`` (a 64-bit mantissa on x86-64 Linux),
written apart from :mod:`gdn_layout.reference`, every state kept (test-sized inputs only). A
float64 or float32 input converts exactly: the result is the exact function of its values, up to
the long-double rounding of the recurrence."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

Array = NDArray[Any]

EXTENDED = np.dtype(np.longdouble)


class OracleResult(NamedTuple):
    """The forward's results and every gradient of ``sum(y * dy)`` in long double (``dstate``
    None without an initial state); ``peak`` the largest magnitude of any state or cotangent;
    ``states``/``dstates`` ``[B, S, H, N, N]`` the state entering each step and its cotangent;
    ``dbeta_terms`` the sum of the magnitudes of each ``dbeta``'s terms."""

    y: Array
    final: Array
    dq: Array
    dk: Array
    dv: Array
    dg: Array
    dbeta: Array
    dstate: Array | None
    peak: float
    states: Array
    dstates: Array
    dbeta_terms: Array


def extended(value: ArrayLike) -> Array:
    """``value`` converted (exactly, for float64 and float32 inputs) to long double."""
    return np.asarray(value).astype(EXTENDED)


def _heads_first(x: Array) -> Array:
    """``[B, S, H, ...]`` to ``[S, B, H, ...]``: one step at a time, every batch and head."""
    return np.moveaxis(x, 1, 0)


def _steps_second(x: Array) -> Array:
    return np.moveaxis(x, 0, 1)


def _decay(g_t: Array, per_channel: bool) -> Array:
    """``exp(g[t])`` shaped to scale ``[B, H, N, N]`` states: one factor per head, or one per
    key row with a per-channel gate."""
    a = np.exp(g_t)
    return a[..., :, None] if per_channel else a[..., None, None]


class _Tape(NamedTuple):
    q: Array  # [S, B, H, N]
    k: Array
    v: Array
    beta: Array  # [S, B, H]
    decay: Array  # [S, B, H, 1 or N, 1]
    prev: Array  # [S, B, H, N, N]: the state entering each step
    m: Array  # [S, B, H, N]
    u: Array
    y: Array  # [S, B, H, N]
    final: Array  # [B, H, N, N]
    per_channel: bool


def _run_forward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    state: ArrayLike | None,
) -> _Tape:
    qe, ke, ve, ge, be = (_heads_first(extended(x)) for x in (q, k, v, g, beta))
    steps, batch, heads, n = qe.shape
    per_channel = ge.ndim == 4
    c = 1 / np.sqrt(extended(max(n, 1)))  # N = 0: no term to scale
    current = (
        np.zeros((batch, heads, n, n), dtype=EXTENDED) if state is None else extended(state).copy()
    )
    decay = np.empty((steps, batch, heads, n if per_channel else 1, 1), dtype=EXTENDED)
    prev = np.empty((steps, batch, heads, n, n), dtype=EXTENDED)
    m = np.empty((steps, batch, heads, n), dtype=EXTENDED)
    u = np.empty_like(m)
    y = np.empty_like(m)
    for t in range(steps):
        decay[t] = _decay(ge[t], per_channel)
        prev[t] = current
        p = decay[t] * current  # P = A * S_prev
        m[t] = np.einsum("bhi,bhij->bhj", ke[t], p)  # m[j] = sum_i k[i] P[i, j]
        u[t] = (ve[t] - m[t]) * be[t][..., None]
        current = p + ke[t][..., :, None] * u[t][..., None, :]  # S_t = P + outer(k, u)
        y[t] = c * np.einsum("bhi,bhij->bhj", qe[t], current)
    return _Tape(qe, ke, ve, be, decay, prev, m, u, y, current, per_channel)


def oracle_forward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    state: ArrayLike | None = None,
) -> tuple[Array, Array]:
    """``(y, final_state)`` in long double, ``y`` ``[B, S, H, N]``, the state ``[B, H, N, N]``
    (the final state of a zero initial state when ``state`` is None)."""
    tape = _run_forward(q, k, v, g, beta, state)
    return _steps_second(tape.y), tape.final


def oracle(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    dy: ArrayLike,
    state: ArrayLike | None = None,
) -> OracleResult:
    """The forward and the spec's backward, step by step from ``S-1`` down to ``0``."""
    tape = _run_forward(q, k, v, g, beta, state)
    dye = _heads_first(extended(dy))
    steps, batch, heads, n = tape.q.shape
    c = 1 / np.sqrt(extended(max(n, 1)))  # N = 0: no term to scale
    dq = np.empty_like(tape.q)
    dk = np.empty_like(tape.k)
    dv = np.empty_like(tape.v)
    dbeta = np.empty_like(tape.beta)
    dbeta_terms = np.empty_like(tape.beta)
    dg = np.empty((steps, batch, heads, n) if tape.per_channel else (steps, batch, heads), EXTENDED)
    ds = np.zeros((batch, heads, n, n), dtype=EXTENDED)
    dstates = np.empty_like(tape.prev)
    peak = max(
        float(np.max(np.abs(tape.prev), initial=0.0)), float(np.max(np.abs(tape.final), initial=0))
    )
    for t in reversed(range(steps)):
        s_prev = tape.prev[t]
        a = tape.decay[t]
        p = a * s_prev
        s_t = tape.final if t == steps - 1 else tape.prev[t + 1]
        beta_t = tape.beta[t][..., None]
        dq[t] = c * np.einsum("bhij,bhj->bhi", s_t, dye[t])
        ds = ds + c * tape.q[t][..., :, None] * dye[t][..., None, :]
        dk_t = np.einsum("bhij,bhj->bhi", ds, tape.u[t])
        du = np.einsum("bhi,bhij->bhj", tape.k[t], ds)  # read before the second update
        dv[t] = beta_t * du
        dbeta[t] = np.sum((tape.v[t] - tape.m[t]) * du, axis=-1)
        dbeta_terms[t] = np.sum(np.abs((tape.v[t] - tape.m[t]) * du), axis=-1)
        dm = -beta_t * du
        dk[t] = dk_t + np.einsum("bhij,bhj->bhi", p, dm)
        dp = ds + tape.k[t][..., :, None] * dm[..., None, :]
        rows = np.sum(s_prev * dp, axis=-1)  # [B, H, N]: sum_j S_prev[i, j] dP[i, j]
        dg[t] = a[..., 0] * rows if tape.per_channel else a[..., 0, 0] * np.sum(rows, axis=-1)
        ds = a * dp
        dstates[t] = ds
        peak = max(peak, float(np.max(np.abs(ds), initial=0.0)))
    return OracleResult(
        y=_steps_second(tape.y),
        final=tape.final,
        dq=_steps_second(dq),
        dk=_steps_second(dk),
        dv=_steps_second(dv),
        dg=_steps_second(dg),
        dbeta=_steps_second(dbeta),
        dstate=None if state is None else ds,
        peak=peak,
        states=_steps_second(tape.prev),
        dstates=_steps_second(dstates),
        dbeta_terms=_steps_second(dbeta_terms),
    )


def oracle_chunk_states(*inputs: ArrayLike | None, chunk: int) -> tuple[Array, Array, Array]:
    """``(h, dh, final)``: the state entering each chunk of ``chunk`` steps and its cotangent,
    ``[B, ceil(S / chunk), H, N, N]``, and the final state, all in long double."""
    exact = oracle(*inputs)  # type: ignore[arg-type]
    return exact.states[:, ::chunk], exact.dstates[:, ::chunk], exact.final


def relative_error(
    actual: ArrayLike, truth: ArrayLike, dtype: DTypeLike = np.float64, least: float = 0.0
) -> float:
    """``max|actual - truth| / max|truth|`` in long double; the scale never below ``dtype``'s
    smallest normal number nor ``least``; absolute where the truth is all zero; infinite for a
    result that is not finite."""
    a = extended(actual)
    b = extended(truth)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    if not np.all(np.isfinite(a)):
        return float("inf")
    error = np.max(np.abs(a - b))
    scale = max(np.max(np.abs(b)), extended(least))
    if scale == 0:
        return float(error)
    return float(error / max(scale, extended(np.finfo(dtype).tiny)))


def reading_the_final_state(x: list[Any], cot: Array) -> list[Any]:
    """``q, k, v, g, beta, dy, state`` with ``N`` more steps whose ``sum(y * dy)`` is
    ``<cot, S_T>``: they leave the state as it is (``k = v = beta = g = 0``) and step ``i``
    reads row ``i`` of ``S_T`` (``q = e_i``) against ``cot[i] / c``. The gradients of the longer
    sequence, cut at ``S``, are those of the op with a cotangent ``cot`` on its final state."""
    b, _, h, n = np.shape(x[0])
    reads = np.broadcast_to(np.eye(n)[None, :, None, :], (b, n, h, n))
    zeros = np.zeros((b, n, h, n))
    extra = [reads, zeros, zeros, np.zeros((b, n, h, *np.shape(x[3])[3:])), np.zeros((b, n, h))]
    extra.append(np.sqrt(n) * np.transpose(cot, (0, 2, 1, 3)))
    return [*(np.concatenate(p, axis=1) for p in zip(x[:6], extra, strict=True)), x[6]]

"""The fast step-by-step form computes exactly what its plain form computes.

Fixtures keep floors measured from the float32 step-by-step form, so its every bit matters:
here it is checked against the spec written out plainly, one NumPy expression per line (the
form it replaced), on inputs that reach the outer product's exact-zero fallback (``beta`` of 0,
keys with zero channels, subnormal values).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.reference import backward, chunk_states, forward
from gdn_layout.reference._states import step_by_step

Array = NDArray[Any]


def plain_backward(x: list[Any], dtype: Any, per_channel: bool) -> list[Array]:
    """The spec's backward, step by step, with every intermediate a fresh array."""
    q, k, v, g, beta, dy = (np.moveaxis(np.asarray(a, dtype), 1, 2).copy() for a in x[:6])
    state0 = None if x[6] is None else np.asarray(x[6], dtype)
    if not per_channel:
        g = g[..., None]
    b, h, s, n = q.shape
    c = 1.0 / math.sqrt(n) if n else 1.0  # a Python float, as the reference's
    state = np.zeros((b, h, n, n), dtype) if state0 is None else state0.copy()
    states = [state.copy()]
    for t in range(s):
        state = state * np.exp(g[:, :, t])[..., :, None]
        m = np.matmul(k[:, :, t, None, :], state)[..., 0, :]
        u = (v[:, :, t] - m) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * u[..., None, :]
        states.append(state)
    dq, dk, dv = (np.zeros((b, s, h, n), dtype) for _ in range(3))
    dg = np.zeros((b, s, h, n) if per_channel else (b, s, h), dtype)
    dbeta = np.zeros((b, s, h), dtype)
    d_state = np.zeros((b, h, n, n), dtype)
    for t in reversed(range(s)):
        s_prev, s_t = states[t], states[t + 1]
        kt, vt, dyt, bt = k[:, :, t], v[:, :, t], dy[:, :, t], beta[:, :, t, None]
        a = np.exp(g[:, :, t])[..., :, None]
        p = a * s_prev
        m = np.matmul(kt[..., None, :], p)[..., 0, :]
        u = (vt - m) * bt
        dq[:, t] = c * np.matmul(s_t, dyt[..., None])[..., 0]
        d_state = d_state + c * q[:, :, t, :, None] * dyt[..., None, :]
        dkt = np.matmul(d_state, u[..., None])[..., 0]
        du = np.matmul(kt[..., None, :], d_state)[..., 0, :]
        dv[:, t] = bt * du
        dbeta[:, t] = np.sum((vt - m) * du, axis=-1)
        dm = -bt * du
        dkt = dkt + np.matmul(p, dm[..., None])[..., 0]
        dk[:, t] = dkt
        d_state = d_state + kt[..., :, None] * dm[..., None, :]
        dgt = a[..., 0] * np.sum(s_prev * d_state, axis=-1)
        dg[:, t] = dgt if per_channel else np.sum(dgt, axis=-1)
        d_state = d_state * a
    out = [dq, dk, dv, dg, dbeta]
    return out if state0 is None else [*out, d_state]


def _inputs(layout: GdnBackwardLayout, seed: int, zeros: bool, dtype: Any) -> list[Any]:
    rng = np.random.default_rng(seed)
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    q, k, v, dy = (rng.standard_normal((b, s, h, n)) for _ in range(4))
    q /= np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-30)
    k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-30)
    g = -rng.uniform(0, 90, layout.input_shape("g")) * (rng.random(layout.input_shape("g")) < 0.5)
    beta = rng.uniform(0, 1, (b, s, h))
    state = rng.standard_normal((b, h, n, n)) if layout.carry_state else None
    if zeros:  # exact zeros and subnormals where outer products are formed
        beta[rng.random(beta.shape) < 0.3] = 0.0
        k[rng.random(k.shape) < 0.2] = 0.0
        dy[rng.random(dy.shape) < 0.2] = -0.0
        v[rng.random(v.shape) < 0.1] = 1e-42 if dtype == np.float32 else 1e-310
    return [a if a is None else a.astype(dtype) for a in (q, k, v, g, beta, dy, state)]


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    layout=st.from_type(GdnBackwardLayout),
    seed=st.integers(0, 2**16),
    zeros=st.booleans(),
    dtype=st.sampled_from((np.float32, np.float64)),
    workers=st.sampled_from((1, 3)),
)
def test_the_step_by_step_form_is_the_plain_spec_bit_for_bit(
    layout: GdnBackwardLayout, seed: int, zeros: bool, dtype: Any, workers: int
) -> None:
    x = _inputs(layout, seed, zeros, dtype)
    with np.errstate(all="ignore"):
        expected = plain_backward(x, dtype, layout.gate_per_channel)
    try:
        flat = backward(*x, dtype=dtype, method="recurrent", checkpoint_every=3, workers=workers)
    except FloatingPointError:
        return  # an overflow the plain form shares
    for name, got, want in zip(layout.names, unpack(flat, layout), expected, strict=False):
        assert got is not None
        assert got.tobytes() == want.astype(dtype).tobytes(), name


def _separately(x: list[Any], chunk: int | None, dtype: Any, workers: int) -> dict[str, Array]:
    """What step_by_step replaces: backward, forward and chunk_states, each run on its own."""
    q, k, v, g, beta, _dy, state = x
    options: dict[str, Any] = {"dtype": dtype, "method": "recurrent", "workers": workers}
    result = {"packed": backward(*x, **options)}
    y = forward(q, k, v, g, beta, state, **options)
    if state is None:
        result["y"] = y
    else:
        result["y"], result["final_state"] = y
    if chunk is not None:
        result["h"], result["dh"], result["final_state"] = chunk_states(*x, chunk=chunk, **options)
    return result


def _check_step_by_step(x: list[Any], chunk: int | None, dtype: Any, workers: int) -> None:
    try:
        expected = _separately(x, chunk, dtype, workers)
    except FloatingPointError:
        with pytest.raises(FloatingPointError, match=r"^the step-by-step form: "):
            step_by_step(*x, chunk=chunk, dtype=dtype, workers=workers)
        return
    packed, outputs = step_by_step(*x, chunk=chunk, dtype=dtype, workers=workers)
    got = {"packed": packed, **outputs}
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].dtype == want.dtype, name
        assert got[name].shape == want.shape, name
        assert got[name].tobytes() == want.tobytes(), name


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    layout=st.from_type(GdnBackwardLayout),
    seed=st.integers(0, 2**16),
    zeros=st.booleans(),
    dtype=st.sampled_from((np.float32, np.float64)),
    chunk=st.none() | st.integers(1, 9),
    workers=st.sampled_from((1, 3)),
)
def test_one_step_by_step_run_gives_what_three_runs_give_bit_for_bit(
    layout: GdnBackwardLayout, seed: int, zeros: bool, dtype: Any, chunk: int | None, workers: int
) -> None:
    """The gradients, y, the final state and h, dh of one backward are those of backward,
    forward and chunk_states, exact zeros and subnormals included: a step does not depend on
    where the checkpoints fall."""
    _check_step_by_step(_inputs(layout, seed, zeros, dtype), chunk, dtype, workers)


@pytest.mark.slow
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("chunk", [None, 7, 100, 600])
def test_one_step_by_step_run_across_the_forward_s_spans(chunk: int | None, zeros: bool) -> None:
    """Past 256 steps the forward reads its inputs in spans whose edges the backward's
    checkpoints do not share (at 7 and 100 steps, say), and a span without a near-zero key
    forms its outer products by the matrix product: still the same bits, with and without
    exact zeros."""
    layout = GdnBackwardLayout(2, 600, 2, 8, gate_per_channel=True, carry_state=True)
    _check_step_by_step(_inputs(layout, 9, zeros, np.float32), chunk, np.float32, 1)


def test_step_by_step_names_itself_in_an_overflow() -> None:
    layout = GdnBackwardLayout(1, 40, 1, 4)
    q, k, v, g, beta, dy, state = _inputs(layout, 1, False, np.float32)
    k *= 100  # far from unit norm: with no decay the state grows without bound
    g[...] = 0
    beta[...] = 1
    message = r"^the step-by-step form: .* is (inf|-inf|nan) at index"
    with pytest.raises(FloatingPointError, match=message):
        step_by_step(q, k, v, g, beta, dy, state)


@pytest.mark.parametrize("per_channel", [False, True])
def test_the_recurrent_forward_is_the_plain_spec(per_channel: bool) -> None:
    layout = GdnBackwardLayout(2, 40, 3, 16, gate_per_channel=per_channel, carry_state=True)
    q, k, v, g, beta, _dy, state = _inputs(layout, 5, True, np.float32)
    y, final = forward(q, k, v, g, beta, state, dtype=np.float32, method="recurrent")
    gates = g if per_channel else g[..., None]
    s_ = state.copy()
    for t in range(layout.seq):
        s_ = s_ * np.exp(gates[:, t])[..., :, None]
        m = np.matmul(k[:, t, :, None, :], s_)[..., 0, :]
        u = (v[:, t] - m) * beta[:, t, :, None]
        s_ = s_ + k[:, t, :, :, None] * u[..., None, :]
        want = 0.25 * np.matmul(q[:, t, :, None, :], s_)[..., 0, :]
        assert y[:, t].tobytes() == want.tobytes(), t
    assert final.tobytes() == s_.tobytes()

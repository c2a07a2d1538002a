"""The fused kernels' chunked form (reference._fused): the same function as the reference, its
products' operands rounded as a class's kernels round them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout._floors import term_scales
from gdn_layout.generate import draw_inputs
from gdn_layout.reference._fused import FUSED_CHUNK, chunk_bounds, fused_backward
from gdn_layout.reference._states import step_by_step
from gdn_layout.regimes import REGIMES


def _relative(a: np.ndarray, e: np.ndarray) -> float:
    scale = float(np.max(np.abs(e), initial=0.0))
    return float(np.max(np.abs(a - e), initial=0.0)) / scale if scale else 0.0


@settings(max_examples=60, deadline=None)
@given(
    layout=st.from_type(GdnBackwardLayout),
    regime=st.sampled_from(REGIMES),
    length=st.integers(1, 9),
    chunk=st.none() | st.integers(1, 7),
)
def test_in_float64_it_computes_the_op(
    layout: GdnBackwardLayout, regime: str, length: int, chunk: int | None
) -> None:
    # Unrounded, in float64, the chunked form is the op: every gradient, y and the states
    # as the step-by-step form gives them, for any chunk length and any recorded chunk.
    x = draw_inputs(layout, regime=regime, seed=1, dtype=np.float64)
    packed, outputs, _ = fused_backward(*x, dtype=np.float64, length=length, chunk=chunk)
    truth, truth_outputs = step_by_step(*x, dtype=np.float64, chunk=chunk)
    assert set(outputs) == set(truth_outputs)
    # dg is a difference of terms far larger than it under extreme decay: it is exact to
    # the rounding of those terms (their scale), as the criterion judges it.
    terms = term_scales(x.q, x.k, *unpack(truth, layout)[:2], per_channel=layout.gate_per_channel)
    for seg in layout.segments():
        span = slice(seg.offset, seg.offset + seg.length)
        if seg.name == "dg":
            error = float(np.max(np.abs(packed[span] - truth[span]), initial=0.0))
            assert error <= 1e-9 * max(terms["dg"], float(np.max(np.abs(truth[span]), initial=0.0)))
            continue
        assert _relative(packed[span], truth[span]) < 1e-9, seg.name
    for name, array in outputs.items():
        assert array.shape == truth_outputs[name].shape
        assert _relative(array, truth_outputs[name]) < 1e-9, name


@settings(max_examples=40, deadline=None)
@given(
    layout=st.from_type(GdnBackwardLayout).filter(lambda layout: layout.state_size > 0),
    regime=st.sampled_from(REGIMES),
    length=st.integers(1, 9),
)
def test_a_cotangent_on_the_final_state_is_that_of_steps_that_read_it(
    layout: GdnBackwardLayout, regime: str, length: int
) -> None:
    # <C, S_T> is what N more steps that leave the state as it is (k = v = beta = g = 0)
    # output against dy: step i reads row i of S_T (q = e_i) against C[i] / c. So the
    # step-by-step form of the longer sequence, cut at S, is the truth with a cotangent C.
    x = draw_inputs(layout, regime=regime, seed=2, dtype=np.float64)
    q, k, v, g, beta, dy, state = x
    b, s, h, n = q.shape
    cot = np.random.default_rng(3).standard_normal((b, h, n, n))
    reads = np.broadcast_to(np.eye(n)[None, :, None, :], (b, n, h, n))
    against = np.sqrt(n) * cot.transpose(0, 2, 1, 3)  # [B, i, H, :] = C[b, h, i] / c
    none = np.zeros((b, n, h, *g.shape[3:]))
    longer = (
        np.concatenate([q, reads], axis=1),
        np.concatenate([k, np.zeros((b, n, h, n))], axis=1),
        np.concatenate([v, np.zeros((b, n, h, n))], axis=1),
        np.concatenate([g, none], axis=1),
        np.concatenate([beta, np.zeros((b, n, h))], axis=1),
        np.concatenate([dy, against], axis=1),
        state,
    )
    flat = fused_backward(*x, dtype=np.float64, length=length, cotangent=cot)[0]
    truth = step_by_step(*longer, dtype=np.float64)[0]
    longer_layout = GdnBackwardLayout.from_inputs(longer[0], longer[3], state)
    got, want = unpack(flat, layout), unpack(truth, longer_layout)
    terms = term_scales(q, k, want.dq[:, :s], want.dk[:, :s], per_channel=layout.gate_per_channel)
    for name in layout.names:
        a, e = getattr(got, name), getattr(want, name)
        e = e if name == "dstate" else e[:, :s]
        if name == "dg":  # exact to the rounding of its terms, as above
            scale = max(terms["dg"], float(np.max(np.abs(e), initial=0.0)))
            assert float(np.max(np.abs(a - e), initial=0.0)) <= 1e-9 * scale
            continue
        assert _relative(a, e) < 1e-9, name


def test_chunks_are_cut_at_the_recorded_boundaries_too() -> None:
    assert chunk_bounds(150, None) == [0, 64, 128, 150]
    assert chunk_bounds(150, 48) == [0, 48, 64, 96, 128, 144, 150]
    assert chunk_bounds(0, 5) == [0]
    assert FUSED_CHUNK == 64


@pytest.mark.parametrize("per_channel", [False, True])
def test_rounded_operands_round_the_result_as_their_precision(per_channel: bool) -> None:
    # Errors grow with the operands' unit roundoff: float32, then 10 bits, then 7.
    layout = GdnBackwardLayout(1, 70, 2, 16, gate_per_channel=per_channel, carry_state=True)
    x = draw_inputs(layout, regime="mild", seed=2)
    truth, _ = step_by_step(*x, dtype=np.float64)
    errors = [
        _relative(fused_backward(*x, bits=bits)[0].astype(np.float64), truth)
        for bits in (None, 10, 7)
    ]
    assert errors[0] < 1e-5 < errors[1] < errors[2] < 1
    assert 2 < errors[2] / errors[1] < 32  # about 2**3


def test_sizes_bound_each_result() -> None:
    # The sums of absolute terms of each result's last sums are at least the result.
    layout = GdnBackwardLayout(2, 40, 2, 8, gate_per_channel=True, carry_state=True)
    x = draw_inputs(layout, regime="qwen", seed=3)
    packed, outputs, sized = fused_backward(*x, dtype=np.float64, chunk=16, sizes=True)
    assert sized is not None
    sizes, size_outputs = sized
    assert np.all(sizes >= np.abs(packed) * (1 - 1e-12))
    for name in ("y", "dh", "final_state"):
        assert np.all(size_outputs[name] >= np.abs(outputs[name]) * (1 - 1e-12)), name
    # The state entering the first chunk is the initial one, exact: no terms, no rounding.
    assert not np.any(size_outputs["h"][:, 0])
    assert np.all(size_outputs["h"][:, 1:] >= np.abs(outputs["h"][:, 1:]) * (1 - 1e-12))
    grads = unpack(sizes, layout)
    assert all(np.all(np.isfinite(g)) for g in grads if g is not None)

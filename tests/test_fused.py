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
from gdn_layout.reference._fused import fused_backward
from gdn_layout.reference._states import step_by_step
from gdn_layout.regimes import REGIMES
from oracle import reading_the_final_state


def _relative(a: np.ndarray, e: np.ndarray, scale: float = 0.0) -> float:
    """max |a - e| over max |e| (or ``scale``, if larger)."""
    scale = max(scale, float(np.max(np.abs(e), initial=0.0)))
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
    terms = term_scales(x.q, x.k, *unpack(truth, layout)[:2], per_channel=layout.gate_per_channel)
    got, want = unpack(packed, layout), unpack(truth, layout)
    for name in layout.names:  # dg is exact to the rounding of its terms, as the criterion has it
        scale = terms["dg"] if name == "dg" else 0.0
        assert _relative(getattr(got, name), getattr(want, name), scale) < 1e-9, name
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
    x = draw_inputs(layout, regime=regime, seed=2, dtype=np.float64)
    q, k, _, _, _, _, state = x
    b, s, h, n = q.shape
    cot = np.random.default_rng(3).standard_normal((b, h, n, n))
    longer = reading_the_final_state(list(x), cot)
    flat = fused_backward(*x, dtype=np.float64, length=length, cotangent=cot)[0]
    truth = step_by_step(*longer, dtype=np.float64)[0]
    longer_layout = GdnBackwardLayout.from_inputs(longer[0], longer[3], state)
    got, want = unpack(flat, layout), unpack(truth, longer_layout)
    terms = term_scales(q, k, want.dq[:, :s], want.dk[:, :s], per_channel=layout.gate_per_channel)
    for name in layout.names:
        e = getattr(want, name) if name == "dstate" else getattr(want, name)[:, :s]
        scale = terms["dg"] if name == "dg" else 0.0
        assert _relative(getattr(got, name), e, scale) < 1e-9, name


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

"""Tests of the reference forward and backward of the gated delta-net."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.reference import Method, backward, default_checkpoint_every, forward
from gdn_layout.reference._recurrent import step_gradients
from oracle import oracle

Array = NDArray[Any]
Inputs = dict[str, Array]

METHODS: tuple[Method, ...] = ("chunked", "recurrent")
MODES = [
    pytest.param(False, False, id="per_head-no_state"),
    pytest.param(False, True, id="per_head-carry_state"),
    pytest.param(True, False, id="per_channel-no_state"),
    pytest.param(True, True, id="per_channel-carry_state"),
]
# (B, S, H, N): S=1, N=1, B>1 and H>1 all appear.
FD_SHAPES = [(1, 1, 1, 1), (1, 1, 2, 3), (2, 4, 1, 1), (2, 3, 2, 3), (1, 6, 3, 2)]


def make_inputs(
    shape: tuple[int, int, int, int],
    *,
    per_channel: bool,
    carry: bool,
    seed: int = 0,
    gate_low: float = -1.0,
    gate_high: float = 0.2,
) -> Inputs:
    """Random inputs of moderate size; keys are L2-normalised as the op's callers do."""
    rng = np.random.default_rng(seed)
    b, s, h, n = shape
    k = rng.standard_normal(shape)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    inputs = {
        "q": rng.standard_normal(shape),
        "k": k,
        "v": rng.standard_normal(shape),
        "g": rng.uniform(gate_low, gate_high, shape if per_channel else (b, s, h)),
        "beta": rng.uniform(0.1, 1.0, (b, s, h)),
        "dy": rng.standard_normal(shape),
    }
    if carry:
        inputs["state"] = rng.standard_normal((b, h, n, n))
    return inputs


def loss(inputs: Inputs) -> float:
    """``sum(y * dy)`` through the step-by-step forward."""
    q, k, v, g, beta = (inputs[name] for name in ("q", "k", "v", "g", "beta"))
    state = inputs.get("state")
    if state is None:
        y = forward(q, k, v, g, beta, method="recurrent")
    else:
        y = forward(q, k, v, g, beta, state, method="recurrent")[0]
    return float(np.sum(y * inputs["dy"]))


def run_backward(inputs: Inputs, **kwargs: Any) -> Array:
    return backward(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["g"],
        inputs["beta"],
        inputs["dy"],
        inputs.get("state"),
        **kwargs,
    )


def grads_of(inputs: Inputs, **kwargs: Any) -> dict[str, Array]:
    flat = run_backward(inputs, **kwargs)
    layout = GdnBackwardLayout.from_inputs(inputs["q"], inputs["g"], inputs.get("state"))
    views = unpack(flat, layout)
    return {
        name: np.asarray(getattr(views, "d" + name))
        for name in ("q", "k", "v", "g", "beta", "state")
        if getattr(views, "d" + name) is not None
    }


def finite_difference(inputs: Inputs, name: str, step: float = 1e-5) -> Array:
    """Central differences of :func:`loss` with respect to every element of ``inputs[name]``."""
    base = inputs[name]
    estimate = np.empty_like(base)
    for index in np.ndindex(base.shape):
        saved = base[index]
        base[index] = saved + step
        up = loss(inputs)
        base[index] = saved - step
        down = loss(inputs)
        base[index] = saved
        estimate[index] = (up - down) / (2 * step)
    return estimate


def assert_close_to(actual: Array, expected: Array, rel: float, what: str) -> None:
    """Every element within ``rel`` times the largest magnitude of ``expected``: the measure of
    rounding differences, which scale with the largest terms of the sums they come from."""
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-300)
    error = float(np.max(np.abs(actual - expected), initial=0.0))
    assert error <= rel * scale, f"{what}: max error {error:.3g} vs scale {scale:.3g}"


def assert_each_close_to(
    actual: Array, expected: Array, rel: float, what: str, floor: float = 1e-9
) -> None:
    """Every element within ``rel`` of its own expected value; ``floor`` is the absolute noise
    of a float64 central difference (about ``eps * |loss| / step``), for elements near zero."""
    error = np.abs(actual - expected)
    allowed = rel * np.abs(expected) + floor
    worst = np.unravel_index(int(np.argmax(error - allowed)), error.shape) if error.size else ()
    assert np.all(error <= allowed), (
        f"{what}{list(map(int, worst))}: {float(actual[worst]):.12g} vs finite difference "
        f"{float(expected[worst]):.12g}"
    )


# --------------------------------------------------------------------------------------------
# Gradients against finite differences
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize("shape", FD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_gradient_matches_finite_differences(
    shape: tuple[int, int, int, int], per_channel: bool, carry: bool, method: str
) -> None:
    inputs = make_inputs(shape, per_channel=per_channel, carry=carry, seed=sum(shape))
    grads = grads_of(inputs, method=method)
    expected_names = {"q", "k", "v", "g", "beta"} | ({"state"} if carry else set())
    assert set(grads) == expected_names
    for name, grad in grads.items():
        assert grad.shape == inputs[name].shape
        assert_each_close_to(grad, finite_difference(inputs, name), 1e-6, f"d{name}")


@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize("shape", [(2, 9, 2, 3), (1, 17, 3, 4)], ids=["2x9x2x3", "1x17x3x4"])
def test_directional_derivative(
    shape: tuple[int, int, int, int], per_channel: bool, carry: bool
) -> None:
    inputs = make_inputs(shape, per_channel=per_channel, carry=carry, seed=7)
    grads = grads_of(inputs, checkpoint_every=4)
    rng = np.random.default_rng(11)
    step = 1e-5
    for _ in range(3):
        direction = {name: rng.standard_normal(grads[name].shape) for name in grads}
        predicted = sum(float(np.sum(grads[name] * direction[name])) for name in grads)
        plus = {**inputs, **{name: inputs[name] + step * direction[name] for name in grads}}
        minus = {**inputs, **{name: inputs[name] - step * direction[name] for name in grads}}
        estimate = (loss(plus) - loss(minus)) / (2 * step)
        assert predicted == pytest.approx(estimate, rel=1e-6, abs=1e-9)


# --------------------------------------------------------------------------------------------
# Checkpointing and the two formulations
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("per_channel", "carry"), MODES)
def test_checkpointing_does_not_change_the_result(per_channel: bool, carry: bool) -> None:
    seq = 11
    inputs = make_inputs((2, seq, 2, 3), per_channel=per_channel, carry=carry, seed=3)
    # Every state kept: one interval covering the whole sequence.
    full = run_backward(inputs, method="recurrent", checkpoint_every=seq)
    for every in (1, 2, 3, 5, default_checkpoint_every(seq), seq, seq + 4):
        for method in METHODS:
            result = run_backward(inputs, method=method, checkpoint_every=every)
            assert_close_to(result, full, 1e-12, f"{method}, checkpoint_every={every}")
            if method == "recurrent":
                # Same operations in the same order: bit for bit.
                np.testing.assert_array_equal(result, full)


@pytest.mark.parametrize(
    ("low", "high"),
    [(-16.0, -9.0), (5.0, 9.0), (-12.0, 12.0), (-800.0, -700.0)],
    ids=["strong-decay", "growth", "mixed", "underflow"],
)
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_chunked_matches_recurrent_when_chunks_must_be_cut(
    low: float, high: float, per_channel: bool
) -> None:
    """Large gates force drift-limited chunks; exp(-800) underflows to zero without harm."""
    inputs = make_inputs(
        (1, 12, 2, 3), per_channel=per_channel, carry=True, seed=5, gate_low=low, gate_high=high
    )
    if high > 0:  # keep growth bounded so that the values stay representable
        inputs["g"] /= 4.0
    expected = run_backward(inputs, method="recurrent")
    for every in (1, 5, 12):
        result = run_backward(inputs, method="chunked", checkpoint_every=every)
        assert np.all(np.isfinite(result))
        assert_close_to(result, expected, 1e-11, f"checkpoint_every={every}")
    y_rec, final_rec = forward(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["g"],
        inputs["beta"],
        inputs["state"],
        method="recurrent",
    )
    y_chk, final_chk = forward(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], inputs["state"]
    )
    assert_close_to(y_chk, y_rec, 1e-11, "y")
    assert_close_to(final_chk, final_rec, 1e-11, "final state")


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    s=st.integers(1, 20),
    h=st.integers(1, 2),
    n=st.integers(1, 5),
    every=st.integers(1, 24),
    per_channel=st.booleans(),
    carry=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_recurrent(
    b: int, s: int, h: int, n: int, every: int, per_channel: bool, carry: bool, seed: int
) -> None:
    inputs = make_inputs((b, s, h, n), per_channel=per_channel, carry=carry, seed=seed)
    expected = run_backward(inputs, method="recurrent", checkpoint_every=every)
    result = run_backward(inputs, method="chunked", checkpoint_every=every)
    assert_close_to(result, expected, 1e-11, "packed gradient")


def test_forward_matches_the_spec_written_out() -> None:
    """One head, written with explicit loops over the spec's formulas."""
    inputs = make_inputs((1, 5, 1, 3), per_channel=True, carry=True, seed=9)
    q, k, v, g, beta = (inputs[name][0, :, 0] for name in ("q", "k", "v", "g", "beta"))
    state = inputs["state"][0, 0].copy()
    c = 1 / np.sqrt(3)
    expected = np.zeros((5, 3))
    for t in range(5):
        p = np.exp(g[t])[:, None] * state
        m = np.array([sum(k[t, i] * p[i, j] for i in range(3)) for j in range(3)])
        u = (v[t] - m) * beta[t]
        state = p + np.outer(k[t], u)
        expected[t] = c * np.array([sum(q[t, i] * state[i, j] for i in range(3)) for j in range(3)])
    for method in METHODS:
        y, final = forward(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            inputs["g"],
            inputs["beta"],
            inputs["state"],
            method=method,
        )
        np.testing.assert_allclose(y[0, :, 0], expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(final[0, 0], state, rtol=1e-12, atol=1e-12)


def test_forward_without_state_returns_y_only() -> None:
    inputs = make_inputs((2, 4, 2, 3), per_channel=False, carry=False)
    y = forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    assert isinstance(y, np.ndarray)
    assert y.shape == (2, 4, 2, 3)
    zero = np.zeros((2, 2, 3, 3))
    y0, final = forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], zero)
    np.testing.assert_array_equal(y, y0)
    assert final.shape == (2, 2, 3, 3)


# --------------------------------------------------------------------------------------------
# Dtypes and the packed buffer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
def test_float32_agrees_with_float64(per_channel: bool, carry: bool, method: str) -> None:
    inputs = make_inputs((2, 24, 2, 8), per_channel=per_channel, carry=carry, seed=4)
    exact = run_backward(inputs, method=method)
    single = run_backward(inputs, method=method, dtype=np.float32)
    assert single.dtype == np.float32
    assert_close_to(single.astype(np.float64), exact, 2e-6, "float32 gradient")
    y64 = forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    y32 = forward(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], dtype="float32"
    )
    assert y32.dtype == np.float32
    assert_close_to(y32.astype(np.float64), y64, 2e-6, "float32 output")


@pytest.mark.parametrize("low", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_are_upcast(low: Any) -> None:
    inputs = make_inputs((1, 5, 2, 4), per_channel=True, carry=True, seed=2)
    narrowed = {name: value.astype(low) for name, value in inputs.items()}
    widened = {name: value.astype(np.float64) for name, value in narrowed.items()}
    np.testing.assert_array_equal(run_backward(narrowed), run_backward(widened))


def test_backward_writes_into_out_and_returns_it() -> None:
    inputs = make_inputs((2, 5, 2, 3), per_channel=True, carry=True)
    layout = GdnBackwardLayout.from_inputs(inputs["q"], inputs["g"], inputs["state"])
    out = np.full(layout.total_elems, np.nan, dtype=np.float32)
    result = run_backward(inputs, out=out, dtype=np.float32)
    assert result is out
    np.testing.assert_array_equal(out, run_backward(inputs, dtype=np.float32))
    flat = run_backward(inputs)
    assert flat.shape == (layout.total_elems,)
    assert flat.dtype == np.float64
    views = unpack(flat, layout)
    assert views.dg.shape == (2, 5, 2, 3)
    assert views.dstate is not None
    assert np.shares_memory(views.dstate, flat)


def test_per_head_gate_layout() -> None:
    inputs = make_inputs((2, 3, 4, 2), per_channel=False, carry=False)
    flat = run_backward(inputs)
    layout = GdnBackwardLayout(2, 3, 4, 2)
    assert flat.shape == (layout.total_elems,)
    assert unpack(flat, layout).dstate is None


@pytest.mark.parametrize("shape", [(1, 0, 2, 3), (0, 4, 2, 3), (1, 3, 2, 0)])
def test_empty_dimensions(shape: tuple[int, int, int, int]) -> None:
    inputs = make_inputs(shape, per_channel=False, carry=True)
    for method in METHODS:
        flat = run_backward(inputs, method=method)
        assert flat.shape == (GdnBackwardLayout(*shape, carry_state=True).total_elems,)
        np.testing.assert_array_equal(flat, 0.0)


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------


def _call(inputs: Inputs, **kwargs: Any) -> Array:
    merged = {**inputs, **kwargs}
    state = merged.pop("state", None)
    dy = merged.pop("dy")
    return backward(
        merged.pop("q"),
        merged.pop("k"),
        merged.pop("v"),
        merged.pop("g"),
        merged.pop("beta"),
        dy,
        state,
        **merged,
    )


@pytest.mark.parametrize(
    ("name", "value", "pattern"),
    [
        (
            "q",
            np.zeros((2, 3, 4)),
            r"q must have 4 dimensions \[B, S, H, N\], got shape \(2, 3, 4\)",
        ),
        ("k", np.zeros((2, 3, 4, 4)), r"k must have shape .*\(2, 3, 4, 5\), got \(2, 3, 4, 4\)"),
        ("v", np.zeros((2, 3, 4, 6)), r"v must have shape .*\(2, 3, 4, 5\), got \(2, 3, 4, 6\)"),
        ("dy", np.zeros((1, 3, 4, 5)), r"dy must have shape .*\(2, 3, 4, 5\), got \(1, 3, 4, 5\)"),
        (
            "g",
            np.zeros((2, 3, 5)),
            r"g must have shape \[B, S, H\] = \(2, 3, 4\) or .*got \(2, 3, 5",
        ),
        (
            "g",
            np.zeros((2, 3, 4, 4)),
            r"g must .*\[B, S, H, N\] = \(2, 3, 4, 5\) of q, got \(2, 3, 4, 4",
        ),
        ("beta", np.zeros((2, 3, 4, 5)), r"beta must have shape \[B, S, H\] = \(2, 3, 4\), got"),
        ("state", np.zeros((2, 4, 5, 4)), r"state must have shape \[B, H, N, N\] = \(2, 4, 5, 5\)"),
    ],
)
def test_bad_shapes(name: str, value: Array, pattern: str) -> None:
    inputs = make_inputs((2, 3, 4, 5), per_channel=False, carry=True)
    with pytest.raises(ValueError, match=pattern):
        _call(inputs, **{name: value})


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "state", "dy"])
@pytest.mark.parametrize(
    ("dtype", "label"),
    [(np.int32, "int32"), (np.complex128, "complex128"), (np.bool_, "bool"), (object, "object")],
)
def test_bad_dtypes(name: str, dtype: Any, label: str) -> None:
    inputs = make_inputs((1, 2, 1, 3), per_channel=False, carry=True)
    bad = inputs[name].astype(dtype)
    with pytest.raises(TypeError, match=rf"^{name} must have a floating dtype .*got {label}$"):
        _call(inputs, **{name: bad})


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "state", "dy"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values(name: str, bad: float) -> None:
    inputs = make_inputs((2, 3, 2, 3), per_channel=True, carry=True)
    index = (1, 1, 1) + (0,) * (inputs[name].ndim - 3)
    inputs[name][index] = bad
    inputs[name].reshape(-1)[-1] = bad  # a later one, not reported
    with pytest.raises(ValueError, match=rf"^{name} must be finite .*{bad} at index ") as info:
        _call(inputs)
    assert str(info.value).endswith(f"at index {index}")


def test_value_that_overflows_the_computation_dtype() -> None:
    inputs = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    inputs["v"][0, 1, 0, 1] = 1e300
    _call(inputs)  # finite in float64
    message = r"v must be finite in float32, got 1e\+300 at index \(0, 1, 0, 1\)"
    with pytest.raises(ValueError, match=message):
        _call(inputs, dtype=np.float32)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.int64, "complex64"])
def test_bad_computation_dtype(dtype: Any) -> None:
    inputs = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    with pytest.raises(TypeError, match=r"^dtype must be float32 or float64, got "):
        _call(inputs, dtype=dtype)


def test_bad_out() -> None:
    inputs = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    total = GdnBackwardLayout(1, 2, 1, 2).total_elems
    with pytest.raises(ValueError, match=rf"out must have shape \({total},\) .*got \(3,\)"):
        _call(inputs, out=np.zeros(3))
    with pytest.raises(TypeError, match=r"out must have dtype float64 .*got float32"):
        _call(inputs, out=np.zeros(total, np.float32))
    with pytest.raises(TypeError, match=r"out must be a NumPy array, got list"):
        _call(inputs, out=[0.0] * total)
    frozen = np.zeros(total)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="backward: out must be writeable, got a read-only array"):
        _call(inputs, out=frozen)


@pytest.mark.parametrize(
    ("every", "error", "pattern"),
    [
        (0, ValueError, r"checkpoint_every must be a positive integer or None, got 0"),
        (-3, ValueError, r"got -3"),
        (True, TypeError, r"got bool True"),
        (2.0, TypeError, r"got float 2.0"),
    ],
)
def test_bad_checkpoint_every(every: Any, error: type[Exception], pattern: str) -> None:
    inputs = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    with pytest.raises(error, match=pattern):
        _call(inputs, checkpoint_every=every)


def test_bad_method() -> None:
    inputs = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    message = r"method must be one of \('chunked', 'recurrent'\), got 'fast'"
    with pytest.raises(ValueError, match=message):
        _call(inputs, method="fast")
    with pytest.raises(ValueError, match="method must be one of"):
        forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], method="x")  # type: ignore[call-overload]


def test_forward_validates_too() -> None:
    inputs = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    with pytest.raises(TypeError, match="beta must have a floating dtype"):
        forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"].astype(int))
    with pytest.raises(ValueError, match=r"state must have shape"):
        forward(
            inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], np.zeros((1, 1, 2))
        )


@pytest.mark.parametrize("method", METHODS)
def test_progress_reports_rising_fractions_up_to_one(method: Method) -> None:
    inputs = make_inputs((1, 10, 2, 3), per_channel=False, carry=True)
    seen: list[float] = []
    with_progress = run_backward(inputs, method=method, checkpoint_every=3, progress=seen.append)
    # Four checkpoint intervals, each visited once by the forward and once by the backward sweep.
    assert seen == [i / 8 for i in range(1, 9)]
    assert np.array_equal(with_progress, run_backward(inputs, method=method, checkpoint_every=3))


def test_progress_must_be_callable() -> None:
    inputs = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    with pytest.raises(TypeError, match="progress must be callable or None, got int"):
        run_backward(inputs, progress=1)


@pytest.mark.parametrize("method", METHODS)
def test_a_diverging_recurrence_is_an_error_not_a_nan(method: Method) -> None:
    # Keys far from unit norm make I - beta k k^T expand: the true result overflows float64.
    inputs = make_inputs((1, 400, 1, 4), per_channel=False, carry=False)
    inputs["k"] = inputs["k"] * 8.0
    inputs["g"] = np.zeros_like(inputs["g"])
    with pytest.raises(FloatingPointError, match=r"forward: y is (inf|-inf|nan) at index \(0, "):
        loss(inputs)
    with pytest.raises(
        FloatingPointError,
        match=r"backward: dq is (inf|-inf|nan) at index .*outside the op's regime \(keys L2-norm",
    ):
        run_backward(inputs, method=method)


@pytest.mark.parametrize("n", [1, 2, 4, 6, 8])
@pytest.mark.parametrize("every", [None, 300])
def test_long_chunks_stay_accurate_at_small_state_sizes(n: int, every: int | None) -> None:
    # With g = 0 and a small N, a chunk's triangular system is ill-conditioned in its length:
    # checkpoint intervals of hundreds of steps must not turn into chunks that long.
    inputs = make_inputs((1, 300, 2, n), per_channel=False, carry=True, seed=n)
    inputs["g"] = np.zeros_like(inputs["g"])
    exact = run_backward(inputs, method="recurrent")
    assert_close_to(run_backward(inputs, checkpoint_every=every), exact, 1e-12, "float64")
    single = run_backward(inputs, checkpoint_every=every, dtype=np.float32)
    assert_close_to(single.astype(np.float64), exact, 1e-6, "float32")


@pytest.mark.parametrize("seq", [1, 3, 9])
def test_tiny_gate_gradients_survive_fast_decay_in_float32(seq: int) -> None:
    # exp(-30) per step makes dg about 1e-14; float32 must still get it to rounding.
    inputs = make_inputs((1, seq, 1, 4), per_channel=True, carry=True, seed=seq)
    inputs["g"] = np.full_like(inputs["g"], -30.0)
    exact = grads_of(inputs, method="recurrent")["g"]
    single = grads_of(inputs, dtype=np.float32)["g"].astype(np.float64)
    assert_close_to(single, exact, 1e-6, "dg")


@pytest.mark.parametrize(("batch", "heads", "size"), [(0, 2, 4), (1, 0, 4), (1, 2, 0)])
def test_work_without_a_state_element_is_zeros_at_once(batch: int, heads: int, size: int) -> None:
    """With no element in the state (B, H or N zero) every gradient and y are exactly zero
    for any S: nothing is stepped through, even over 2**20 steps."""
    from oracle import oracle
    from support import deadline

    seq = 2**20 if batch * heads == 0 else 2**16  # N = 0 still has [B, S, H] gates
    x = np.zeros((batch, seq, heads, size))
    g, beta = np.full((batch, seq, heads), -0.5), np.full((batch, seq, heads), 0.5)
    reported: list[float] = []
    with deadline(5):
        packed = backward(x, x, x, g, beta, x, progress=reported.append)
        y = forward(x, x, x, g, beta)
    assert reported == [1.0]
    assert packed.shape == (GdnBackwardLayout(batch, seq, heads, size).total_elems,)
    assert not packed.any()
    assert y.shape == x.shape
    # The same zeros the oracle's steps give, on a sequence short enough to step through.
    short = np.ones((batch, 7, heads, size))
    stepped = oracle(short, short, short, g[:, :7], beta[:, :7], short)
    layout = GdnBackwardLayout(batch, 7, heads, size)
    grads = unpack(backward(short, short, short, g[:, :7], beta[:, :7], short), layout)
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        assert np.array_equal(getattr(grads, name), getattr(stepped, name)), name


# --------------------------------------------------------------------------------------------
# The step-by-step form read otherwise (what a misread kernel computes)
# --------------------------------------------------------------------------------------------

#: How close each option's gradients come to their truth, by computation dtype.
READ_OTHERWISE_TOLERANCE = {np.float64: 1e-10, np.float32: 1e-4}


def plain_loss(x: Inputs, columns: bool) -> Any:
    """``sum(y * dy)``, plus ``<cot, S_T>`` when ``x`` has ``cot``, of the recurrence written
    out with the decay factors ``x["a"]`` as they are (or ``exp(x["g"])``), a per-channel one
    scaling value columns when ``columns``: analytic in every input, so a complex step
    differentiates it to rounding."""
    q, k, v, beta, dy = (x[name] for name in ("q", "k", "v", "beta", "dy"))
    a = x["a"] if "a" in x else np.exp(x["g"])
    b, s, h, n = q.shape
    state = x.get("state", np.zeros((b, h, n, n)))
    total = 0.0
    for t in range(s):
        at = a[:, t]
        if at.ndim == 2:  # one factor per head
            factor = at[..., None, None]
        else:
            factor = at[..., None, :] if columns else at[..., :, None]
        p = factor * state
        m = np.einsum("bhi,bhij->bhj", k[:, t], p)
        u = (v[:, t] - m) * beta[:, t, :, None]
        state = p + k[:, t, :, :, None] * u[..., None, :]
        y = np.einsum("bhi,bhij->bhj", q[:, t], state) / np.sqrt(n)
        total = total + np.sum(y * dy[:, t])
    if "cot" in x:
        total = total + np.sum(x["cot"] * state)
    return total


def complex_step(x: Inputs, name: str, columns: bool) -> Array:
    """The gradient of :func:`plain_loss` with respect to ``x[name]``, by complex steps."""
    step = 1e-30
    base = x[name]
    out = np.empty(base.shape)
    for index in np.ndindex(base.shape):
        moved = base.astype(complex)
        moved[index] += 1j * step
        out[index] = plain_loss({**x, name: moved}, columns).imag / step
    return out


def read_otherwise(x: Inputs, dtype: Any, **options: Any) -> dict[str, Array]:
    """:func:`step_gradients` on ``x`` (``a`` passed as the decay), by input name."""
    decay = x.get("a")
    grads = step_gradients(
        x["q"],
        x["k"],
        x["v"],
        x.get("g"),
        x["beta"],
        x["dy"],
        x.get("state"),
        decay=decay,
        dtype=dtype,
        **options,
    )
    names = {"dq": "q", "dk": "k", "dv": "v", "dg": "a" if decay is not None else "g"}
    names |= {"dbeta": "beta", "dstate": "state"}
    return {names[n]: np.asarray(grad, np.float64) for n, grad in grads._asdict().items()}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
def test_a_decay_given_as_is_has_its_own_gradient(
    per_channel: bool, carry: bool, dtype: Any
) -> None:
    # The factors of any sign, zero among them (g passed where a decay is taken): their own
    # gradient, not one through a log.
    x = make_inputs((2, 5, 2, 3), per_channel=per_channel, carry=carry, seed=21)
    a = np.random.default_rng(22).uniform(-1.0, 1.2, x["g"].shape)
    a.flat[::7] = 0.0
    del x["g"]
    x["a"] = a
    got = read_otherwise(x, dtype)
    for name in (n for n in got if n in x):
        truth = complex_step(x, name, False)
        assert_close_to(got[name], truth, READ_OTHERWISE_TOLERANCE[dtype], name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("given", [False, True], ids=["log_gate", "decay"])
@pytest.mark.parametrize("carry", [False, True], ids=["no_state", "carry_state"])
def test_a_per_channel_decay_on_value_columns_scales_the_columns(
    carry: bool, given: bool, dtype: Any
) -> None:
    x = make_inputs((2, 5, 2, 3), per_channel=True, carry=carry, seed=23)
    if given:
        x["a"] = np.exp(x.pop("g"))
    got = read_otherwise(x, dtype, columns=True)
    rows = read_otherwise(x, dtype)
    for name in (n for n in got if n in x):
        truth = complex_step(x, name, True)
        assert_close_to(got[name], truth, READ_OTHERWISE_TOLERANCE[dtype], name)
        assert not np.allclose(rows[name], truth, rtol=1e-3), name  # the rows' differ


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
def test_a_cotangent_on_the_final_state_is_that_of_steps_that_read_it(
    per_channel: bool, carry: bool, dtype: Any
) -> None:
    # <C, S_T> is what N more steps that leave the state as it is (k = v = beta = g = 0)
    # output against dy: step i reads row i of S_T (q = e_i) against C[i] / c. So the
    # oracle of the longer sequence, cut at S, is the truth with a cotangent C.
    x = make_inputs((2, 6, 2, 3), per_channel=per_channel, carry=carry, seed=25)
    q, g = x["q"], x["g"]
    b, s, h, n = q.shape
    cot = np.random.default_rng(26).standard_normal((b, h, n, n))
    reads = np.broadcast_to(np.eye(n)[None, :, None, :], (b, n, h, n))
    against = np.sqrt(n) * cot.transpose(0, 2, 1, 3)  # [B, i, H, :] = C[b, h, i] / c
    zeros = np.zeros((b, n, h, n))
    exact = oracle(
        np.concatenate([q, reads], axis=1),
        np.concatenate([x["k"], zeros], axis=1),
        np.concatenate([x["v"], zeros], axis=1),
        np.concatenate([g, np.zeros((b, n, h, *g.shape[3:]))], axis=1),
        np.concatenate([x["beta"], np.zeros((b, n, h))], axis=1),
        np.concatenate([x["dy"], against], axis=1),
        x.get("state"),
    )
    got = read_otherwise(x, dtype, cotangent=cot)
    for name in ("q", "k", "v", "g", "beta"):
        truth = np.asarray(getattr(exact, "d" + name)[:, :s], np.float64)
        assert_close_to(got[name], truth, READ_OTHERWISE_TOLERANCE[dtype], name)
    dstate = np.asarray(exact.dstates[:, 0], np.float64)  # that of a zero state without one
    assert_close_to(got["state"], dstate, READ_OTHERWISE_TOLERANCE[dtype], "state")
    # with no step at all, the initial state is the final one: dstate is the cotangent
    empty = {name: t[:, :0] for name, t in x.items() if name != "state"}
    none = read_otherwise({**empty, "state": np.zeros((b, h, n, n))}, dtype, cotangent=cot)
    assert np.array_equal(none["state"], cot.astype(dtype))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
def test_read_as_the_op_the_step_form_is_the_recurrent_backward_bit_for_bit(
    per_channel: bool, carry: bool, dtype: Any
) -> None:
    x = make_inputs((2, 7, 2, 3), per_channel=per_channel, carry=carry, seed=27)
    layout = GdnBackwardLayout.from_inputs(x["q"], x["g"], x.get("state"))
    flat = run_backward(x, dtype=dtype, method="recurrent", checkpoint_every=2)
    got = read_otherwise(x, dtype, checkpoint_every=3)
    for name, want in zip(layout.names, unpack(flat, layout), strict=False):
        assert want is not None
        assert got[name.removeprefix("d")].tobytes() == want.astype(np.float64).tobytes(), name
    b, _, h, n = x["q"].shape
    assert got["state"].shape == (b, h, n, n)  # given without a state too


def test_the_step_form_takes_a_log_gate_or_a_decay() -> None:
    x = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["dy"])
    with pytest.raises(ValueError, match="not both"):
        step_gradients(*args, decay=np.exp(x["g"]))
    with pytest.raises(ValueError, match="not both"):
        step_gradients(*args[:3], None, *args[4:])
    with pytest.raises(ValueError, match="cotangent must have shape"):
        step_gradients(*args, cotangent=np.zeros((1, 1, 2, 3)))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", ["op", "decay", "columns", "cotangent"])
def test_step_ends_are_the_full_run_s_values_at_its_ends(variant: str, dtype: Any) -> None:
    # What a screen reads of a re-run: dq on the first steps and dv on the last, equal to the
    # full run's there (the same steps on the same values), NaN elsewhere.
    from gdn_layout.reference._recurrent import step_ends

    rng = np.random.default_rng(4)
    b, s, h, n = 2, 37, 2, 5
    q, k, v, dy = (rng.standard_normal((b, s, h, n)) for _ in range(4))
    g: NDArray[Any] | None = -rng.random((b, s, h, n) if variant == "columns" else (b, s, h))
    beta, state = rng.random((b, s, h)), rng.standard_normal((b, h, n, n))
    options: dict[str, Any] = {"dtype": dtype}
    if variant == "decay":
        assert g is not None
        options["decay"], g = np.exp(g) * rng.choice([-1.5, 1.0], g.shape), None
    elif variant == "columns":
        options["columns"] = True
    elif variant == "cotangent":
        options["cotangent"] = rng.standard_normal((b, h, n, n))
    full = step_gradients(q, k, v, g, beta, dy, state, checkpoint_every=6, **options)
    for steps in (1, 7, s + 3):
        ends = step_ends(q, k, v, g, beta, dy, state, steps=steps, **options)
        first, last = min(steps, s), s - min(steps, s)
        assert np.array_equal(ends.dq[:, :first], full.dq[:, :first])
        assert np.array_equal(ends.dv[:, last:], full.dv[:, last:])
        assert np.isnan(ends.dq[:, first:]).all()
        assert np.isnan(ends.dv[:, :last]).all()
        assert all(np.isnan(getattr(ends, name)).all() for name in ("dk", "dg", "dbeta", "dstate"))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_parts_run_apart_from_the_run_s_checkpoints_and_cotangents_are_its_values(
    dtype: Any,
) -> None:
    # Steps run from the state entering them and the cotangent leaving them (a checkpoint and
    # its cotangent, kept by a recorded run) give that run's gradients there, all but dstate.
    from gdn_layout.reference._recurrent import Boundaries, Part, step_ends

    rng = np.random.default_rng(6)
    b, s, h, n, every = 2, 37, 2, 5, 6
    q, k, v, dy = (rng.standard_normal((b, s, h, n)) for _ in range(4))
    g, beta = -rng.random((b, s, h)), rng.random((b, s, h))
    state = rng.standard_normal((b, h, n, n))
    count = len(range(0, s, every))
    record = Boundaries(
        np.empty((b, count, h, n, n), dtype),
        np.empty((b, count, h, n, n), dtype),
        np.empty((b, h, n, n), dtype),
    )
    full = step_gradients(
        q, k, v, g, beta, dy, state, dtype=dtype, checkpoint_every=every, record=record
    )
    assert record.dh is not None
    middle = Part(2 * every, 3 * every, record.h[:, 2], record.dh[:, 3])  # all of it
    forward = Part(3 * every, 4 * every - 2, record.h[:, 3], None)  # dq alone, not all steps
    ends = step_ends(q, k, v, g, beta, dy, state, dtype=dtype, steps=1, parts=(middle, forward))
    span = slice(2 * every, 3 * every)
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        assert np.array_equal(getattr(ends, name)[:, span], getattr(full, name)[:, span]), name
    assert np.array_equal(
        ends.dq[:, 3 * every : 4 * every - 2], full.dq[:, 3 * every : 4 * every - 2]
    )
    assert np.isnan(ends.dq[:, 4 * every - 2 : -1]).all()
    assert np.isnan(ends.dk[:, 3 * every :]).all()
    assert ends.dstate is not None
    assert np.isnan(ends.dstate).all()

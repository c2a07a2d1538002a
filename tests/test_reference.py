"""The reference's public calls (forms, dtypes, the packed buffer, bad inputs) and the
step-by-step form read otherwise; exactness against the oracle: test_reference_exact.py."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.reference import Method, backward, forward
from gdn_layout.reference._recurrent import Boundaries, Part, step_ends, step_gradients

Array = NDArray[Any]
Inputs = dict[str, Array]
METHODS: tuple[Method, ...] = ("chunked", "recurrent")
NAMES = ("q", "k", "v", "g", "beta", "dy", "state")


def make_inputs(
    shape: tuple[int, int, int, int], *, per_channel: bool, carry: bool, seed: int = 0,
    gates: tuple[float, float] = (-1.0, 0.2),
) -> Inputs:  # fmt: skip
    """Random inputs of moderate size, keys L2-normalised as the op's callers do."""
    rng = np.random.default_rng(seed)
    b, s, h, n = shape
    k = rng.standard_normal(shape)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    x = {"q": rng.standard_normal(shape), "k": k, "v": rng.standard_normal(shape)}
    x["g"] = rng.uniform(*gates, shape if per_channel else (b, s, h))
    x["beta"], x["dy"] = rng.uniform(0.1, 1.0, (b, s, h)), rng.standard_normal(shape)
    if carry:
        x["state"] = rng.standard_normal((b, h, n, n))
    return x


def run_backward(x: Inputs, **kwargs: Any) -> Array:
    args: Any = [x.get(name) for name in NAMES]
    return backward(*args, **kwargs)


def run_forward(x: Inputs, **kwargs: Any) -> Any:
    state = x.get("state")
    args: Any = [x[name] for name in NAMES[:5]]
    return forward(*args, **kwargs) if state is None else forward(*[*args, state], **kwargs)


def loss(x: Inputs) -> float:
    y = run_forward(x, method="recurrent")
    return float(np.sum((y if "state" not in x else y[0]) * x["dy"]))


def assert_close_to(actual: Array, expected: Array, rel: float, what: str) -> None:
    """Every element within ``rel`` times the largest magnitude of ``expected``."""
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-300)
    error = float(np.max(np.abs(actual - expected), initial=0.0))
    assert error <= rel * scale, f"{what}: max error {error:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize(
    "gates", [(-16.0, -9.0), (1.25, 2.25), (-3.0, 3.0), (-800.0, -700.0)],
    ids=["strong-decay", "growth", "mixed", "underflow"],
)  # fmt: skip
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_chunked_matches_recurrent_when_chunks_must_be_cut(
    gates: tuple[float, float], per_channel: bool
) -> None:
    x = make_inputs((1, 12, 2, 3), per_channel=per_channel, carry=True, seed=5, gates=gates)
    expected = run_backward(x, method="recurrent")
    for every in (1, 5, 12):
        assert_close_to(run_backward(x, checkpoint_every=every), expected, 1e-11, f"{every}")
    for got, want in zip(run_forward(x), run_forward(x, method="recurrent"), strict=True):
        assert_close_to(got, want, 1e-11, "y and the final state")


def test_forward_without_state_returns_y_only() -> None:
    x = make_inputs((2, 4, 2, 3), per_channel=False, carry=False)
    y = run_forward(x)
    assert isinstance(y, np.ndarray)
    assert y.shape == (2, 4, 2, 3)
    y0, final = run_forward({**x, "state": np.zeros((2, 2, 3, 3))})
    np.testing.assert_array_equal(y, y0)
    assert final.shape == (2, 2, 3, 3)


@pytest.mark.parametrize("low", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_are_upcast(low: Any) -> None:
    x = make_inputs((1, 5, 2, 4), per_channel=True, carry=True, seed=2)
    narrowed = {name: value.astype(low) for name, value in x.items()}
    widened = {name: value.astype(np.float64) for name, value in narrowed.items()}
    np.testing.assert_array_equal(run_backward(narrowed), run_backward(widened))
    assert run_forward(x, dtype="float32")[0].dtype == np.float32


def test_backward_writes_into_out_and_returns_it() -> None:
    x = make_inputs((2, 5, 2, 3), per_channel=True, carry=True)
    layout = GdnBackwardLayout.from_inputs(x["q"], x["g"], x["state"])
    out = np.full(layout.total_elems, np.nan, dtype=np.float32)
    assert run_backward(x, out=out, dtype=np.float32) is out
    np.testing.assert_array_equal(out, run_backward(x, dtype=np.float32))
    flat = run_backward(x)
    assert flat.dtype == np.float64
    assert np.shares_memory(unpack(flat, layout).dstate, flat)


@pytest.mark.parametrize(("batch", "heads", "size"), [(0, 2, 4), (1, 0, 4), (1, 2, 0)])
def test_work_without_a_state_element_is_zeros_at_once(batch: int, heads: int, size: int) -> None:
    """With B, H or N zero every gradient and y are zeros for any S, with nothing stepped."""
    from support import deadline

    seq = 2**20 if batch * heads == 0 else 2**16  # N = 0 still has [B, S, H] gates
    x = np.zeros((batch, seq, heads, size))
    g, beta = np.full((batch, seq, heads), -0.5), np.full((batch, seq, heads), 0.5)
    reported: list[float] = []
    with deadline(5):
        for method in METHODS:
            packed = backward(x, x, x, g, beta, x, progress=reported.append, method=method)
            assert not packed.any()
        y = forward(x, x, x, g, beta)
    assert reported == [1.0, 1.0]
    assert packed.shape == (GdnBackwardLayout(batch, seq, heads, size).total_elems,)
    assert not y.any()


def _call(x: Inputs, **changes: Any) -> Array:
    merged = {**x, **changes}
    args = [merged.pop(name, None) for name in NAMES]
    return backward(*args, **merged)


@pytest.mark.parametrize(
    ("name", "value", "pattern"),
    [
        ("q", np.zeros((2, 3, 4)), r"q must have 4 dimensions \[B, S, H, N\], got shape"),
        ("k", np.zeros((2, 3, 4, 4)), r"k must have shape .*\(2, 3, 4, 5\), got \(2, 3, 4, 4\)"),
        ("v", np.zeros((2, 3, 4, 6)), r"v must have shape .*\(2, 3, 4, 5\), got \(2, 3, 4, 6\)"),
        ("dy", np.zeros((1, 3, 4, 5)), r"dy must have shape .*\(2, 3, 4, 5\), got \(1, 3, 4, 5\)"),
        ("g", np.zeros((2, 3, 5)), r"g must have shape \[B, S, H\] = \(2, 3, 4\) or .*got \(2,"),
        ("g", np.zeros((2, 3, 4, 4)), r"g .*\[B, S, H, N\] = \(2, 3, 4, 5\) of q, got \(2, 3, 4,"),
        ("beta", np.zeros((2, 3, 4, 5)), r"beta must have shape \[B, S, H\] = \(2, 3, 4\), got"),
        ("state", np.zeros((2, 4, 5, 4)), r"state must have shape \[B, H, N, N\] = \(2, 4, 5, 5\)"),
    ],
)  # fmt: skip
def test_bad_shapes(name: str, value: Array, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _call(make_inputs((2, 3, 4, 5), per_channel=False, carry=True), **{name: value})


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("dtype", "label"), [(np.int32, "int32"), (np.bool_, "bool"), (object, "object")]
)
def test_bad_dtypes(name: str, dtype: Any, label: str) -> None:
    x = make_inputs((1, 2, 1, 3), per_channel=False, carry=True)
    with pytest.raises(TypeError, match=rf"^{name} must have a floating dtype .*got {label}$"):
        _call(x, **{name: x[name].astype(dtype)})


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_non_finite_values(name: str, bad: float) -> None:
    x = make_inputs((2, 3, 2, 3), per_channel=True, carry=True)
    index = (1, 1, 1) + (0,) * (x[name].ndim - 3)
    x[name][index] = bad
    x[name].reshape(-1)[-1] = bad  # a later one, not reported
    with pytest.raises(ValueError, match=rf"^{name} must be finite .*{bad} at index ") as info:
        _call(x)
    assert str(info.value).endswith(f"at index {index}")


def test_value_that_overflows_the_computation_dtype() -> None:
    x = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    x["v"][0, 1, 0, 1] = 1e300
    _call(x)  # finite in float64
    with pytest.raises(
        ValueError, match=r"v must be finite in float32, got 1e\+300 at index \(0, 1, 0, 1\)"
    ):
        _call(x, dtype=np.float32)


def test_bad_arguments() -> None:
    x = make_inputs((1, 2, 1, 2), per_channel=False, carry=False)
    for dtype in (np.float16, ml_dtypes.bfloat16, np.int64, "complex64"):
        with pytest.raises(TypeError, match=r"^dtype must be float32 or float64, got "):
            _call(x, dtype=dtype)
    total = GdnBackwardLayout(1, 2, 1, 2).total_elems
    with pytest.raises(ValueError, match=rf"out must have shape \({total},\) .*got \(3,\)"):
        _call(x, out=np.zeros(3))
    with pytest.raises(TypeError, match=r"out must have dtype float64 .*got float32"):
        _call(x, out=np.zeros(total, np.float32))
    with pytest.raises(TypeError, match=r"out must be a NumPy array, got list"):
        _call(x, out=[0.0] * total)
    frozen = np.zeros(total)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="backward: out must be writeable, got a read-only array"):
        _call(x, out=frozen)
    for every, error, pattern in [
        (0, ValueError, r"checkpoint_every must be a positive integer or None, got 0"),
        (True, TypeError, r"got bool True"),
        (2.0, TypeError, r"got float 2.0"),
    ]:
        with pytest.raises(error, match=pattern):
            _call(x, checkpoint_every=every)
    with pytest.raises(
        ValueError, match=r"method must be one of \('chunked', 'recurrent'\), got 'fast'"
    ):
        _call(x, method="fast")
    with pytest.raises(ValueError, match="method must be one of"):
        run_forward(x, method="x")
    with pytest.raises(TypeError, match="progress must be callable or None, got int"):
        _call(x, progress=1)
    with pytest.raises(TypeError, match="beta must have a floating dtype"):
        run_forward({**x, "beta": x["beta"].astype(int)})
    with pytest.raises(ValueError, match=r"state must have shape"):
        run_forward({**x, "state": np.zeros((1, 1, 2))})


@pytest.mark.parametrize("method", METHODS)
def test_progress_reports_rising_fractions_up_to_one(method: Method) -> None:
    x = make_inputs((1, 10, 2, 3), per_channel=False, carry=True)
    seen: list[float] = []
    with_progress = run_backward(x, method=method, checkpoint_every=3, progress=seen.append)
    assert seen == [i / 8 for i in range(1, 9)]  # four intervals, each swept twice
    assert np.array_equal(with_progress, run_backward(x, method=method, checkpoint_every=3))


@pytest.mark.parametrize("method", METHODS)
def test_a_diverging_recurrence_is_an_error_not_a_nan(method: Method) -> None:
    x = make_inputs((1, 400, 1, 4), per_channel=False, carry=False)
    x["k"], x["g"] = x["k"] * 8.0, np.zeros_like(x["g"])  # I - beta k k^T expands
    with pytest.raises(FloatingPointError, match=r"forward: y is (inf|-inf|nan) at index \(0, "):
        loss(x)
    message = r"backward: dq is (inf|-inf|nan) at index .*outside the op's regime \(keys L2-norm"
    with pytest.raises(FloatingPointError, match=message):
        run_backward(x, method=method)


@pytest.mark.parametrize("n", [1, 2, 6])
def test_long_chunks_stay_accurate_at_small_state_sizes(n: int) -> None:
    # With g = 0 and a small N a chunk's system is ill-conditioned in its length: intervals of
    # hundreds of steps must not become chunks that long.
    x = make_inputs((1, 300, 2, n), per_channel=False, carry=True, seed=n)
    x["g"] = np.zeros_like(x["g"])
    exact = run_backward(x, method="recurrent")
    assert_close_to(run_backward(x, checkpoint_every=300), exact, 1e-12, "float64")
    single = run_backward(x, checkpoint_every=300, dtype=np.float32)
    assert_close_to(single.astype(np.float64), exact, 1e-6, "float32")


# The step-by-step form read otherwise -------------------------------------------------------

#: How close each reading's gradients come to their truth, by computation dtype.
TOLERANCE = {np.float64: 1e-10, np.float32: 1e-4}


def plain_loss(x: Inputs, columns: bool) -> Any:
    """``sum(y * dy)`` (plus ``<cot, S_T>``) of the recurrence written out with the decay
    ``x["a"]`` as is (or ``exp(x["g"])``), per channel on value columns with ``columns``:
    analytic in every input, so a complex step differentiates it to rounding."""
    q, k, v, beta, dy = (x[name] for name in ("q", "k", "v", "beta", "dy"))
    a = x["a"] if "a" in x else np.exp(x["g"])
    b, s, h, n = q.shape
    state, total = x.get("state", np.zeros((b, h, n, n))), 0.0
    for t in range(s):
        at = a[:, t]
        factor = (
            at[..., None, None] if at.ndim == 2 else at[..., None, :] if columns else at[..., None]
        )
        p = factor * state
        u = (v[:, t] - np.einsum("bhi,bhij->bhj", k[:, t], p)) * beta[:, t, :, None]
        state = p + k[:, t, :, :, None] * u[..., None, :]
        total = total + np.sum(np.einsum("bhi,bhij->bhj", q[:, t], state) / np.sqrt(n) * dy[:, t])
    return total + (np.sum(x["cot"] * state) if "cot" in x else 0.0)


def complex_step(x: Inputs, name: str, columns: bool) -> Array:
    out = np.empty(x[name].shape)
    for index in np.ndindex(out.shape):
        moved = x[name].astype(complex)
        moved[index] += 1e-30j
        out[index] = plain_loss({**x, name: moved}, columns).imag / 1e-30
    return out


def read_otherwise(x: Inputs, dtype: Any, **options: Any) -> dict[str, Array]:
    """:func:`step_gradients` on ``x`` (``a`` as the decay), by input name."""
    args: Any = [x.get(name) for name in NAMES]
    grads = step_gradients(*args, decay=x.get("a"), dtype=dtype, **options)
    names = dict(
        zip(
            ("dq", "dk", "dv", "dg", "dbeta", "dstate"),
            ("q", "k", "v", "a" if "a" in x else "g", "beta", "state"),
            strict=True,
        )
    )
    return {names[n]: np.asarray(grad, np.float64) for n, grad in grads._asdict().items()}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(
    ("per_channel", "carry", "given", "columns", "cot"),
    [(False, False, True, False, False), (True, True, True, False, False),
     (True, False, False, True, False), (True, True, True, True, False),
     (False, True, False, False, True), (True, False, False, False, True)],
)  # fmt: skip
def test_the_op_read_otherwise_has_its_own_gradient(
    per_channel: bool, carry: bool, given: bool, columns: bool, cot: bool, dtype: Any
) -> None:
    """A decay as is (any sign, zeros among them), on value columns, or a cotangent on the
    final state: each reading's gradients are its own function's, to a complex step."""
    x = make_inputs((2, 5, 2, 3), per_channel=per_channel, carry=carry, seed=21)
    if given:
        x["a"] = np.random.default_rng(22).uniform(-1.0, 1.2, x.pop("g").shape)
        x["a"].flat[::7] = 0.0
    options: dict[str, Any] = {"columns": columns}
    if cot:
        x["cot"] = options["cotangent"] = np.random.default_rng(26).standard_normal((2, 2, 3, 3))
    got = read_otherwise(x, dtype, **options)
    for name in (n for n in got if n in x):
        assert_close_to(got[name], complex_step(x, name, columns), TOLERANCE[dtype], name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", ["op", "decay", "columns", "cotangent"])
def test_step_ends_and_parts_are_the_full_run_s_values(variant: str, dtype: Any) -> None:
    # dq on the first steps and dv on the last equal the full run's there, NaN elsewhere; and
    # steps run from a recorded checkpoint and the cotangent leaving them give its gradients.
    rng = np.random.default_rng(4)
    b, s, h, n, every = 2, 37, 2, 5, 6
    q, k, v, dy = (rng.standard_normal((b, s, h, n)) for _ in range(4))
    g: Array | None = -rng.random((b, s, h, n) if variant == "columns" else (b, s, h))
    beta, state = rng.random((b, s, h)), rng.standard_normal((b, h, n, n))
    options: dict[str, Any] = {"dtype": dtype}
    if variant == "decay":
        assert g is not None
        options["decay"], g = np.exp(g) * rng.choice([-1.5, 1.0], g.shape), None
    elif variant == "columns":
        options["columns"] = True
    elif variant == "cotangent":
        options["cotangent"] = rng.standard_normal((b, h, n, n))
    count = len(range(0, s, every))
    h_, dh_ = (np.empty((b, count, h, n, n), dtype) for _ in range(2))
    record = Boundaries(h_, dh_, np.empty((b, h, n, n), dtype))
    full = step_gradients(
        q, k, v, g, beta, dy, state, checkpoint_every=every, record=record, **options
    )
    for steps in (1, 7, s + 3):
        ends = step_ends(q, k, v, g, beta, dy, state, steps=steps, **options)
        first, last = min(steps, s), s - min(steps, s)
        assert np.array_equal(ends.dq[:, :first], full.dq[:, :first])
        assert np.array_equal(ends.dv[:, last:], full.dv[:, last:])
        assert np.isnan(ends.dq[:, first:]).all()
        assert np.isnan(ends.dv[:, :last]).all()
        assert all(np.isnan(getattr(ends, name)).all() for name in ("dk", "dg", "dbeta"))
    assert record.dh is not None
    middle = Part(2 * every, 3 * every, record.h[:, 2], record.dh[:, 3])  # all of it
    ahead = Part(3 * every, 4 * every - 2, record.h[:, 3], None)  # dq alone
    ends = step_ends(q, k, v, g, beta, dy, state, steps=1, parts=(middle, ahead), **options)
    span, dq_span = slice(2 * every, 3 * every), slice(3 * every, 4 * every - 2)
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        assert np.array_equal(getattr(ends, name)[:, span], getattr(full, name)[:, span]), name
    assert np.array_equal(ends.dq[:, dq_span], full.dq[:, dq_span])
    assert np.isnan(ends.dq[:, 4 * every - 2 : -1]).all()
    assert np.isnan(ends.dk[:, 3 * every :]).all()

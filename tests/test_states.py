"""``reference._states``: ``chunk_states``, the state entering each chunk, its cotangent
and the final state.

Measured as the reference's other results are (``test_reference_exact.py``): against the
long-double oracle, ``max|result - truth| / max|truth|`` per result, at most ``1e-12`` in
float64 and, in float32, at most ten times the error of the float32 step-by-step recurrence
on the same inputs (plus ``1e-6``). The recurrence's chunk states are its forward run chunk by
chunk and its backward run over each chunk's suffix of the sequence.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import DTypeLike, NDArray

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.reference import backward, chunk_states, forward
from oracle import oracle_chunk_states, relative_error
from regimes import DTYPES, GATES, MODES, Case, Inputs

Array = NDArray[Any]
Six = tuple[Array, Array, Array, Array, Array, Array]

FLOAT64_BOUND = 1e-12
FLOAT32_FACTOR = 10.0
FLOAT32_SLACK = 1e-6
NAMES = ("h", "dh", "final")
ARGS = ("q", "k", "v", "g", "beta", "dy")

#: The accuracy tests' gate regimes, and the fixtures' zero, strong and extreme.
REGIMES = ("const0", "uniform-8,-3", *GATES)


def states(inputs: Inputs, dtype: DTypeLike = np.float64, **options: Any) -> dict[str, Array]:
    h, dh, final = chunk_states(*pieces(inputs), inputs.get("state"), dtype=dtype, **options)
    return {"h": h, "dh": dh, "final": final}


def truth(inputs: Inputs, chunk: int) -> dict[str, Array]:
    exact = oracle_chunk_states(*pieces(inputs), inputs.get("state"), chunk=chunk)
    return dict(zip(NAMES, exact, strict=True))


def pieces(inputs: Inputs, t0: int = 0, t1: int | None = None) -> Six:
    """``q, k, v, g, beta, dy`` over steps ``t0 .. t1-1``."""
    q, k, v, g, beta, dy = (inputs[name][:, t0:t1] for name in ARGS)
    return q, k, v, g, beta, dy


def recurrence(inputs: Inputs, chunk: int, dtype: DTypeLike) -> dict[str, Array]:
    """The step-by-step form's chunk states in ``dtype``: its forward chunk by chunk, and the
    ``dstate`` of its backward over the steps from each chunk's start on."""
    b, s, h, n = inputs["q"].shape
    state = inputs.get("state", np.zeros((b, h, n, n))).astype(dtype)
    entering = []
    for t0 in range(0, s, chunk):
        entering.append(state)
        q, k, v, g, beta, _ = pieces(inputs, t0, t0 + chunk)
        _, state = forward(q, k, v, g, beta, state, dtype=dtype, method="recurrent")
    d_entering = []
    for c, t0 in enumerate(range(0, s, chunk)):
        flat = backward(*pieces(inputs, t0), entering[c], dtype=dtype, method="recurrent")
        d_entering.append(flat[-b * h * n * n :].reshape(b, h, n, n))
    if not entering:
        return {
            "h": np.zeros((b, 0, h, n, n), dtype),
            "dh": np.zeros((b, 0, h, n, n), dtype),
            "final": state,
        }
    return {"h": np.stack(entering, axis=1), "dh": np.stack(d_entering, axis=1), "final": state}


def errors(
    results: dict[str, Array], exact: dict[str, Array], dtype: DTypeLike
) -> dict[str, float]:
    return {name: relative_error(results[name], exact[name], dtype) for name in NAMES}


def show(values: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.2g}" for name, value in values.items())


def check(case: Case, chunk: int, dtype: DTypeLike) -> None:
    inputs = case.draw(dtype)
    results = states(inputs, dtype, chunk=chunk)
    b, s, h, n = case.shape
    count = -(-s // chunk)
    for name, shape in (("h", (b, count, h, n, n)), ("dh", (b, count, h, n, n))):
        assert results[name].shape == shape
    assert results["final"].shape == (b, h, n, n)
    assert all(result.dtype == np.dtype(dtype) for result in results.values())
    exact = truth(inputs, chunk)
    measured = errors(results, exact, dtype)
    if np.dtype(dtype) == np.float64:
        failing = {name: e for name, e in measured.items() if not e <= FLOAT64_BOUND}
        assert not failing, f"{case} chunk {chunk}: float64 errors {show(measured)}"
        return
    steps = errors(recurrence(inputs, chunk, dtype), exact, dtype)
    allowed = {name: FLOAT32_FACTOR * e + FLOAT32_SLACK for name, e in steps.items()}
    failing = {name: e for name, e in measured.items() if not e <= allowed[name]}
    assert not failing, (
        f"{case} chunk {chunk}: float32 errors {show(measured)}; recurrence {show(steps)}"
    )


# --------------------------------------------------------------------------------------------
# Against the oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize("gates", REGIMES)
def test_every_gate_regime(gates: str, per_channel: bool, carry: bool, dtype: DTypeLike) -> None:
    """Three chunks of 16, the last of one step, in every gate regime."""
    case = Case(2, 33, 2, 8, gates=gates, per_channel=per_channel, carry=carry, seed=3)
    check(case, 16, dtype)


@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize(
    ("chunk", "seq"),
    [(c, s) for c in (1, 16, 64, 128) for s in (c - 1, c, c + 1, 2 * c + 1)],
)
def test_chunk_sizes_and_lengths(chunk: int, seq: int, per_channel: bool, carry: bool) -> None:
    """Lengths below, at and above a multiple of the chunk (S = 0 included), over chunks
    longer and shorter than the chunked form's own (16 steps for N = 4)."""
    gates = REGIMES[(chunk + seq) % len(REGIMES)]
    case = Case(1, seq, 2, 4, gates=gates, per_channel=per_channel, carry=carry, beta="mixed")
    check(case.with_(seed=seq), chunk, np.float64)


@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize(("chunk", "seq"), [(1, 3), (16, 33), (64, 65), (128, 129)])
def test_chunk_sizes_in_float32(chunk: int, seq: int, per_channel: bool, carry: bool) -> None:
    case = Case(1, seq, 1, 8, gates="mixed", per_channel=per_channel, carry=carry, seed=seq)
    check(case, chunk, np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        Case(2, 21, 2, 1, gates="qwen", carry=True),  # N = 1
        Case(1, 21, 2, 4, gates="spiky", per_channel=True, norms="upto4", beta="one"),
        Case(1, 33, 1, 4, gates="uniform-1,0", norms="key3", carry=True),
    ],
    ids=str,
)
def test_where_the_step_by_step_form_is_taken(case: Case, dtype: DTypeLike) -> None:
    """N = 1, and keys with beta |k|^2 > 2: the default method's step-by-step form."""
    check(case, 8, dtype)


# --------------------------------------------------------------------------------------------
# Against the rest of the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize(("n", "norms"), [(8, "unit"), (1, "unit"), (4, "upto4")])
def test_the_first_cotangent_is_backwards_dstate(
    n: int, norms: str, per_channel: bool, carry: bool, dtype: DTypeLike
) -> None:
    """Bit for bit ``backward``'s ``dstate`` with ``checkpoint_every=chunk`` (both forms of
    the default method); within the bound with the default interval. Without a state, the
    backward is given a zero one."""
    case = Case(2, 45, 2, n, gates="qwen", per_channel=per_channel, carry=carry, norms=norms)
    inputs = case.draw(dtype)
    args = pieces(inputs)
    state = inputs.get("state", np.zeros((2, 2, n, n), dtype))
    _, dh, _ = chunk_states(*args, inputs.get("state"), chunk=16, dtype=dtype)
    layout = GdnBackwardLayout.from_inputs(inputs["q"], inputs["g"], state)
    same = unpack(backward(*args, state, dtype=dtype, checkpoint_every=16), layout).dstate
    assert same is not None
    assert np.array_equal(dh[:, 0], same)
    dstate = unpack(backward(*args, state, dtype=dtype), layout).dstate
    assert dstate is not None
    bound = FLOAT64_BOUND if np.dtype(dtype) == np.float64 else 1e-5
    assert relative_error(dh[:, 0], dstate, dtype) <= bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
def test_the_first_state_is_the_initial_one(
    per_channel: bool, carry: bool, dtype: DTypeLike
) -> None:
    inputs = Case(2, 20, 3, 4, per_channel=per_channel, carry=carry).draw(dtype)
    h, _, _ = states(inputs, dtype, chunk=7).values()
    assert h.shape == (2, 3, 3, 4, 4)
    expected = inputs.get("state", np.zeros((2, 3, 4, 4)))
    assert np.array_equal(h[:, 0], expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize("chunk", [1, 5, 64, 1000])
def test_the_final_state_is_forwards(
    chunk: int, per_channel: bool, carry: bool, dtype: DTypeLike
) -> None:
    case = Case(1, 70, 2, 16, gates="mixed", per_channel=per_channel, carry=carry, seed=chunk)
    inputs = case.draw(dtype)
    state = inputs.get("state", np.zeros((1, 2, 16, 16), dtype))
    q, k, v, g, beta, _ = pieces(inputs)
    _, final = forward(q, k, v, g, beta, state, dtype=dtype)
    got = states(inputs, dtype, chunk=chunk)["final"]
    bound = FLOAT64_BOUND if np.dtype(dtype) == np.float64 else 1e-5
    assert relative_error(got, final, dtype) <= bound


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    case=st.builds(
        Case,
        batch=st.integers(1, 2),
        seq=st.integers(1, 40),
        heads=st.integers(1, 2),
        n=st.sampled_from((1, 2, 4, 8)),
        gates=st.sampled_from(REGIMES),
        per_channel=st.booleans(),
        carry=st.booleans(),
        beta=st.sampled_from(("uniform", "zero", "one", "mixed")),
        seed=st.integers(0, 2**32 - 1),
    ),
    chunk=st.integers(1, 20),
)
def test_each_chunk_leads_to_the_next(case: Case, chunk: int) -> None:
    """The forward from ``h[:, c]`` over chunk ``c`` ends at ``h[:, c+1]`` (at the final state
    after the last chunk), and the backward from it over the steps from chunk ``c`` on gives
    ``dh[:, c]`` as its ``dstate``; within the bound, relative to each array's largest element."""
    inputs = case.draw()
    h, dh, final = states(inputs, chunk=chunk).values()
    ends, cotangents = [], []
    for c, t0 in enumerate(range(0, case.seq, chunk)):
        q, k, v, g, beta, _ = pieces(inputs, t0, t0 + chunk)
        ends.append(forward(q, k, v, g, beta, h[:, c])[1])
        flat = backward(*pieces(inputs, t0), h[:, c])
        cotangents.append(flat[-dh[:, c].size :].reshape(dh[:, c].shape))
    next_h = np.concatenate((h[:, 1:], final[:, None]), axis=1)
    assert relative_error(np.stack(ends, axis=1), next_h) <= FLOAT64_BOUND
    assert relative_error(np.stack(cotangents, axis=1), dh) <= FLOAT64_BOUND


# --------------------------------------------------------------------------------------------
# Shapes, arguments and memory
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("carry", [False, True], ids=["no_state", "state"])
def test_no_steps_give_no_chunks(carry: bool) -> None:
    inputs = Case(2, 0, 3, 4, carry=carry).draw()
    h, dh, final = states(inputs, chunk=16).values()
    assert h.shape == dh.shape == (2, 0, 3, 4, 4)
    assert np.array_equal(final, inputs.get("state", np.zeros((2, 3, 4, 4))))


def test_a_numpy_integer_is_a_chunk() -> None:
    inputs = Case(1, 10, 1, 4).draw()
    for name, a, b in zip(
        NAMES,
        states(inputs, chunk=np.int64(4)).values(),
        states(inputs, chunk=4).values(),
        strict=True,
    ):
        assert np.array_equal(a, b), name


@pytest.mark.parametrize(
    ("chunk", "error", "received"),
    [
        (0, ValueError, "got 0"),
        (-1, ValueError, "got -1"),
        (1.5, TypeError, "got float 1.5"),
        (True, TypeError, "got bool True"),
        (np.True_, TypeError, "got bool "),  # its repr depends on NumPy's version
        ("64", TypeError, "got str '64'"),
        (None, TypeError, "got NoneType None"),
    ],
    ids=repr,
)
def test_a_chunk_that_is_not_a_positive_integer(
    chunk: object, error: type[Exception], received: str
) -> None:
    inputs = Case(1, 4, 1, 4).draw()
    with pytest.raises(error, match=f"chunk must be a positive integer, {received}"):
        states(inputs, chunk=chunk)


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        ("k", (1, 5, 2, 4), r"k must have shape \[B, S, H, N\] of q = \(1, 6, 2, 4\), got \(1, 5"),
        ("dy", (1, 6, 2, 3), r"dy must have shape \[B, S, H, N\] of q = \(1, 6, 2, 4\), got"),
        ("beta", (1, 6, 3), r"beta must have shape \[B, S, H\] = \(1, 6, 2\), got \(1, 6, 3\)"),
        ("g", (1, 6, 2, 5), r"g must have shape \[B, S, H\] = \(1, 6, 2\) or \[B, S, H, N\]"),
        ("state", (1, 2, 4, 5), r"state must have shape \[B, H, N, N\] = \(1, 2, 4, 4\) of q, got"),
        ("q", (6, 2, 4), r"q must have 4 dimensions \[B, S, H, N\], got shape \(6, 2, 4\)"),
    ],
)
def test_inputs_of_the_wrong_shape(name: str, shape: tuple[int, ...], message: str) -> None:
    inputs = Case(1, 6, 2, 4, carry=True).draw()
    inputs[name] = np.zeros(shape)
    with pytest.raises(ValueError, match=message):
        states(inputs)


def test_inputs_of_the_wrong_kind() -> None:
    inputs = Case(1, 6, 2, 4).draw()
    with pytest.raises(TypeError, match="dtype must be float32 or float64, got float16"):
        states(inputs, dtype=np.float16)
    inputs["v"] = inputs["v"].astype(np.int64)
    with pytest.raises(TypeError, match="v must have a floating dtype"):
        states(inputs)
    inputs = Case(1, 6, 2, 4).draw()
    inputs["g"][0, 2, 1] = np.nan
    with pytest.raises(
        ValueError, match=r"g must be finite in float64, got nan at index \(0, 2, 1\)"
    ):
        states(inputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_overflow_is_an_error(dtype: DTypeLike) -> None:
    """Keys of norm 30 with beta = 1, as in the reference's own test: no result comes back."""
    case = Case(1, 200, 1, 4, gates="uniform-0.1,0", norms="key30", beta="one", carry=True)
    with pytest.raises(FloatingPointError, match="chunk_states: h is"):
        states(case.draw(dtype), dtype)


def test_memory_holds_the_boundaries_not_every_state() -> None:
    """S = 2048, N = 32: every state would be 16 MiB, the chunks' h and dh are 0.5 MiB; the
    peak stays near the inputs' converted copies and the backward's working set."""
    inputs = Case(1, 2048, 1, 32, gates="mixed").draw()
    every_state = 2048 * 32 * 32 * 8
    tracemalloc.start()
    try:
        states(inputs, chunk=64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < every_state / 2, f"peak {peak / 2**20:.1f} MiB"

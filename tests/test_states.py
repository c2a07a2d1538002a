"""``chunk_states`` against the long-double oracle, with the bounds of test_reference_exact.py
(the float32 control: ``method="recurrent"``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import DTypeLike, NDArray

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.reference import backward, chunk_states
from oracle import oracle_chunk_states, relative_error
from regimes import DTYPES, GATES, MODES, Case, Inputs

Array = NDArray[Any]

FLOAT64_BOUND, FLOAT32_FACTOR, FLOAT32_SLACK = 1e-12, 10.0, 1e-6
NAMES = ("h", "dh", "final")
ARGS = ("q", "k", "v", "g", "beta", "dy")
#: The accuracy tests' gate regimes, and the fixtures' zero, strong and extreme.
REGIMES = ("const0", "uniform-8,-3", *GATES)


def states(inputs: Inputs, dtype: DTypeLike = np.float64, **options: Any) -> dict[str, Array]:
    results = chunk_states(*[*pieces(inputs), inputs.get("state")], dtype=dtype, **options)
    return dict(zip(NAMES, results, strict=True))


def pieces(inputs: Inputs, t0: int = 0, t1: int | None = None) -> Any:
    """``q, k, v, g, beta, dy`` over steps ``t0 .. t1-1``."""
    return [inputs[name][:, t0:t1] for name in ARGS]


def check(case: Case, chunk: int, dtype: DTypeLike) -> None:
    inputs = case.draw(dtype)
    results = states(inputs, dtype, chunk=chunk)
    b, s, h, n = case.shape
    assert results["h"].shape == results["dh"].shape == (b, -(-s // chunk), h, n, n)
    assert results["final"].shape == (b, h, n, n)
    assert all(result.dtype == np.dtype(dtype) for result in results.values())
    exact = dict(
        zip(
            NAMES,
            oracle_chunk_states(*pieces(inputs), inputs.get("state"), chunk=chunk),
            strict=True,
        )
    )
    measured = {name: relative_error(results[name], exact[name], dtype) for name in NAMES}
    if np.dtype(dtype) == np.float64:
        allowed = dict.fromkeys(NAMES, FLOAT64_BOUND)
    else:
        steps = states(inputs, dtype, chunk=chunk, method="recurrent")
        allowed = {
            n: FLOAT32_FACTOR * relative_error(steps[n], exact[n], dtype) + FLOAT32_SLACK
            for n in NAMES
        }
    assert all(measured[name] <= allowed[name] for name in NAMES), (case, chunk, measured, allowed)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize("gates", REGIMES)
def test_every_gate_regime(gates: str, per_channel: bool, carry: bool, dtype: DTypeLike) -> None:
    """Three chunks of 16, the last of one step, in every gate regime."""
    check(Case(2, 33, 2, 8, gates=gates, per_channel=per_channel, carry=carry, seed=3), 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize(("chunk", "seq"), [(1, 3), (16, 15), (16, 33), (64, 65), (128, 129)])
def test_chunk_sizes_and_lengths(
    chunk: int, seq: int, per_channel: bool, carry: bool, dtype: DTypeLike
) -> None:
    """Lengths below and above a multiple of the chunk, over chunks longer and shorter than the
    chunked form's own."""
    gates = REGIMES[(chunk + seq) % len(REGIMES)]
    case = Case(1, seq, 2, 4, gates=gates, per_channel=per_channel, carry=carry, beta="mixed")
    check(case.with_(seed=seq), chunk, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        Case(2, 21, 2, 1, gates="qwen", carry=True),  # N = 1
        Case(1, 21, 2, 4, gates="spiky", per_channel=True, norms="upto4", beta="one"),
    ],
    ids=str,
)
def test_where_the_step_by_step_form_is_taken(case: Case, dtype: DTypeLike) -> None:
    check(case, 8, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize(("n", "norms"), [(8, "unit"), (1, "unit"), (4, "upto4")])
def test_the_first_cotangent_is_backwards_dstate(
    n: int, norms: str, per_channel: bool, carry: bool, dtype: DTypeLike
) -> None:
    """Bit for bit ``backward``'s ``dstate`` with ``checkpoint_every=chunk``, in either form;
    without a state, that of a zero one. The initial state is ``h[:, 0]``."""
    case = Case(2, 45, 2, n, gates="qwen", per_channel=per_channel, carry=carry, norms=norms)
    inputs = case.draw(dtype)
    state = inputs.get("state", np.zeros((2, 2, n, n), dtype))
    h, dh, _ = chunk_states(*[*pieces(inputs), inputs.get("state")], chunk=16, dtype=dtype)
    layout = GdnBackwardLayout.from_inputs(inputs["q"], inputs["g"], state)
    same = unpack(backward(*[*pieces(inputs), state], dtype=dtype, checkpoint_every=16), layout)
    assert same.dstate is not None
    assert np.array_equal(dh[:, 0], same.dstate)
    assert np.array_equal(h[:, 0], state)


@pytest.mark.parametrize("carry", [False, True], ids=["no_state", "state"])
def test_no_steps_give_no_chunks(carry: bool) -> None:
    inputs = Case(2, 0, 3, 4, carry=carry).draw()
    h, dh, final = states(inputs, chunk=np.int64(16)).values()  # a NumPy integer is a chunk
    assert h.shape == dh.shape == (2, 0, 3, 4, 4)
    assert np.array_equal(final, inputs.get("state", np.zeros((2, 3, 4, 4))))


@pytest.mark.parametrize(
    ("chunk", "error", "received"),
    [
        (0, ValueError, "got 0"),
        (1.5, TypeError, "got float 1.5"),
        (True, TypeError, "got bool True"),
        ("64", TypeError, "got str '64'"),
        (None, TypeError, "got NoneType None"),
    ],
    ids=repr,
)
def test_bad_arguments(chunk: object, error: type[Exception], received: str) -> None:
    inputs = Case(1, 4, 1, 4).draw()
    with pytest.raises(error, match=f"chunk must be a positive integer, {received}"):
        states(inputs, chunk=chunk)
    with pytest.raises(ValueError, match=r"method must be 'chunked' or 'recurrent', got 'x'"):
        states(inputs, method="x")


@pytest.mark.parametrize("dtype", DTYPES)
def test_overflow_is_an_error(dtype: DTypeLike) -> None:
    case = Case(1, 200, 1, 4, gates="uniform-0.1,0", norms="key30", beta="one", carry=True)
    with pytest.raises(FloatingPointError, match="chunk_states: h is"):
        states(case.draw(dtype), dtype)

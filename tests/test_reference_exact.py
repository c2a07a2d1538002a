"""The reference against the long-double oracle (``oracle.py``) in every regime, through the
public API: ``max|result - truth| / max|truth|`` at most ``1e-12`` in float64, and in float32
at most ten times a float32 ``method="recurrent"`` run's error plus ``1e-6`` (docs/reference.md).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numpy.typing import DTypeLike, NDArray

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.reference import backward, forward
from oracle import oracle, relative_error
from regimes import BETAS, DTYPES, GATES, MODES, STRONG_DECAY, Case, Inputs

Array = NDArray[Any]

FLOAT64_BOUND, FLOAT32_FACTOR, FLOAT32_SLACK = 1e-12, 10.0, 1e-6
RESULTS = ("y", "final", "dq", "dk", "dv", "dg", "dbeta", "dstate")
# Beyond these magnitudes the recurrence nears overflow: draws skip it.
PEAK_LIMIT = {np.dtype(np.float64): 1e250, np.dtype(np.float32): 1e30}


def _args(inputs: Inputs) -> list[Any]:
    return [inputs.get(x) for x in ("q", "k", "v", "g", "beta", "dy", "state")]


def library(inputs: Inputs, dtype: DTypeLike, **options: Any) -> dict[str, Array]:
    """``y``, the final state (when carried) and the gradients from the public API;
    ``checkpoint_every`` goes to the backward only."""
    q, k, v, g, beta, dy, state = _args(inputs)
    every = options.pop("checkpoint_every", None)
    y = forward(q, k, v, g, beta, *([] if state is None else [state]), dtype=dtype, **options)
    results = dict(zip(("y", "final"), y, strict=True)) if state is not None else {"y": y}
    flat = backward(q, k, v, g, beta, dy, state, dtype=dtype, checkpoint_every=every, **options)
    assert flat.dtype == np.dtype(dtype)
    grads = unpack(flat, GdnBackwardLayout.from_inputs(q, g, state))._asdict()
    return results | {n: grad for n, grad in grads.items() if grad is not None}


def truth(inputs: Inputs) -> tuple[dict[str, Array], float, dict[str, float]]:
    """The oracle's results, its peak magnitude, and the least scale of each result's error (a
    ``dbeta`` of terms that cancel is exact only to their rounding)."""
    exact = oracle(*_args(inputs))
    results = {name: getattr(exact, name) for name in RESULTS}
    if inputs.get("state") is None:
        del results["final"], results["dstate"]
    return results, exact.peak, {"dbeta": float(np.max(exact.dbeta_terms, initial=0.0))}


def errors(
    results: dict[str, Array], exact: dict[str, Array], dtype: DTypeLike, least: dict[str, float]
) -> dict[str, float]:
    assert set(results) == set(exact)
    return {n: relative_error(results[n], exact[n], dtype, least.get(n, 0.0)) for n in exact}


def assert_float32_bound(case: Case, measured: dict[str, float], steps: dict[str, float]) -> None:
    """Every float32 error within ten times the float32 recurrence's, plus the slack."""
    ratios = {n: measured[n] / (FLOAT32_FACTOR * e + FLOAT32_SLACK) for n, e in steps.items()}
    assert all(r <= 1.0 for r in ratios.values()), (case, ratios, measured, steps)


def check(case: Case, dtype: DTypeLike, **options: Any) -> None:
    inputs = case.draw(dtype)
    exact, _, least = truth(inputs)
    if np.dtype(dtype) == np.float64:
        measured = errors(library(inputs, np.float64, **options), exact, np.float64, least)
        assert all(e <= FLOAT64_BOUND for e in measured.values()), (case, measured)
    else:
        measured = errors(library(inputs, np.float32, **options), exact, np.float32, {})
        stepped = library(inputs, np.float32, **{**options, "method": "recurrent"})
        assert_float32_bound(case, measured, errors(stepped, exact, np.float32, {}))


CASES = st.builds(
    Case,
    batch=st.integers(1, 2),
    seq=st.one_of(st.integers(1, 24), st.sampled_from((31, 33, 47, 65, 70))),
    heads=st.integers(1, 2),
    n=st.sampled_from((1, 2, 3, 4, 5, 8, 16, 32)),
    gates=st.sampled_from(GATES),
    per_channel=st.booleans(),
    carry=st.booleans(),
    norms=st.sampled_from(("unit", "upto4")),
    beta=st.sampled_from(BETAS),
    seed=st.integers(0, 2**32 - 1),
)


def within_regime(case: Case, dtype: DTypeLike) -> bool:
    return truth(case.draw(dtype))[1] < PEAK_LIMIT[np.dtype(dtype)]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["float64", "float32", "float64 recurrent"])
@settings(max_examples=30, deadline=None)
@given(case=CASES)
def test_every_regime(case: Case, form: str) -> None:
    """Random draws; the float64 recurrence is the control that the bound is reachable."""
    dtype = np.float32 if form == "float32" else np.float64
    assume(within_regime(case, dtype))
    check(case, dtype, **({"method": "recurrent"} if "recurrent" in form else {}))


@settings(max_examples=15, deadline=None)
@given(case=CASES, every=st.integers(1, 80))
def test_checkpoint_interval_does_not_matter(case: Case, every: int) -> None:
    assume(within_regime(case, np.float64))
    check(case, np.float64, checkpoint_every=every)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        # the smallest case a chunk once failed: dg as a difference of terms of size exp(+-20)
        Case(1, 2, 1, 4, gates="const-20"),
        Case(1, 2, 1, 4, gates="const-20", per_channel=True),
        # |k| = 3: a chunk's system is badly conditioned (float64 y was off by 2.5e-11)
        *(Case(1, 130, 1, 16, gates="uniform-0.1,0", norms="key3", seed=s) for s in range(2)),
        # raw keys, per-channel gate (float32 y was off by 95%, the final state by 60%)
        Case(1, 64, 1, 16, norms="raw", per_channel=True, seed=2),
        Case(1, 64, 1, 16, norms="raw", per_channel=True, carry=True, seed=3),
        # state sizes
        *(Case(1, 9 if n > 64 else 40, 2, n, gates="qwen", carry=True, seed=n)
          for n in (1, 3, 33, 128)),
        Case(1, 40, 2, 16, gates="qwen", per_channel=True, carry=True),
        # sequence lengths off and on the chunks' multiples
        *(
            Case(1, s, 1, 4, gates="uniform-80,-5", per_channel=s % 2 == 1, carry=True,
                 norms="upto4", beta="mixed", seed=s)
            for s in (1, 3, 65, 257, 513)
        ),
        # random draws the chunked form once missed the float32 bound on
        Case(2, 31, 2, 3, norms="upto4", beta="one", seed=1),  # dq 1.2x
        Case(1, 70, 1, 1, gates="spiky", norms="upto4", seed=1705268387),  # y 5.6x, N = 1
        Case(2, 70, 1, 2, carry=True, norms="key3", beta="mixed", seed=2004260863),  # dq 5.4x
        Case(1, 70, 1, 32, per_channel=True, norms="raw", beta="one", seed=466143726),  # dk inf
        Case(1, 1, 1, 32, gates="spiky", per_channel=True, carry=True, norms="upto4",
             beta="zero", seed=23),
    ],
    ids=str,
)  # fmt: skip
def test_named_regimes(case: Case, dtype: DTypeLike) -> None:
    check(case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize("gates", [*STRONG_DECAY, "uniform-80,-5", "qwen", "spiky", "mixed"])
def test_strong_decay_and_realistic_gates(
    gates: str, per_channel: bool, carry: bool, dtype: DTypeLike
) -> None:
    case = Case(2, 37, 2, 8, gates=gates, per_channel=per_channel, carry=carry, seed=1)
    check(case.with_(seq=130, n=16) if gates in ("qwen", "spiky", "mixed") else case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize("beta", ["zero", "one", "mixed"])
@pytest.mark.parametrize("norms", ["key1.4", "upto4"])
def test_beta_exactly_zero_and_one(
    norms: str, beta: str, per_channel: bool, carry: bool, dtype: DTypeLike
) -> None:
    """Keys of norm 1.4 keep every step chunked (beta |k|^2 up to 1.96); keys of norm up to 4
    with beta = 1 send the default to the step-by-step form."""
    case = Case(2, 33, 2, 4, gates="spiky", per_channel=per_channel, carry=carry, beta=beta)
    check(case.with_(norms=norms, seed=4), dtype)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "case"),
    [
        pytest.param(np.float64, Case(gates="uniform-0.1,0", norms="key1.4"), id="float64"),
        pytest.param(np.float32, Case(gates="spiky", norms="key1.4"), id="float32"),
        pytest.param(np.float64, Case(gates="uniform-0.1,0", norms="upto4"), id="step-by-step"),
    ],
)
def test_long_sequence_with_checkpoint_interval_64(dtype: DTypeLike, case: Case) -> None:
    """S=2050, N=8, per-channel gate: intervals of 64 steps in chunks of up to 32; keys of norm
    up to 4 take the step-by-step form and grow the state to about 1e92."""
    check(case.with_(seq=2050, n=8, per_channel=True, carry=True), dtype, checkpoint_every=64)


@pytest.mark.parametrize(
    ("dtype", "case"),
    [
        pytest.param(np.float32, Case(1, 18, 1, 5, gates="const-5"), id="float32"),
        pytest.param(np.float64, Case(1, 10, 1, 4, gates="const-72"), id="float64"),
    ],
)
def test_a_state_that_decays_into_the_subnormal_range(dtype: DTypeLike, case: Case) -> None:
    """beta = 0: the final state is the carried one times a chunk's decay, below the smallest
    normal number; the factor must stay subnormal, not become zero."""
    case = case.with_(carry=True, beta="zero")
    final = np.abs(truth(case.draw(dtype))[0]["final"]).max()
    assert 0 < final < np.finfo(dtype).tiny
    check(case, dtype)


def scaled_draw(case: Case, squared_norms: tuple[float, float] | None) -> Inputs:
    """``case``'s float32 inputs, q and k scaled to squared norms drawn per step uniformly in
    ``squared_norms`` from ``default_rng(seed + 1)`` (as the sweeps that found them)."""
    inputs = case.draw(np.float64)
    if squared_norms is not None:
        rng = np.random.default_rng(case.seed + 1)
        for name in ("k", "q"):
            norms = rng.uniform(*squared_norms, (*inputs[name].shape[:-1], 1))
            inputs[name] = inputs[name] * np.sqrt(norms)
    return {name: value.astype(np.float32) for name, value in inputs.items()}


#: Draws whose float32 gradients missed the bound when the chunked backward sweep ran in float32
#: (a gate's terms cancel 35- to 45-fold), or met it only by the slack (the state's cotangent
#: where each update nearly erases the state): then the named gradient is within ten times
#: the recurrence's error without the slack.
CANCELLING = [
    (Case(1, 8, 1, 16, gates="const-20", carry=True, beta="zero", seed=1638041034), None, ""),
    (Case(1, 8, 1, 64, gates="const-12", carry=True, seed=3751434224), None, ""),
    (Case(1, 31, 1, 2, gates="uniform-80,-5", per_channel=True, beta="one", seed=2174670497),
     (0.8, 1.0), ""),
    (Case(1, 31, 1, 2, per_channel=True, carry=True, beta="one", seed=2461753969), (0.8, 1.0),
     "dstate"),
    (Case(1, 47, 1, 2, carry=True, beta="one", seed=48436460), (0.8, 1.0), "dstate"),
    (Case(1, 47, 1, 16, gates="uniform-80,-5", carry=True, beta="one", seed=4212739084),
     (0.9, 1.0), "dg"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "squared_norms", "name"), CANCELLING, ids=str)
def test_sums_that_cancel_in_float32(
    case: Case, squared_norms: tuple[float, float] | None, name: str
) -> None:
    inputs = scaled_draw(case, squared_norms)
    exact = truth(inputs)[0]
    chunked = library(inputs, np.float32)
    stepped = library(inputs, np.float32, method="recurrent")
    assert any(not np.array_equal(chunked[n], stepped[n]) for n in chunked)  # chunks were taken
    measured, steps = (errors(r, exact, np.float32, {}) for r in (chunked, stepped))
    if name:
        assert measured[name] <= FLOAT32_FACTOR * steps[name], (case, measured, steps)
    assert_float32_bound(case, measured, steps)


@pytest.mark.parametrize(
    ("case", "chunked"),
    [
        (Case(1, 40, 2, 4, beta="one"), True),  # unit keys: beta |k|^2 = 1
        (Case(1, 40, 2, 4, norms="key1.4", beta="one"), True),  # 1.96
        (Case(1, 40, 2, 4, norms="key1.5", beta="one"), False),  # 2.25
        (Case(1, 40, 2, 1, beta="one", per_channel=True), False),  # N = 1
    ],
    ids=str,
)
def test_the_chunked_form_runs_where_it_suits_the_inputs(case: Case, chunked: bool) -> None:
    """For N = 1 and a step with beta |k|^2 > 2 the default is method="recurrent", bit for bit."""
    inputs = case.draw(np.float64)
    default, steps = library(inputs, np.float64), library(inputs, np.float64, method="recurrent")
    assert all(np.array_equal(default[n], steps[n]) for n in default) is not chunked


def test_a_key_too_large_to_square_counts_as_expanding() -> None:
    """beta |k|^2 of a key of norm 1e160 overflows to NaN where beta = 0; that must not hide a
    later step with beta |k|^2 = 9, nor warn."""
    inputs = Case(1, 4, 1, 4, beta="one").draw(np.float64)
    inputs["k"][0, 0] *= 1e160
    inputs["beta"][0, 0] = 0.0
    inputs["k"][0, 1] *= 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = library(inputs, np.float64)
    steps = library(inputs, np.float64, method="recurrent")
    assert all(np.array_equal(default[name], steps[name]) for name in default)

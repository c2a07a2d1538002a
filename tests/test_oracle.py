"""The long-double oracle of ``oracle.py`` checked on its own, without the library's backward.

Its gradients against "exact differences" of its own forward (``sum(y * dy)`` is affine in each
element of ``q``, ``v``, ``beta``, the state and ``exp(g)``, quadratic in each of ``k``: a central
difference with a step of order one has no truncation error, in any gate regime); its forward is
the library's (test_reference_exact.py), which docs/reference.md writes out step by step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from oracle import EXTENDED, OracleResult, extended, oracle, oracle_forward, relative_error
from regimes import MODES, Case, Inputs

Array = NDArray[Any]

EPS = float(np.finfo(EXTENDED).eps)
GRADS = ("q", "k", "v", "g", "beta", "state")


def loss(inputs: Inputs) -> tuple[Array, Array]:
    """``sum(y * dy)`` in long double, and the sum of the magnitudes of its terms (the scale
    of its rounding)."""
    args: Any = [inputs.get(name) for name in ("q", "k", "v", "g", "beta", "state")]
    y, _ = oracle_forward(*args)
    terms = y * extended(inputs["dy"])
    return np.sum(terms), np.sum(np.abs(terms))


def run(inputs: Inputs) -> OracleResult:
    args: Any = [inputs.get(name) for name in ("q", "k", "v", "g", "beta", "dy", "state")]
    return oracle(*args)


def gradient(result: OracleResult, name: str) -> Array:
    return np.asarray(getattr(result, "d" + name))


def long_double_inputs(case: Case) -> Inputs:
    return {name: extended(value) for name, value in case.draw().items()}


def check_differences(inputs: Inputs, result: OracleResult) -> None:
    """Every gradient against central differences of the long-double loss with steps of order
    one (no truncation error, see the module docstring; the gate moved by +-1, over ``2
    sinh(1)``). Allowed: the two losses' rounding, ``64 * eps * sum|terms| / divisor``, plus
    ``1e-13`` of the gradient's largest element."""
    for name in (name for name in GRADS if name in inputs):
        base, grad = inputs[name], gradient(result, name)
        assert grad.shape == base.shape
        scale = float(np.max(np.abs(grad), initial=0.0))
        for index in np.ndindex(base.shape):
            saved = base[index]
            step = extended(1.0) if name == "g" else max(extended(1.0), abs(saved))
            divisor = 2 * np.sinh(step) if name == "g" else 2 * step
            base[index] = saved + step
            up, up_size = loss(inputs)
            base[index] = saved - step
            down, down_size = loss(inputs)
            base[index] = saved
            estimate = (up - down) / divisor
            allowed = 64 * EPS * (up_size + down_size) / divisor + 1e-13 * scale
            assert abs(grad[index] - estimate) <= allowed, (name, index, grad[index], estimate)


@pytest.mark.parametrize(("per_channel", "carry"), MODES)
@pytest.mark.parametrize(
    "case",
    [
        Case(1, 1, 1, 1, seed=0),
        Case(2, 4, 1, 2, seed=6),
        Case(1, 4, 2, 3, gates="const-20", norms="unit", beta="uniform", seed=1),
        Case(1, 5, 1, 2, gates="const-80", norms="upto4", beta="mixed", seed=2),
        Case(2, 3, 1, 3, gates="uniform-30,-10", norms="key3", beta="one", seed=3),
        Case(1, 7, 1, 2, gates="spiky", norms="upto4", beta="mixed", seed=5),
    ],
    ids=str,
)
def test_oracle_matches_exact_differences(case: Case, per_channel: bool, carry: bool) -> None:
    case = case.with_(per_channel=per_channel, carry=carry)
    inputs = long_double_inputs(case)
    check_differences(inputs, run(inputs))


def test_oracle_is_extended_precision() -> None:
    # The checks above are only as strong as the precision they run in: 1e-12 bounds on a
    # float64 result need a truth far finer than float64.
    assert np.finfo(EXTENDED).eps < 1e-3 * np.finfo(np.float64).eps
    inputs = Case(1, 3, 1, 2, carry=True).draw()
    result = run(inputs)
    for array in (result.y, result.final, result.dg, result.dstate):
        assert array is not None
        assert array.dtype == EXTENDED


def test_relative_error() -> None:
    truth = np.array([2.0, -4.0])
    assert relative_error(np.array([2.0, -3.0]), truth) == 0.25
    assert relative_error(np.array([0.5, 0.0]), np.zeros(2)) == 0.5  # absolute where truth is 0
    assert relative_error(np.array([np.nan, 0.0]), truth) == float("inf")
    # A truth below float64's range, flushed to zero, is no error in float64.
    tiny = np.array([np.exp(extended(-800))])
    assert relative_error(np.zeros(1), tiny) < 1e-30
    assert relative_error(np.zeros(1), tiny, np.float32) < 1e-300
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(np.zeros(2), np.zeros(3))

"""``check._criterion``: verdicts at the edges, and scores of many rows at once.

float64 is judged against floors like the other classes: the bugs a float64 suite judged
``rtol = atol = 1e-7`` let through while the float32 suite caught them (a flipped ``dg``, a
transposed ``dstate``, a gate read one step late) fail it. A gradient that is zero or far below
its terms is judged against the rounding of those terms. A criterion's scores of many rows at
once are its score of each row, and plain formulas' in float64.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, compare, save_fixture, unpack
from gdn_layout._dtypes import UNIT_ROUNDOFF
from gdn_layout.check import Criterion, K
from gdn_layout.check._criterion import row_scores
from gdn_layout.files import Fixture, load_fixture
from gdn_layout.generate import make_fixture, write_suite
from gdn_layout.reference import backward
from support import shared_folder

Bug = Callable[[Fixture], NDArray[Any]]


@pytest.fixture(scope="module")
def wide_suite(tmp_path_factory: pytest.TempPathFactory) -> list[Fixture]:
    """The standard suite in float64, with the seed of the session's float32 one."""
    paths = shared_folder(
        tmp_path_factory, "wide", lambda root: write_suite(root, dtype=np.float64, seed=100)
    )
    return [load_fixture(p) for p in paths]


@pytest.fixture(scope="module")
def narrow_suite(suite: tuple[Path, list[Path]]) -> list[Fixture]:
    return [load_fixture(p) for p in suite[1]]


def _judged(fixture: Fixture, actual: NDArray[Any]) -> bool:
    return compare(
        actual, fixture.packed, fixture.layout, floors=fixture.floors, scales=fixture.scales
    ).passed


def flipped_dg(fixture: Fixture) -> NDArray[Any]:
    out = fixture.packed.copy()
    unpack(out, fixture.layout).dg[...] *= -1
    return out


def transposed_dstate(fixture: Fixture) -> NDArray[Any]:
    out = fixture.packed.copy()
    dstate = unpack(out, fixture.layout).dstate
    if dstate is not None:
        dstate[...] = dstate.swapaxes(-1, -2).copy()
    return out


def gate_one_step_late(fixture: Fixture) -> NDArray[Any]:
    x = fixture.inputs
    late = np.zeros_like(x.g)
    late[:, 1:] = x.g[:, :-1]
    return backward(x.q, x.k, x.v, late, x.beta, x.dy, x.state, dtype=fixture.dtype)


@pytest.mark.slow
def test_float64_suite_passes_correct_float64_kernels(wide_suite: list[Fixture]) -> None:
    # The spec's step-by-step form is a different order of operations from the reference's.
    failed = [
        fx.path.name if fx.path else "?"
        for fx in wide_suite
        if not _judged(fx, backward(*fx.inputs, dtype=np.float64, method="recurrent"))
    ]
    assert failed == []


@pytest.mark.slow
@pytest.mark.parametrize("bug", [flipped_dg, transposed_dstate, gate_one_step_late])
def test_float64_catches_what_float32_catches(
    bug: Bug, wide_suite: list[Fixture], narrow_suite: list[Fixture]
) -> None:
    def names(fixtures: list[Fixture]) -> set[str]:
        # A recomputing bug over the first suite's shapes (S <= 130) only: they are where
        # rtol = atol = 1e-7 let float64 bugs through, and the rest cost seconds each.
        cheap = [fx for fx in fixtures if bug is not gate_one_step_late or fx.layout.seq <= 130]
        return {fx.path.name for fx in cheap if fx.path and not _judged(fx, bug(fx))}

    caught32 = names(narrow_suite)
    assert caught32  # the bug is one float32 sees
    assert caught32 <= names(wide_suite)


# -- a dg that is zero, or far below its terms ---------------------------------------------


def _identity_dg(fixture: Fixture) -> NDArray[Any]:
    """The packed expected gradient with ``dg`` formed as chunked kernels form it, in the
    fixture's dtype: ``q . dq - k . dk`` (per channel, ``q dq - k dk``), exact at S=1 with no
    state, where ``dg`` is 0, up to the rounding of that difference."""
    out = fixture.packed.copy()
    grads = unpack(out, fixture.layout)
    x = fixture.inputs
    terms = x.q * grads.dq - x.k * grads.dk
    grads.dg[...] = terms if fixture.layout.gate_per_channel else terms.sum(axis=-1)
    return out


def test_a_zero_dg_formed_by_the_identity_passes_against_its_terms_and_a_real_error_fails(
    narrow_suite: list[Fixture],
) -> None:
    cases = [fx for fx in narrow_suite if fx.layout.seq == 1 and not fx.layout.carry_state]
    assert len(cases) == 2 * len({fx.regime for fx in narrow_suite})  # both gate modes
    assert all(not np.any(fx.grads.dg) for fx in cases)
    residues = []
    for fx in cases:
        actual = _identity_dg(fx)
        dg = unpack(actual, fx.layout).dg
        residues.append(float(np.abs(dg).max()))
        judged = compare(actual, fx.packed, fx.layout, floors=fx.floors, scales=fx.scales)
        assert judged["dg"].passed, judged["dg"].summary()
        if np.any(dg):
            assert judged["dg"].criterion.term_scale == fx.scales["dg"]
            # Against its own RMS of 0, the same residue would allow nothing at all.
            assert not compare(actual, fx.packed, fx.layout, floors=fx.floors)["dg"].passed
        dg.reshape(-1)[0] += 1e-3 * fx.scales["dg"]  # far above rounding, far below the terms
        judged = compare(actual, fx.packed, fx.layout, floors=fx.floors, scales=fx.scales)
        assert not judged["dg"].passed
        assert (judged["dg"].error_floor_ratio or 0.0) > 1e3
    assert max(residues) > 0  # the rounding of the difference is there to be judged


def test_the_least_floor_is_half_the_unit_roundoff_times_the_terms() -> None:
    layout = GdnBackwardLayout(1, 1, 1, 4)
    expected = np.zeros(layout.total_elems, np.float32)
    actual = expected.copy()
    k = K["float32"]
    unpack(actual, layout).dg[0, 0, 0] = k * UNIT_ROUNDOFF["float32"] / 2 * 3.0
    at_limit = compare(actual, expected, layout, scales={"dg": 3.0})["dg"]
    assert at_limit.passed
    assert at_limit.error_floor_ratio == pytest.approx(k)
    least = f"{UNIT_ROUNDOFF['float32'] / 2:.3g}"
    assert f"none below {least} x 3, the scale of its terms" in at_limit.summary()
    assert not compare(actual, expected, layout, scales={"dg": 2.9})["dg"].passed
    # A scale below rms(expected) changes nothing: a gradient is never judged more leniently.
    unpack(expected, layout).dg[0, 0, 0] = 10.0
    unpack(actual, layout).dg[0, 0, 0] = 10.0
    kept = compare(actual, expected, layout, scales={"dg": 1.0})["dg"]
    assert kept.criterion.term_scale is None
    assert kept == compare(actual, expected, layout)["dg"]


def test_scales_are_checked_like_tolerances() -> None:
    layout = GdnBackwardLayout(1, 1, 1, 4)
    zeros = np.zeros(layout.total_elems)
    with pytest.raises(ValueError, match=r"scales has unknown gradient names \['dx'\]"):
        compare(zeros, zeros, layout, scales={"dx": 1.0})
    with pytest.raises(ValueError, match=r"scales\['dg'\] must be a finite float >= 0, got -1"):
        compare(zeros, zeros, layout, scales={"dg": -1})
    with pytest.raises(TypeError, match="scales must be a float, got str"):
        compare(zeros, zeros, layout, scales="big")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_dg_never_computed_fails_in_float16_and_bfloat16_too(dtype: str) -> None:
    # Their kernels compute in float32: the terms' rounding is float32's, not the output's.
    fx = load_fixture(
        save_fixture(
            Path(tempfile.mkdtemp()) / "x.safetensors",
            make_fixture(
                GdnBackwardLayout(1, 65, 2, 16, carry_state=True),
                regime="strong",
                dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16,
            ),
        )
    )
    actual = backward(*fx.inputs, dtype=np.float32).astype(fx.dtype)
    assert compare(actual, fx.packed, fx.layout, floors=fx.floors, scales=fx.scales).passed
    unpack(actual, fx.layout).dg[...] = 0
    judged = compare(actual, fx.packed, fx.layout, floors=fx.floors, scales=fx.scales)
    assert not judged["dg"].passed


def test_a_verdict_agrees_with_its_ratio() -> None:
    layout = GdnBackwardLayout(1, 1, 1, 2)
    expected = np.zeros(layout.total_elems)
    unpack(expected, layout).dg[...] = 5e-324
    actual = expected.copy()
    unpack(actual, layout).dg[...] = 3e-15
    grad = compare(actual, expected, layout, scales={"dg": 1.0})["dg"]
    assert grad.error_floor_ratio is not None
    assert grad.passed == (grad.error_floor_ratio <= grad.criterion.limit)


Array = NDArray[np.float64]

CRITERIA = {
    "calibrated": Criterion.calibrated(None, "float32", "dq", np.linspace(-1, 1, 64)),
    "elementwise": Criterion.tolerances(1e-3, 1e-6),
    "rms": Criterion.tolerances(0.0, 0.0, 1e-3, elementwise=False),
    "both": Criterion.tolerances(1e-3, 1e-6, 1e-3),
    "exact": Criterion.tolerances(0.0, 0.0),  # nothing allowed: 0 or inf
}


def plain_score(c: Criterion, a: Array, e: Array) -> float:
    """The criterion's score written out in plain float64 NumPy (its docstring's words)."""
    if a.size == 0:
        return 0.0
    if not (np.isfinite(a).all() and np.isfinite(e).all()):
        return math.inf
    err = np.abs(a - e)

    def over(error: float, allowed: float) -> float:
        return 0.0 if error == 0 else (math.inf if allowed == 0 else error / allowed)

    rms = float(np.sqrt(np.mean(err**2)))
    if c.floor is not None:
        rms_floor, max_floor = c.errors
        return max(over(float(err.max()), c.limit * max_floor), over(rms, c.limit * rms_floor))
    scores = []
    if c.counts_elements:
        allowed = c.atol + c.rtol * np.abs(e)
        scores.append(max(over(float(x), float(y)) for x, y in zip(err, allowed, strict=True)))
    if c.max_rms_ratio is not None:
        scores.append(over(rms, c.max_rms_ratio * float(np.sqrt(np.mean(e**2)))))
    return max(scores)


# Magnitudes whose squares neither underflow nor overflow: plain_score squares them unscaled.
values = st.sampled_from([0.0, np.nan, np.inf]) | st.floats(1e-100, 1e3) | st.floats(-1e3, -1e-100)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(sorted(CRITERIA)),
    e=hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, max_side=6), elements=values),
    noise=st.just(0.0) | st.floats(1e-100, 1e-2),
    data=st.data(),
)
def test_row_scores_are_each_rows_score(
    mode: str, e: Array, noise: float, data: st.DataObject
) -> None:
    c = CRITERIA[mode]
    kept = data.draw(hnp.arrays(np.bool_, e.shape))  # some elements exact, the rest perturbed
    a = np.where(kept, e, e * (1 + noise) + noise)
    got = row_scores(c, a, e)
    assert got.shape == (e.shape[0],)
    for row in range(e.shape[0]):
        want = plain_score(c, a[row], e[row])
        assert got[row] == c.score(a[row], e[row]) == pytest.approx(want, rel=1e-12, abs=0)

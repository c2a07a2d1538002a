"""The findings' vectorised parts give what the plain forms give: a criterion's scores of many
rows at once are its score of each row, and plain formulas' in float64; per-step scores from a
score's ``steps`` name what one call per step names; the unwritten and nonfinite scan, a block
of steps at a time, counts and locates what a plain pass over every element does."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, compare, unpack
from gdn_layout.check import Criterion
from gdn_layout.check import _findings as findings
from gdn_layout.check._criterion import row_scores, step_scores
from gdn_layout.check._findings import grad_findings
from gdn_layout.generate import draw_inputs
from gdn_layout.reference import backward

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
        assert got[row] == c.score(a[row], e[row])
        want = plain_score(c, a[row], e[row])
        assert got[row] == pytest.approx(want, rel=1e-12, abs=0), (row, a[row], e[row])


def test_row_scores_of_huge_and_tiny_errors_do_not_overflow_or_underflow() -> None:
    c = Criterion.tolerances(0.0, 0.0, 1.0, elementwise=False)
    e = np.array([[1e300, -1e300], [1e-300, 2e-300]])
    a = -e
    # rms(a - e) / rms(e) is exactly 2 on both rows; squaring would overflow or underflow.
    np.testing.assert_allclose(row_scores(c, a, e), [2.0, 2.0], rtol=1e-15)


class _PerStep:
    """A score with per-step scores: a criterion for each gradient."""

    def __init__(self, criteria: dict[str, Criterion]) -> None:
        self.criteria = criteria

    def __call__(self, name: str, a: Array, e: Array) -> float:
        return self.criteria[name].score(a, e)

    def steps(self, name: str, a: Array, e: Array) -> Array:
        return step_scores(self.criteria[name], a, e)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    t0=st.integers(1, 47),
    width=st.integers(1, 48),
    size=st.floats(1e-6, 1.0),
    name=st.sampled_from(["dq", "dv", "dg", "dbeta"]),
    regime=st.sampled_from(["mild", "strong", "extreme"]),
)
def test_per_step_scores_find_what_one_call_per_step_finds(
    t0: int, width: int, size: float, name: str, regime: str
) -> None:
    layout = GdnBackwardLayout(2, 48, 3, 8)
    e = getattr(unpack(truth(layout, regime), layout), name)
    a = e.copy()
    a[:, t0 : t0 + width] += size * np.sqrt(np.mean(e**2))  # wrong on a run of steps
    criteria = {n: Criterion.calibrated(None, "float32", n, e) for n in layout.names}
    vectorised = _PerStep(criteria)

    def one_call_per_step(n: str, a: Array, e: Array) -> float:
        return criteria[n].score(a, e)

    assert grad_findings(name, a, e, layout, vectorised) == grad_findings(
        name, a, e, layout, one_call_per_step
    )


_TRUTHS: dict[tuple[GdnBackwardLayout, str], Array] = {}


def truth(layout: GdnBackwardLayout, regime: str) -> Array:
    key = (layout, regime)
    if key not in _TRUTHS:
        _TRUTHS[key] = backward(*draw_inputs(layout, regime=regime, seed=1, dtype=np.float64))
    return _TRUTHS[key]


def test_compare_names_a_boundary_from_its_per_step_scores() -> None:
    layout = GdnBackwardLayout(1, 40, 2, 8)
    e = truth(layout, "mild")
    a = e.astype(np.float32)
    dq = unpack(a, layout).dq
    dq[:, 20:] *= np.float32(1.5)  # right before step 20, wrong from it on
    (found,) = compare(a, e, layout)["dq"].findings
    assert (found.kind, found.details["step"], found.details["side"]) == ("boundary", 20, "from")


@pytest.mark.parametrize(
    ("name", "shape"),
    [("dq", (2, 300, 4, 64)), ("dg", (3, 70000, 1)), ("dstate", (40, 2, 64, 64))],
)
def test_the_block_scan_counts_and_locates_what_every_element_shows(
    name: str, shape: tuple[int, ...]
) -> None:
    """Shapes of several blocks, one step per block and huge blocks; NaN and Inf where the
    expected values are finite, first in step (batch, for dstate) order."""
    rng = np.random.default_rng(5)
    e = rng.standard_normal(shape)
    a = e.astype(np.float32)
    flat = a.reshape(-1)
    hit = rng.choice(a.size, 40, replace=False)
    flat[hit[:30]] = np.nan
    flat[hit[30:]] = -np.inf
    e.reshape(-1)[hit[:3]] = np.inf  # not counted: expected not finite there
    slab = 0 if name == "dstate" else 1
    bad = ~np.isfinite(a) & np.isfinite(e)
    order = np.argwhere(np.moveaxis(bad, slab, 0))  # slab first, then C order within it
    first = [tuple(int(x) for x in np.insert(c[1:], slab, c[0])) for c in order[:5]]
    per_slab = np.count_nonzero(np.moveaxis(bad, slab, 0).reshape(shape[slab], -1), axis=1)

    scan = findings._scan(name, a, e)
    assert scan.bad == 37
    assert scan.first_bad == first
    assert scan.bad_per_slab == per_slab.tolist()
    assert scan.expected_finite is False
    assert scan.wild == 40
    assert scan.zeros == 0
    rows = np.moveaxis(e, slab, 0).reshape(shape[slab], -1)
    finite_rows = np.isfinite(rows).all(axis=1)  # the largest of the slabs all finite
    assert scan.expected_max == np.abs(rows[finite_rows]).max()

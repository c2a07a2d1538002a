"""``check._scan``: the one pass over a gradient and the maps it makes.

The per-batch maps (``batch_error_map``, ``mismatch_map``) in bounded memory: binned as
``error_map`` is, the batch too when B alone is too large, and drawn on their binned cells.

A failing gradient's cause maps (``signed_error_map``, ``ratio_map``) against a brute-force
oracle cell by cell, binned or not, and the pictures drawn from them: a scale is one colour,
a transpose a mirrored tile, a boundary a dashed line at its step.
"""

from __future__ import annotations

import importlib
import itertools
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, make_fixture, unpack
from gdn_layout.check import Comparison, GradComparison, compare
from gdn_layout.reference import backward

_ERRORMAP = importlib.import_module("gdn_layout.check._scan")


def _assert_consistent(result: Comparison) -> None:
    for grad in result.grads:
        assert grad.batch_error_map.size <= _ERRORMAP.MAP_CELLS
        assert grad.mismatch_map.shape == grad.batch_error_map.shape
        assert grad.batch_error_map.shape[1:] == grad.error_map.shape
        assert not grad.batch_error_map.flags.writeable
        assert not grad.mismatch_map.flags.writeable
        np.testing.assert_array_equal(grad.batch_error_map.max(axis=0, initial=0.0), grad.error_map)
        assert int(grad.mismatch_map.sum()) == grad.mismatches


@pytest.mark.slow
def test_large_per_batch_maps_are_binned_along_the_sequence() -> None:
    # B * S * H = 2**21 cells: every map binned by 2 along s, the error map with them.
    layout = GdnBackwardLayout(2**10, 2**11, 1, 1)
    expected = np.zeros(layout.total_elems, np.float32)
    actual = expected.copy()
    unpack(actual, layout).dv[7, 9, 0, 0] = 0.5
    result = compare(actual, expected, layout)
    dv = result["dv"]
    assert dv.error_map_bins == (2, 1)
    assert dv.batch_bins == 1
    assert dv.batch_error_map.shape == (2**10, 2**10, 1)
    assert dv.batch_error_map[7, 4, 0] == 0.5
    assert dv.mismatch_map[7, 4, 0] == 1
    assert dv.error_map.shape == (2**10, 1)
    _assert_consistent(result)


@pytest.mark.slow
def test_a_huge_batch_is_binned_too() -> None:
    layout = GdnBackwardLayout(2**21, 1, 1, 1)
    expected = np.zeros(layout.total_elems, np.float32)
    actual = expected.copy()
    unpack(actual, layout).dg[2**20 + 3, 0, 0] = np.inf
    result = compare(actual, expected, layout)
    dg = result["dg"]
    assert dg.batch_bins == 2
    assert dg.batch_error_map.shape == (2**20, 1, 1)
    assert dg.batch_error_map[2**19 + 1, 0, 0] == np.inf
    assert dg.error_map.tolist() == [[np.inf]]
    _assert_consistent(result)


def _marked(monkeypatch: pytest.MonkeyPatch) -> Comparison:
    # 2 * 8 * 3 = 48 cells, twice the limit: positions binned in pairs along s.
    monkeypatch.setattr(_ERRORMAP, "MAP_CELLS", 24)
    layout = GdnBackwardLayout(2, 8, 3, 2)
    expected = np.zeros(layout.total_elems)
    actual = expected.copy()
    dk = unpack(actual, layout).dk
    dk[0, 1, 0, 0] = 1.0
    dk[0, 2, 0, 1] = 1.0
    dk[1, 4, 2, 0] = 1.0
    dk[0, 5, 1, 0] = 1e-4  # within atol
    return compare(actual, expected, layout, rtol=0.0, atol=1e-3)


def test_binned_per_batch_maps_keep_the_largest_error_and_count_of_each_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = _marked(monkeypatch)
    dk = result["dk"]
    assert dk.error_map_bins == (2, 1)
    assert dk.batch_error_map.shape == (2, 4, 3)
    assert dk.mismatch_map[0].tolist() == [[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert dk.mismatch_map[1, 2, 2] == 1
    assert dk.batch_error_map[0, 2, 1] == 1e-4
    _assert_consistent(result)


def test_binned_maps_are_drawn_on_their_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.collections import LineCollection

    result = _marked(monkeypatch)

    def panel(**kwargs: Any) -> Any:
        fig = result.plot(names=["dk"], **kwargs)
        (ax,) = [ax for ax in fig.axes if ax.images]
        return ax

    def outlined(ax: Any) -> set[tuple[float, ...]]:
        lines = [c for c in ax.collections if isinstance(c, LineCollection)]
        (outline,) = [c for c in lines if c.get_label() == "out of tolerance"]
        return {tuple(np.asarray(s).ravel().tolist()) for s in outline.get_segments()}

    ax = panel()
    assert ax.get_xlabel() == "sequence position s / 2 (binned)"
    assert ax.get_ylabel() == "head h"
    assert ax.images[0].get_array().shape == (3, 4)
    # (row h, column binned s): b=0's two cells and b=1's one.
    xs = {x for seg in outlined(ax) for x in seg[::2]}
    assert xs == {-0.5, 0.5, 1.5, 2.5}
    assert outlined(panel(batch=1)) == {
        (1.5, 1.5, 2.5, 1.5),
        (1.5, 2.5, 2.5, 2.5),
        (1.5, 1.5, 1.5, 2.5),
        (2.5, 1.5, 2.5, 2.5),
    }
    # A boundary every 4 positions is every 2 cells; one every position is finer than a cell.
    drawn = panel(chunk=4).collections
    (lines,) = [c for c in drawn if c.get_label() != "out of tolerance"]
    assert sorted({float(s[0][0]) for s in lines.get_segments()}) == [1.5]
    fine = panel(chunk=1).collections
    assert [c.get_label() for c in fine] == ["out of tolerance"]


def test_a_binned_batch_is_named_in_the_panel(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(_ERRORMAP, "MAP_CELLS", 8)
    layout = GdnBackwardLayout(20, 2, 1, 1)
    expected = np.zeros(layout.total_elems)
    actual = expected.copy()
    unpack(actual, layout).dq[10, 1, 0, 0] = 1.0
    result = compare(actual, expected, layout)
    dq = result["dq"]
    assert (dq.batch_bins, dq.error_map_bins) == (3, (2, 1))
    assert dq.batch_error_map.shape == (7, 1, 1)
    assert dq.batch_error_map[3, 0, 0] == 1.0
    _assert_consistent(result)
    fig = result.plot(names=["dq"], batch=10)
    (ax,) = [ax for ax in fig.axes if ax.images]
    assert "b=9..11 (binned)" in ax.get_title()
    assert np.asarray(ax.images[0].get_array()).tolist() == [[1.0]]
    last = next(ax for ax in result.plot(names=["dq"], batch=19).axes if ax.images)
    assert "b=18..19 (binned)" in last.get_title()


_SCAN = importlib.import_module("gdn_layout.check._scan")


def _oracle(
    a: NDArray[Any], e: NDArray[Any], groups: list[list[tuple[int, ...]]]
) -> tuple[list[float], list[float]]:
    """Per group of element indices: the signed error of largest magnitude (NaN for a
    non-finite mismatch) and sum(a e) / sum(e e) over the finite pairs."""
    signed, ratio = [], []
    for group in groups:
        pairs = [(float(a[i]), float(e[i])) for i in group]
        best, best_size = 0.0, -1.0
        dot = norm = 0.0
        for x, y in pairs:
            d = 0.0 if x == y else x - y
            size = abs(d) if math.isfinite(d) else math.inf
            if size > best_size:
                best, best_size = (d if math.isfinite(d) else math.nan), size
            if math.isfinite(x) and math.isfinite(y):
                dot += x * y
                norm += y * y
        signed.append(best)
        ratio.append(dot / norm if norm > 0 else math.nan)
    return signed, ratio


def _cells(grad: GradComparison) -> list[list[tuple[int, ...]]]:
    """The element indices of each cell of a (non-dstate) gradient's per-batch maps, in the
    maps' C order, from its bins."""
    shape = grad.shape
    bb, (bs, bh) = grad.batch_bins, grad.error_map_bins
    groups = []
    for cb, cs, ch in itertools.product(
        range(-(-shape[0] // bb)), range(-(-shape[1] // bs)), range(-(-shape[2] // bh))
    ):
        block = itertools.product(
            range(cb * bb, min((cb + 1) * bb, shape[0])),
            range(cs * bs, min((cs + 1) * bs, shape[1])),
            range(ch * bh, min((ch + 1) * bh, shape[2])),
            *(range(n) for n in shape[3:]),
        )
        groups.append(list(block))
    return groups


def _state_cells(shape: tuple[int, ...], fold: int) -> list[list[tuple[int, ...]]]:
    batch, heads, n = shape[0], shape[1], shape[2]
    side = -(-n // fold)
    return [
        [
            (b, h, i, j)
            for b in range(batch)
            for i in range(ci * fold, min((ci + 1) * fold, n))
            for j in range(cj * fold, min((cj + 1) * fold, n))
        ]
        for h, ci, cj in itertools.product(range(heads), range(side), range(side))
    ]


def _assert_maps(grad: GradComparison, a: NDArray[Any], e: NDArray[Any], groups: Any) -> None:
    signed, ratio = _oracle(a, e, groups)
    assert grad.signed_error_map is not None
    assert grad.ratio_map is not None
    assert not grad.signed_error_map.flags.writeable
    assert not grad.ratio_map.flags.writeable
    np.testing.assert_array_equal(grad.signed_error_map.ravel(), signed)
    np.testing.assert_allclose(grad.ratio_map.ravel(), ratio, rtol=1e-12, equal_nan=True)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    dims=st.tuples(*(st.integers(1, 4) for _ in range(4))),
    state=st.booleans(),
    map_cells=st.sampled_from([1 << 20, 12, 8]),
    seed=st.integers(0, 2**16),
    nonfinite=st.booleans(),
)
def test_cause_maps_equal_the_oracle_cell_by_cell(
    dims: tuple[int, int, int, int],
    state: bool,
    map_cells: int,
    seed: int,
    nonfinite: bool,
) -> None:
    # Tiny map budgets bin the sequence, the heads, the batch and dstate's i and j.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_SCAN, "MAP_CELLS", map_cells)
        _check_against_oracle(dims, state, map_cells, seed, nonfinite)


def _check_against_oracle(
    dims: tuple[int, int, int, int], state: bool, map_cells: int, seed: int, nonfinite: bool
) -> None:
    layout = GdnBackwardLayout(*dims, carry_state=state)
    rng = np.random.default_rng(seed)
    expected = rng.standard_normal(layout.total_elems)
    expected[rng.random(expected.size) < 0.2] = 0.0  # cells whose expected values are all zero
    actual = expected * rng.choice([1.0, -2.0, 3.0], expected.size)
    actual += 1e-3 * rng.standard_normal(actual.size)
    if nonfinite:
        actual[rng.integers(actual.size)] = np.nan
        actual[rng.integers(actual.size)] = np.inf
    result = compare(actual, expected, layout, rtol=1e-9, atol=0.0)
    for seg, grad in zip(layout.segments(), result.grads, strict=True):
        a = actual[seg.offset : seg.offset + seg.length].reshape(seg.shape)
        e = expected[seg.offset : seg.offset + seg.length].reshape(seg.shape)
        if grad.passed:
            assert grad.signed_error_map is None
            assert grad.ratio_map is None
            continue
        if seg.name == "dstate":
            n = seg.shape[2]
            fold = max(1, math.ceil(math.sqrt(seg.shape[1] * n * n / map_cells)))
            assert grad.signed_error_map is not None
            assert grad.signed_error_map.shape == (seg.shape[1], -(-n // fold), -(-n // fold))
            _assert_maps(grad, a, e, _state_cells(seg.shape, fold))
        else:
            assert grad.signed_error_map is not None
            assert grad.signed_error_map.shape == grad.batch_error_map.shape
            _assert_maps(grad, a, e, _cells(grad))


def test_a_long_line_is_folded_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # A dq row of N = 64 elements in chunks of 16: four pieces of one line per cell.
    monkeypatch.setattr(importlib.import_module("gdn_layout._norms"), "CHUNK_ELEMENTS", 16)
    monkeypatch.setattr(_SCAN, "CHUNK_ELEMENTS", 16)
    layout = GdnBackwardLayout(1, 3, 2, 64)
    rng = np.random.default_rng(1)
    expected = rng.standard_normal(layout.total_elems)
    actual = expected.copy()
    dq = unpack(actual, layout).dq
    dq[0, 1, 1, 50] += 5.0
    dq[0, 1, 1, 10] -= 7.0  # the larger, in another piece of the same line
    dq[0, 2] *= 2.0
    grad = compare(actual, expected, layout, rtol=1e-9, atol=0.0)["dq"]
    a = actual[: dq.size].reshape(dq.shape)
    e = expected[: dq.size].reshape(dq.shape)
    _assert_maps(grad, a, e, _cells(grad))
    assert grad.signed_error_map is not None
    assert grad.signed_error_map[0, 1, 1] == -7.0


def test_maps_are_kept_only_for_failing_gradients() -> None:
    layout = GdnBackwardLayout(1, 8, 2, 4)
    expected = np.linspace(-1, 1, layout.total_elems)
    actual = expected.copy()
    unpack(actual, layout).dv[...] *= 4
    result = compare(actual, expected, layout)
    assert result.failed == ("dv",)
    for grad in result.grads:
        kept = grad.signed_error_map is not None, grad.ratio_map is not None
        assert kept == ((True, True) if grad.name == "dv" else (False, False))
    ratio = result["dv"].ratio_map
    assert ratio is not None
    # Every cell with an expected value that is not zero: exactly the factor.
    finite = ratio[np.isfinite(ratio)]
    assert finite.size > 0
    assert np.allclose(finite, 4.0, rtol=1e-12)


# -- the pictures -----------------------------------------------------------------------------

pytest.importorskip("matplotlib")


def _panels(fig: Any) -> dict[str, Any]:
    return {ax.get_title().split()[0]: ax for ax in fig.axes if ax.get_title()}


@pytest.fixture(scope="module")
def fixture_and_bugs() -> tuple[Any, Any, NDArray[np.float32]]:
    layout = GdnBackwardLayout(batch=2, seq=40, heads=4, state_size=6, carry_state=True)
    fixture = make_fixture(layout, dtype=np.float32, seed=0)
    actual = fixture.packed.copy()
    grads = unpack(actual, layout)
    grads.dq[...] *= -1.0  # a sign flip
    assert grads.dstate is not None
    grads.dstate[...] = np.swapaxes(grads.dstate, -1, -2).copy()
    grads.dv[:, :, [0, 3]] = grads.dv[:, :, [3, 0]]
    return layout, fixture, actual


@pytest.mark.slow
def test_ratio_shows_a_scale_as_one_colour(fixture_and_bugs: Any) -> None:
    layout, fixture, actual = fixture_and_bugs
    result = compare(actual, fixture.packed, layout, floors=fixture.floors)
    fig = result.plot(kind="ratio")
    panels = _panels(fig)
    assert set(panels) == {"dq", "dv", "dstate"}
    cells = np.ma.getdata(panels["dq"].images[0].get_array())
    np.testing.assert_allclose(cells, -1.0, rtol=1e-6)  # a sign flip: -1 everywhere
    assert panels["dq"].get_title().endswith("\n<a,e>/<e,e> over b, n")
    # dv: heads 1 and 2 are right (ratio 1); the exchanged heads 0 and 3 are not.
    dv = np.ma.getdata(panels["dv"].images[0].get_array())
    np.testing.assert_allclose(dv[[1, 2]], 1.0, rtol=1e-6)
    assert np.abs(np.nanmedian(dv[[0, 3]], axis=1) - 1).min() > 0.1


@pytest.mark.slow
def test_signed_shows_the_sign_of_the_largest_error_over_the_batch(fixture_and_bugs: Any) -> None:
    layout, fixture, actual = fixture_and_bugs
    result = compare(actual, fixture.packed, layout, floors=fixture.floors)
    shown = np.ma.getdata(_panels(result.plot(kind="signed"))["dq"].images[0].get_array())
    e = unpack(fixture.packed, layout).dq.astype(np.float64)
    d = -2.0 * e  # actual - expected of a sign flip, per element
    # Over n, then over b: the signed value of the largest magnitude, heads down.
    flat = d.transpose(1, 2, 0, 3).reshape(layout.seq, layout.heads, -1)
    at = np.abs(flat).argmax(axis=-1)
    oracle = np.take_along_axis(flat, at[..., None], axis=-1)[..., 0].T
    np.testing.assert_allclose(shown, oracle, rtol=1e-6)
    # And for one batch element, that element's cells.
    one = np.ma.getdata(_panels(result.plot(kind="signed", batch=1))["dq"].images[0].get_array())
    rows = d[1].transpose(1, 0, 2)  # [H, S, N]
    at1 = np.abs(rows).argmax(axis=-1)
    np.testing.assert_allclose(one, np.take_along_axis(rows, at1[..., None], -1)[..., 0], rtol=1e-6)


def test_a_transposed_state_is_a_mirrored_tile_per_head(fixture_and_bugs: Any) -> None:
    layout, fixture, actual = fixture_and_bugs
    result = compare(actual, fixture.packed, layout, floors=fixture.floors)
    assert any(f.kind == "transpose" for f in result["dstate"].findings)
    panel = _panels(result.plot(kind="signed", names=["dstate"]))["dstate"]
    assert len(panel.images) == layout.heads  # one i x j tile per head
    assert [t.get_text() for t in panel.texts] == [f"h={h}" for h in range(layout.heads)]
    for image in panel.images:
        tile = np.ma.getdata(image.get_array())
        assert tile.shape == (layout.state_size, layout.state_size)
        # a - e of a transpose is antisymmetric, zero on the diagonal: a mirrored pattern.
        np.testing.assert_allclose(tile, -tile.T, rtol=1e-6, atol=0)
        assert not np.diagonal(tile).any()
        assert np.abs(tile).max() > 0
    assert "a tile of i x j per head" in panel.get_title()


def test_a_passing_gradient_has_no_cause_map_to_draw(fixture_and_bugs: Any) -> None:
    layout, fixture, actual = fixture_and_bugs
    result = compare(actual, fixture.packed, layout, floors=fixture.floors)
    fig = result.plot(kind="ratio", names=["dk", "dq"])
    panels = _panels(fig)
    assert not panels["dk"].images
    assert [t.get_text() for t in panels["dk"].texts] == [
        "passed: no ratio map\n(kept for failing gradients)"
    ]
    assert panels["dq"].images


@pytest.mark.parametrize("kind", ["errors", "Ratio", "", None, 1])
def test_kind_is_one_of_three(fixture_and_bugs: Any, kind: Any) -> None:
    layout, fixture, actual = fixture_and_bugs
    result = compare(actual, fixture.packed, layout, floors=fixture.floors)
    with pytest.raises(
        ValueError,
        match=rf"plot_errors: kind must be one of 'error', 'signed', 'ratio', got {kind!r}",
    ):
        result.plot(kind=kind)


def _wrong_steps(details: Any, steps: int) -> range:
    """The steps a boundary finding says are wrong."""
    if details["side"] == "window":
        return range(details["first"], details["last"] + 1)
    if details["side"] == "from":
        return range(details["step"], steps)
    return range(details["step"])


@pytest.mark.parametrize(("seq", "split", "side"), [(48, 32, "from"), (96, 64, "window")])
def test_a_state_not_carried_across_a_step_is_named_and_drawn_there(
    seq: int, split: int, side: str
) -> None:
    # The backward run on steps before and after `split` apart: no state carried across it.
    # Its errors fade with the decay away from the step: to the end of a short second part
    # (a boundary from the step on), or within a long one (a run of wrong steps).
    layout = GdnBackwardLayout(batch=1, seq=seq, heads=2, state_size=8)
    fixture = make_fixture(layout, dtype=np.float32, seed=3)
    inputs = [np.asarray(x, dtype=np.float64) for x in fixture.inputs[:6]]
    actual = fixture.packed.copy()
    grads = unpack(actual, layout)
    for lo, hi in ((0, split), (split, seq)):
        part = [x[:, lo:hi] for x in inputs]
        piece = unpack(backward(*part), GdnBackwardLayout.from_inputs(part[0], part[3]))
        for name in ("dq", "dk", "dv", "dg", "dbeta"):
            getattr(grads, name)[:, lo:hi] = getattr(piece, name)
    result = compare(actual, fixture.packed, layout, floors=fixture.floors)
    assert result.failed == ("dq", "dk", "dv", "dg", "dbeta")
    (dq,) = result["dq"].findings
    assert dq.kind == "boundary"
    assert dq.details["step"] == split  # dq is exact before the step, wrong from it on
    assert dq.details["side"] == side
    for name in result.failed:  # every failing gradient: wrong around the step
        (found,) = result[name].findings
        assert found.kind == "boundary", (name, found)
        wrong = _wrong_steps(found.details, seq)
        assert split - 1 in wrong or split in wrong, (name, found)
    panel = _panels(result.plot(names=["dq"]))["dq"]
    (line,) = [c for c in panel.collections if c.get_label() == "boundary finding"]
    assert {float(seg[0][0]) for seg in line.get_segments()} == {split - 0.5}

"""The per-batch maps (``batch_error_map``, ``mismatch_map``) in bounded memory: binned as
``error_map`` is, the batch too when B alone is too large, and drawn on their binned cells."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.check import Comparison, compare

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

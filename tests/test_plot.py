"""plot_layout and plot_errors: pictures that display in a notebook, render headless and mark
errors on the cells where they are."""

from __future__ import annotations

import os
import re
import runpy
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

pytest.importorskip("matplotlib")

from matplotlib.collections import LineCollection, PathCollection
from matplotlib.figure import Figure

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.check import Comparison, K, compare
from gdn_layout.plot import Picture, plot_errors, plot_layout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _buffers(layout: GdnBackwardLayout) -> tuple[NDArray[np.float32], NDArray[np.float64]]:
    rng = np.random.default_rng(0)
    expected = rng.standard_normal(layout.total_elems)
    return expected.astype(np.float32), expected


def _panels(fig: Figure) -> dict[str, Any]:
    """The heatmap panels by gradient name (colour bars have no image)."""
    return {ax.get_title().split()[0]: ax for ax in fig.axes if ax.images}


def _suptitle(fig: Figure) -> str:
    (title,) = fig.texts  # Figure.get_suptitle needs matplotlib 3.8
    return title.get_text()


def _outlined(ax: Any) -> set[frozenset[tuple[float, float]]]:
    """The unit edges of the out-of-tolerance outline drawn on ``ax``."""
    lines = [c for c in ax.collections if isinstance(c, LineCollection)]
    outline = [c for c in lines if c.get_label() == "out of tolerance"]
    if not outline:
        return set()
    (collection,) = outline
    return {frozenset(map(tuple, np.asarray(seg).tolist())) for seg in collection.get_segments()}


def _border(cells: set[tuple[int, int]]) -> set[frozenset[tuple[float, float]]]:
    """The edges between a cell of ``cells`` (row, column) and a cell outside it."""
    edges: set[frozenset[tuple[float, float]]] = set()
    for r, c in cells:
        top, bottom, left, right = r - 0.5, r + 0.5, c - 0.5, c + 0.5
        sides = {
            (r - 1, c): ((left, top), (right, top)),
            (r + 1, c): ((left, bottom), (right, bottom)),
            (r, c - 1): ((left, top), (left, bottom)),
            (r, c + 1): ((right, top), (right, bottom)),
        }
        edges |= {frozenset(edge) for cell, edge in sides.items() if cell not in cells}
    return edges


# -- the return type: a Figure that shows itself -------------------------------------------


@pytest.mark.slow
def test_both_functions_return_a_picture_that_ipython_shows_as_png() -> None:
    formatters = pytest.importorskip("IPython.core.formatters")
    layout = GdnBackwardLayout(1, 4, 2, 4)
    flat = np.zeros(layout.total_elems)
    result = compare(flat, flat, layout)
    pictures = [plot_layout(layout), plot_errors(result), layout.plot(), result.plot()]
    for picture in pictures:
        assert type(picture) is Picture
        assert isinstance(picture, Figure)
        data, _ = formatters.DisplayFormatter().format(picture)
        assert _png_size(data["image/png"]) == (
            round(picture.get_figwidth() * 100),
            round(picture.get_figheight() * 100),
        )


@pytest.mark.slow
def test_pictures_need_no_pyplot_and_no_gui() -> None:
    # A fresh interpreter whose configured backend is a GUI one that is not installed:
    # drawing, saving and the notebook hook never import pyplot or start that backend.
    code = (
        "import sys, io, numpy as np\n"
        "from gdn_layout import GdnBackwardLayout, compare\n"
        "layout = GdnBackwardLayout(1, 4, 2, 4)\n"
        "flat = np.zeros(layout.total_elems)\n"
        "compare(flat, flat + 1, layout).plot(path=io.BytesIO())\n"
        "layout.plot()._repr_png_()\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
        "assert not [m for m in sys.modules if 'qt' in m.lower()], 'a GUI was started'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DISPLAY"} | {"MPLBACKEND": "QtAgg"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr


# -- plot_layout -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dims", "last"), [((2, 64, 4, 16), "24,000"), ((4, 4096, 32, 128), "180,000,000")]
)
def test_plot_layout_draws_each_segment_with_whole_offsets(
    tmp_path: Path, dims: tuple[int, int, int, int], last: str
) -> None:
    layout = GdnBackwardLayout(*dims, carry_state=True)
    fig = plot_layout(layout, path=tmp_path / "layout.png")
    assert _png_size((tmp_path / "layout.png").read_bytes()) == (800, 180)
    (ax,) = fig.axes
    for bar, seg in zip(ax.patches, layout.segments(), strict=True):
        assert (bar.get_x(), bar.get_width()) == (seg.offset, seg.length)  # type: ignore[attr-defined]
    # Wide segments are labelled on the bar, narrow ones in the key above it.
    legend = ax.get_legend()
    keyed = [] if legend is None else [t.get_text() for t in legend.get_texts()]
    labels = [t.get_text().replace("\n", " ") for t in ax.texts] + keyed
    assert sorted(labels) == sorted(f"{seg.name} {seg.length}" for seg in layout.segments())
    low, high = ax.get_xlim()
    shown = [t for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    assert all(float(t.get_position()[0]).is_integer() for t in shown)
    assert shown[-1].get_text() == last
    assert ax.xaxis.get_offset_text().get_text() == ""


def test_plot_layout_empty_and_saved(tmp_path: Path) -> None:
    fig = plot_layout(GdnBackwardLayout(1, 0, 2, 4))
    assert "empty" in fig.axes[0].texts[0].get_text()
    path = tmp_path / "layout.png"
    assert plot_layout(GdnBackwardLayout(1, 2, 2, 4, gate_per_channel=True), path=path) is not None
    assert _png_size(path.read_bytes()) == (800, 180)
    assert [p.name for p in tmp_path.iterdir()] == ["layout.png"]  # no temporary left


# -- plot_errors: where the errors are ----------------------------------------------------


@pytest.mark.slow
def test_plot_errors_heatmap_locates_the_error(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(2, 24, 4, 8, gate_per_channel=True, carry_state=True)
    actual, expected = _buffers(layout)
    grads = unpack(actual, layout)
    grads.dk[1, 17, 3, 5] += 0.5
    grads.dbeta[0, 6, 1] -= 0.25
    assert grads.dstate is not None
    grads.dstate[0, 2, 5, 1] += 0.5
    path = tmp_path / "errors.png"
    fig = plot_errors(compare(actual, expected, layout), path=path, only_failed=False)
    assert _png_size(path.read_bytes()) == (3 * 420, 2 * 300 + 30)
    panels = _panels(fig)
    assert list(panels) == list(layout.names)

    def peak(name: str) -> tuple[int, int]:  # (h, s), or (h, key row i) for dstate
        data = np.ma.filled(panels[name].images[0].get_array(), -np.inf)
        row, col = np.unravel_index(int(np.argmax(data)), data.shape)
        return int(row), int(col)

    assert panels["dk"].images[0].get_array().shape == (4, 24)
    assert panels["dstate"].images[0].get_array().shape == (4, 8)
    assert (peak("dk"), peak("dbeta"), peak("dstate")) == ((3, 17), (1, 6), (2, 5))
    # float32 against float64: judged by the calibrated criterion, whose verdict has a line.
    dk_title = panels["dk"].get_title().splitlines()
    assert dk_title[0] == "dk FAIL: 1 of 1536 out, worst [1, 17, 3, 5]"
    assert re.fullmatch(rf"error/floor \S+ > {K['float32']:g}", dk_title[1])
    assert dk_title[2] == "max |a-e| over b, n"
    assert panels["dq"].get_title().startswith("dq ok: max |a-e| ")
    for name, over in (("dbeta", "b"), ("dstate", "b, j"), ("dg", "b, n")):
        assert panels[name].get_title().endswith(f"\nmax |a-e| over {over}")


def _marked(shape: tuple[int, int, int, int]) -> tuple[Comparison, NDArray[np.float64]]:
    """dk with three cells out of tolerance, one with a small error that is within it."""
    layout = GdnBackwardLayout(*shape)
    expected = np.zeros(layout.total_elems)
    actual = expected.copy()
    dk = unpack(actual, layout).dk
    dk[0, 1, 0, 0] = 1.0
    dk[0, 2, 0, 1] = 1.0  # next to (h, s) = (0, 1): one region of two cells
    dk[1, 4, 2, 0] = 1.0  # another batch element
    dk[0, 5, 1, 0] = 1e-4  # within atol: not outlined, though it colours its cell
    return compare(actual, expected, layout, rtol=0.0, atol=1e-3), actual


def test_out_of_tolerance_cells_are_outlined_exactly() -> None:
    result, _ = _marked((2, 8, 3, 2))
    np.testing.assert_array_equal(result["dk"].mismatch_map.sum(axis=(1, 2)), [2, 1])
    assert result["dk"].mismatch_map[0, 2, 0] == 1  # [b, s, h]
    fig = plot_errors(result)
    assert list(_panels(fig)) == ["dk"]
    dk = _panels(fig)["dk"]
    # (row h, column s): the two cells at b=0 merge into one region, plus b=1's cell.
    assert _outlined(dk) == _border({(0, 1), (0, 2), (2, 4)})
    assert len(_outlined(dk)) == 6 + 4
    one = _panels(plot_errors(result, batch=1))["dk"]
    assert _outlined(one) == _border({(2, 4)})
    zero = _panels(plot_errors(result, batch=0))["dk"]
    assert _outlined(zero) == _border({(0, 1), (0, 2)})
    assert zero.images[0].get_array()[1, 5] == pytest.approx(1e-4)
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["out of tolerance"]


@pytest.mark.slow
def test_rms_judged_gradients_are_not_outlined() -> None:
    result, actual = _marked((2, 8, 3, 2))
    expected = np.zeros_like(actual)
    rms = compare(actual, expected + 1.0, result.layout, max_rms_ratio=10.0)
    panels = _panels(plot_errors(rms, only_failed=False))
    assert all(not _outlined(ax) for ax in panels.values())
    # Every element is off, but the RMS criterion alone counts only non-finite mismatches.
    assert rms["dk"].mismatches == int(rms["dk"].mismatch_map.sum()) == 0
    assert panels["dk"].get_title().startswith("dk ok: max |a-e| ")
    unpack(actual, rms.layout).dv[1, 3, 2, 0] = np.nan
    strict = compare(actual, expected + 1.0, rms.layout, max_rms_ratio=0.5)
    panels = _panels(plot_errors(strict, names=["dk", "dv"]))
    assert [ax.get_title().splitlines()[0] for ax in panels.values()] == [
        "dk FAIL: rms ratio 0.984 > 0.5",
        "dv FAIL: 1 NaN/Inf mismatch",
    ]
    assert all(not _outlined(ax) for ax in panels.values())


@pytest.mark.slow
def test_nonfinite_cells_are_filled_and_marked_with_a_legend() -> None:
    layout = GdnBackwardLayout(2, 8, 2, 4, carry_state=True)
    actual, expected = _buffers(layout)
    grads = unpack(actual, layout)
    grads.dv[1, 5, 1, 2] = np.nan  # only in the second batch element
    assert grads.dstate is not None
    grads.dstate[0, 1, 3, 0] = np.inf
    result = compare(actual, expected, layout)
    fig = plot_errors(result)
    panels = _panels(fig)
    assert list(panels) == ["dv", "dstate"]
    for name, cell in (("dv", (1, 5)), ("dstate", (1, 3))):
        ax = panels[name]
        image = ax.images[0]
        mask = np.ma.getmaskarray(image.get_array())
        assert list(zip(*np.nonzero(mask), strict=True)) == [cell]
        # Drawn in the colour map's "bad" colour, which the colour map itself never uses.
        cmap = image.get_cmap()
        bad = np.asarray(cmap.get_bad())
        assert not np.isclose(cmap(np.linspace(0, 1, 256)), bad).all(axis=1).any()
        (squares,) = [c for c in ax.collections if isinstance(c, PathCollection)]
        assert np.asarray(squares.get_offsets()).tolist() == [[cell[1], cell[0]]]  # (x = s, y = h)
        assert not _outlined(ax)  # the fill marks it, an outline would hide a thin cell
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["NaN or Inf mismatch"]
    # Only b=1 holds the NaN: it is not in b=0's picture.
    zero = _panels(plot_errors(result, batch=0, names=["dv"]))["dv"]
    assert not np.ma.getmaskarray(zero.images[0].get_array()).any()
    assert zero.get_title().endswith("\nmax |a-e| over n")


# -- plot_errors: which panels, batch, chunk ------------------------------------------------


@pytest.mark.slow
def test_panels_failing_by_default_all_when_asked_or_passed() -> None:
    result, _ = _marked((2, 8, 3, 2))
    assert list(_panels(plot_errors(result))) == ["dk"]
    assert list(_panels(plot_errors(result, only_failed=False))) == list(result.layout.names)
    assert list(_panels(plot_errors(result, names=["dq", "dk"]))) == ["dq", "dk"]
    assert list(_panels(plot_errors(result, names=["dq", "dk"], only_failed=True))) == ["dk"]
    assert list(_panels(plot_errors(result, names=["dq"], only_failed=True))) == ["dq"]
    flat = np.zeros(result.layout.total_elems)
    passed = compare(flat, flat, result.layout)
    fig = plot_errors(passed, only_failed=True)
    assert list(_panels(fig)) == list(result.layout.names)
    assert _suptitle(fig).startswith("compare passed\n")
    assert not fig.legends


def test_chunk_grid_and_ticks_on_chunk_multiples() -> None:
    layout = GdnBackwardLayout(1, 64, 2, 2, carry_state=True)
    actual, expected = _buffers(layout)
    unpack(actual, layout).dq[0, 40:] += 1.0
    assert unpack(actual, layout).dstate is not None
    unpack(actual, layout).dstate[0, 1, 1, 1] += 1.0  # type: ignore[index]
    fig = plot_errors(compare(actual, expected, layout), chunk=16)
    panels = _panels(fig)
    dq, dstate = panels["dq"], panels["dstate"]
    (grid,) = [c for c in dq.collections if c.get_label() == "chunk boundary (every 16)"]
    xs = sorted({float(seg[0][0]) for seg in grid.get_segments()})
    assert xs == [15.5, 31.5, 47.5]
    assert dq.get_xticks().tolist() == [0, 16, 32, 48]
    # dstate has no sequence axis: no chunk lines, ticks on every key row.
    assert [c.get_label() for c in dstate.collections] == ["out of tolerance"]
    assert dstate.get_xticks().tolist() == [0, 1]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    # dq wrong from step 40 on: its boundary finding is drawn too.
    assert labels == [
        "chunk boundary (every 16)",
        "out of tolerance",
        "boundary finding",
    ]
    # A chunk at least as long as the sequence draws no line.
    wide = _panels(plot_errors(compare(actual, expected, layout), names=["dq"], chunk=64))
    assert not [c for c in wide["dq"].collections if c.get_label().startswith("chunk")]


# -- empty, identical, errors ---------------------------------------------------------------


@pytest.mark.slow
def test_plot_errors_identical_and_empty() -> None:
    layout = GdnBackwardLayout(1, 4, 2, 4)
    flat = np.zeros(layout.total_elems)
    fig = plot_errors(compare(flat, flat, layout))  # all-zero errors: no log scale possible
    assert len(_panels(fig)) == 5
    empty = GdnBackwardLayout(1, 0, 2, 4)
    fig = plot_errors(compare(np.zeros(0), np.zeros(0), empty))
    assert all("empty" in ax.texts[0].get_text() for ax in fig.axes)
    no_batch = GdnBackwardLayout(0, 3, 2, 4)
    fig = plot_errors(compare(np.zeros(0), np.zeros(0), no_batch))
    assert len(_panels(fig)) == 5


def test_plot_errors_argument_errors() -> None:
    layout = GdnBackwardLayout(2, 4, 2, 4)
    actual, expected = _buffers(layout)
    result = compare(actual, expected, layout)
    with pytest.raises(TypeError, match="comparison must be a Comparison from compare\\(\\), got"):
        plot_errors(actual)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"names must be a non-empty selection .* got \['dx'\]"):
        plot_errors(result, names=["dx"])
    with pytest.raises(ValueError, match=r"batch must be None or an index 0 <= batch < B = 2"):
        plot_errors(result, batch=2)
    with pytest.raises(ValueError, match=r"got -1"):
        plot_errors(result, batch=-1)
    with pytest.raises(TypeError, match="batch must be None or an int, got bool"):
        plot_errors(result, batch=True)
    with pytest.raises(TypeError, match="batch must be None or an int, got float"):
        plot_errors(result, batch=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk must be None or at least 1, got 0"):
        plot_errors(result, chunk=0)
    with pytest.raises(TypeError, match="chunk must be None or an int, got float"):
        plot_errors(result, chunk=16.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layout must be a GdnBackwardLayout"):
        plot_layout(None)  # type: ignore[arg-type]
    assert _panels(plot_errors(result, batch=np.int64(1), chunk=np.int32(2)))


EXTRA = re.escape("pip install 'gdn-layout[plot]' (from a clone: pip install '.[plot]')")


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import raise ImportError, as if not installed.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "gdn_layout._picture", raising=False)
    layout = GdnBackwardLayout(1, 2, 1, 2)
    with pytest.raises(ImportError, match=EXTRA):
        plot_layout(layout)
    with pytest.raises(ImportError, match=EXTRA):
        layout.plot()
    flat = np.zeros(layout.total_elems)
    with pytest.raises(ImportError, match=EXTRA) as info:
        compare(flat, flat, layout).plot()
    assert isinstance(info.value.__cause__, ImportError)
    import gdn_layout.plot as plot

    with pytest.raises(ImportError, match=EXTRA):
        _ = plot.Picture
    monkeypatch.undo()
    assert plot.Picture is Picture
    with pytest.raises(AttributeError, match="no attribute 'Figure'"):
        _ = plot.Figure  # type: ignore[attr-defined]


@pytest.mark.slow
def test_readme_picture_script(tmp_path: Path) -> None:
    script = runpy.run_path(str(ROOT / "docs" / "make_figures.py"), run_name="make_figures")
    paths = script["main"](tmp_path)
    sizes = {"heatmap.png": (1260, 330), "ratio.png": (840, 330), "transpose.png": (420, 330)}
    assert paths == [tmp_path / name for name in sizes]
    readme = (ROOT / "README.md").read_text()
    for path, size in zip(paths, sizes.values(), strict=True):
        assert _png_size(path.read_bytes()) == size
        assert _png_size((ROOT / "docs" / path.name).read_bytes()) == size
        assert f"](docs/{path.name})" in readme


def test_a_state_s_panel_is_over_its_chunks_or_key_rows() -> None:
    from gdn_layout.check._records import Comparison as Record
    from gdn_layout.generate import make_fixture
    from gdn_layout.reference import chunk_states
    from gdn_layout.suites import compare_states

    fixture = make_fixture(GdnBackwardLayout(2, 40, 2, 4, carry_state=True), states=16)
    h, _, final = chunk_states(*fixture.inputs, chunk=16, dtype=np.float32)
    h[1, 1:] *= 2
    for name, tensor, across in (("h", h, "chunk c"), ("final_state", final, "key row i")):
        result = compare_states(tensor, fixture, name)
        fig = plot_errors(Record(fixture.layout, (result,)), chunk=8)
        (panel,) = _panels(fig).values()
        assert panel.get_xlabel() == across
        # chunk lines fall between sequence positions: none on chunks or key rows
        assert not [c for c in panel.collections if "chunk boundary" in str(c.get_label())]
        assert panel.get_xticks().tolist() == list(range(tensor.shape[1 if name == "h" else 2]))

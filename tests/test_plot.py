"""plot_layout and plot_errors render headless PNGs; the heatmaps put errors where they are."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

pytest.importorskip("matplotlib")

import matplotlib

matplotlib.use("Agg")

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.compare import compare
from gdn_layout.plot import plot_errors, plot_layout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _buffers(layout: GdnBackwardLayout) -> tuple[NDArray[np.float32], NDArray[np.float64]]:
    rng = np.random.default_rng(0)
    expected = rng.standard_normal(layout.total_elems)
    return expected.astype(np.float32), expected


@pytest.mark.parametrize("carry", [False, True])
def test_plot_layout_png(tmp_path: Path, carry: bool) -> None:
    layout = GdnBackwardLayout(2, 64, 4, 16, carry_state=carry)
    path = tmp_path / "layout.png"
    ax = plot_layout(layout, path=path)
    assert _png_size(path) == (800, 180)
    assert path.stat().st_size > 5000
    bars = ax.patches
    assert len(bars) == len(layout.names)
    for bar, seg in zip(bars, layout.segments(), strict=True):
        assert bar.get_x() == seg.offset  # type: ignore[attr-defined]
        assert bar.get_width() == seg.length  # type: ignore[attr-defined]
    # Wide segments are labelled on the bar, narrow ones in the key above it.
    legend = ax.get_legend()
    keyed = [] if legend is None else [t.get_text() for t in legend.get_texts()]
    labels = [t.get_text().replace("\n", " ") for t in ax.texts] + keyed
    assert sorted(labels) == sorted(f"{seg.name} {seg.length}" for seg in layout.segments())


def test_plot_layout_on_given_axes_and_empty(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4, 2), dpi=50)
    ax = fig.add_subplot()
    assert plot_layout(GdnBackwardLayout(1, 0, 2, 4), ax) is ax
    assert "empty" in ax.texts[0].get_text()
    path = tmp_path / "given.png"
    plot_layout(GdnBackwardLayout(1, 2, 2, 4, gate_per_channel=True), ax, path=path)
    assert _png_size(path) == (200, 100)


@pytest.mark.parametrize(("per_channel", "carry"), [(False, False), (True, True)])
def test_plot_errors_heatmap_locates_the_error(
    tmp_path: Path, per_channel: bool, carry: bool
) -> None:
    layout = GdnBackwardLayout(2, 24, 4, 8, gate_per_channel=per_channel, carry_state=carry)
    actual, expected = _buffers(layout)
    grads = unpack(actual, layout)
    grads.dk[1, 17, 3, 5] += 0.5
    grads.dbeta[0, 6, 1] -= 0.25
    if carry:
        assert grads.dstate is not None
        grads.dstate[0, 2, 5, 1] += 0.5
    path = tmp_path / "errors.png"
    # One case draws every panel; the other only those with an injected error, to stay fast.
    names = layout.names if carry else ("dk", "dbeta")
    fig = plot_errors(compare(actual, expected, layout), path=path, names=names)
    panels = len(names)
    rows = -(-panels // 3)
    assert _png_size(path) == (min(3, panels) * 420, rows * 300)
    assert path.stat().st_size > 10000
    images = {ax.get_title().split()[0]: ax.images[0] for ax in fig.axes if ax.images}
    assert set(images) == set(names)

    def peak(name: str) -> tuple[int, int]:
        data = np.ma.filled(images[name].get_array(), -np.inf)  # type: ignore[arg-type]
        row, col = np.unravel_index(int(np.argmax(data)), data.shape)
        return int(row), int(col)

    # Heads down, sequence position across: (h, s).
    assert images["dk"].get_array().shape == (4, 24)  # type: ignore[union-attr]
    assert peak("dk") == (3, 17)
    assert peak("dbeta") == (1, 6)
    if carry:
        assert images["dstate"].get_array().shape == (4, 8)  # type: ignore[union-attr]
        assert peak("dstate") == (2, 5)  # (h, key row i)
    titles = {ax.get_title() for ax in fig.axes}
    assert any(t.startswith("dk FAIL") for t in titles)
    assert any(t.startswith("dbeta FAIL") for t in titles)
    if carry:
        assert any(t.startswith("dq ok") for t in titles)


def test_plot_errors_from_comparison_names_and_nonfinite(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(1, 8, 2, 4)
    actual, expected = _buffers(layout)
    unpack(actual, layout).dv[0, 5, 1, 2] = np.nan
    result = compare(actual, expected, layout)
    fig = plot_errors(result, names=["dv"], log=False)
    (ax,) = [ax for ax in fig.axes if ax.images]
    image = ax.images[0].get_array()
    assert image is not None
    assert bool(np.ma.getmaskarray(image)[1, 5])  # the NaN is drawn in the "bad" colour
    assert "non-finite" in ax.get_title()
    assert fig.get_size_inches().tolist() == [4.2, 3.0]


def test_plot_errors_identical_and_empty() -> None:
    layout = GdnBackwardLayout(1, 4, 2, 4)
    flat = np.zeros(layout.total_elems)
    fig = plot_errors(compare(flat, flat, layout))  # all-zero errors: no log scale possible
    assert len([ax for ax in fig.axes if ax.images]) == 5
    empty = GdnBackwardLayout(1, 0, 2, 4)
    fig = plot_errors(compare(np.zeros(0), np.zeros(0), empty))
    assert all("empty" in ax.texts[0].get_text() for ax in fig.axes)


def test_plot_errors_argument_errors() -> None:
    layout = GdnBackwardLayout(1, 4, 2, 4)
    actual, expected = _buffers(layout)
    result = compare(actual, expected, layout)
    with pytest.raises(TypeError, match="comparison must be a Comparison from compare\\(\\), got"):
        plot_errors(actual)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"names must be a non-empty selection .* got \['dx'\]"):
        plot_errors(result, names=["dx"])
    with pytest.raises(TypeError, match="layout must be a GdnBackwardLayout"):
        plot_layout(None)  # type: ignore[arg-type]


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import raise ImportError, as if not installed.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    layout = GdnBackwardLayout(1, 2, 1, 2)
    with pytest.raises(ImportError, match=r"pip install gdn-layout\[plot\]"):
        plot_layout(layout)
    flat = np.zeros(layout.total_elems)
    with pytest.raises(ImportError, match=r"pip install gdn-layout\[plot\]") as info:
        plot_errors(compare(flat, flat, layout))
    assert isinstance(info.value.__cause__, ImportError)

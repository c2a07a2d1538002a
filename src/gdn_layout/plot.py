"""Pictures of a packed layout and of a comparison's errors; needs ``gdn-layout[plot]``.

matplotlib is imported inside the functions, so importing this module never needs it. Only the
object-oriented API is used (:class:`matplotlib.figure.Figure`, never pyplot), so nothing
depends on a GUI backend and nothing is ever shown: save the figure, or let a notebook
display the returned object.

>>> import numpy as np
>>> from gdn_layout import GdnBackwardLayout, unpack
>>> from gdn_layout.compare import compare
>>> layout = GdnBackwardLayout(batch=1, seq=16, heads=4, state_size=8)
>>> expected = np.ones(layout.total_elems)
>>> actual = expected.copy()
>>> unpack(actual, layout).dk[0, 8:, 2, :] += 1e-3  # a head-indexing bug after a chunk boundary
>>> fig = plot_errors(compare(actual, expected, layout))
>>> image = fig.axes[1].images[0].get_array()  # dk, heads down, sequence across
>>> image.shape, bool(image[2, 8:].min() > image[:2].max())
((4, 16), True)
>>> plot_layout(layout).get_title()
'B=1 S=16 H=4 N=8, per-head gate, no state; float32'
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import DTypeLike

from ._checks import not_a_layout, require_matplotlib
from ._dtypes import resolve
from ._tables import fmt_float
from .compare import Comparison
from .layout import GdnBackwardLayout, layout_caption

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_errors", "plot_layout"]

#: Colour of a non-finite mismatch in an error map.
_BAD_COLOUR = "magenta"
#: Spans narrower than this fraction of the buffer get their label above the bar.
_NARROW = 0.07


def plot_layout(
    layout: GdnBackwardLayout,
    ax: Axes | None = None,
    *,
    dtype: DTypeLike = np.float32,
    path: str | os.PathLike[str] | None = None,
) -> Axes:
    """Draw the packed buffer as one bar with a span per gradient, proportional to its length.

    Draws on ``ax`` when given, else on a new 8x1.8-inch, 100-dpi Figure (800x180 pixels as
    a PNG). Saves the figure to ``path`` when given, in the format its suffix names (PNG, SVG,
    PDF, ...). Returns the Axes; its figure is
    ``ax.figure``.
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "plot_layout")
    require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    if ax is None:
        ax = Figure(figsize=(8, 1.8), dpi=100, layout="constrained").add_subplot()
    total = layout.total_elems
    colours = colormaps["tab10"]
    ax.set_title(f"{layout_caption(layout)}; {resolve(dtype, 'plot_layout: dtype').name}")
    ax.set_yticks([])
    ax.set_ylim(-0.6, 1.3)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    if total == 0:
        ax.set_xlim(0, 1)
        ax.text(0.5, 0.0, "empty buffer: every gradient has length 0", ha="center", va="center")
        return _saved(ax, path)
    ax.set_xlim(0, total)
    ax.set_xlabel(f"element offset (total {total}, {layout.nbytes(dtype)} bytes)")
    narrow = []
    for i, seg in enumerate(layout.segments()):
        colour = colours(i % 10)
        bar = ax.barh(0, seg.length, left=seg.offset, height=0.8, color=colour, edgecolor="white")
        if seg.length >= _NARROW * total:
            ax.text(
                seg.offset + seg.length / 2,
                0,
                f"{seg.name}\n{seg.length}",
                ha="center",
                va="center",
                fontsize=8,
                color="white",
            )
        else:
            # Too narrow to hold its label: named in a key above the bar instead.
            bar.set_label(f"{seg.name} {seg.length}")
            narrow.append(bar)
    if narrow:
        ax.legend(
            handles=narrow,
            loc="lower right",
            bbox_to_anchor=(1.0, 0.72),
            ncols=len(narrow),
            fontsize=7,
            frameon=False,
            handlelength=1.0,
        )
    return _saved(ax, path)


def plot_errors(
    comparison: Comparison,
    *,
    names: tuple[str, ...] | list[str] | None = None,
    log: bool = True,
    path: str | os.PathLike[str] | None = None,
) -> Figure:
    """A heatmap per gradient of the largest ``|a - e|`` over (sequence position, head).

    Takes the :class:`~gdn_layout.compare.Comparison` that :func:`~gdn_layout.compare.compare`
    returns. Each panel shows its gradient's error map transposed: heads down, sequence
    position across (key row ``i`` across for ``dstate``), so a chunk-boundary bug shows as a
    vertical edge and a head-indexing bug as a stripe. ``log`` colours on a log scale (zero
    error gets the lowest colour); a non-finite mismatch is magenta. ``names`` picks the panels
    (default all). Three panels a row, 4.2x3 inches each at 100 dpi. Saves to ``path`` when
    given, in the format its suffix names (PNG without one).
    """
    if not isinstance(comparison, Comparison):
        raise TypeError(
            "plot_errors: comparison must be a Comparison from compare(), "
            f"got {type(comparison).__name__}"
        )
    result = comparison
    chosen = list(result.names if names is None else names)
    unknown = [n for n in chosen if n not in result.names]
    if unknown or not chosen:
        raise ValueError(
            f"plot_errors: names must be a non-empty selection of {', '.join(result.names)}; "
            f"got {chosen}"
        )
    require_matplotlib()
    from matplotlib.figure import Figure

    ncols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / ncols)
    width, height = 4.2 * ncols, 3.0 * nrows
    fig = Figure(figsize=(width, height), dpi=100)
    verdict = "passed" if result.passed else f"FAILED ({', '.join(result.failed)})"
    fig.suptitle(f"compare {verdict}\n{layout_caption(result.layout)}", fontsize=9)
    # Fixed margins in inches rather than a layout engine: measuring every tick label to
    # lay out six panels with colour bars costs seconds.
    fig.subplots_adjust(
        left=0.6 / width,
        right=1 - 0.45 / width,
        bottom=0.5 / height,
        top=1 - 0.75 / height,
        wspace=0.5,
        hspace=0.6,
    )
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, name in zip(axes, chosen, strict=False):
        _heatmap(fig, ax, result, name, log)
    for ax in axes[len(chosen) :]:
        fig.delaxes(ax)
    if path is not None:
        fig.savefig(path)
    return fig


def _heatmap(fig: Figure, ax: Axes, result: Comparison, name: str, log: bool) -> None:
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.ticker import NullFormatter

    grad = result[name]
    data = grad.error_map.T  # heads down, sequence (or key row) across
    verdict = "ok" if grad.passed else "FAIL"
    title = f"{name} {verdict}: max |a-e| {fmt_float(grad.max_abs_error)}"
    if grad.nonfinite_mismatches:
        title += f", {grad.nonfinite_mismatches} non-finite ({_BAD_COLOUR})"
    ax.set_title(title, fontsize=9)
    across, down = grad.error_map_bins
    ax.set_xlabel(
        ("key row i" if name == "dstate" else "sequence position s")
        + (f" / {across} (binned)" if across > 1 else "")
    )
    ax.set_ylabel("head h" + (f" / {down} (binned)" if down > 1 else ""))
    if data.size == 0:
        ax.text(0.5, 0.5, "empty", ha="center", va="center", transform=ax.transAxes)
        return
    finite = np.isfinite(data)
    positive = data[finite & (data > 0)]
    norm: Normalize
    if log and positive.size:
        high = float(positive.max())
        low = float(positive.min())
        # Two decades at least, so that the colour bar has labelled major ticks.
        low = min(low, high / 100)
        shown = np.where(finite, np.maximum(data, low), np.nan)
        norm = LogNorm(vmin=low, vmax=high)
    else:
        high = float(data[finite].max()) if finite.any() else 0.0
        shown = np.where(finite, data, np.nan)
        norm = Normalize(vmin=0.0, vmax=high if high > 0 else 1.0)
    cmap = colormaps["viridis"].with_extremes(bad=_BAD_COLOUR)
    image = ax.imshow(
        np.ma.masked_invalid(shown),
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        norm=norm,
    )
    bar = fig.colorbar(image, ax=ax, label="max |a-e|")
    bar.ax.yaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks crowd and are slow


def _saved(ax: Axes, path: str | os.PathLike[str] | None) -> Axes:
    if path is not None:
        figure: Any = ax.figure
        while getattr(figure, "figure", figure) is not figure:  # a SubFigure's root
            figure = figure.figure
        figure.savefig(path)
    return ax

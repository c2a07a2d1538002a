"""Pictures of a packed layout and of a comparison's errors (README.md, *In a notebook*);
needs ``gdn-layout[plot]``. matplotlib is imported only when drawing, never pyplot."""

from __future__ import annotations

import math
import operator
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np
from numpy.typing import DTypeLike, NDArray

from ._checks import not_a_layout, require_matplotlib
from ._dtypes import resolve
from .check import Comparison, GradComparison
from .layout import GdnBackwardLayout, layout_caption

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ._picture import Picture

__all__ = ["Picture", "plot_errors", "plot_layout"]

_BAD = "magenta"  # a NaN or Inf mismatch: a colour neither colour map uses
_OUT = "red"  # the outline of cells with an element out of tolerance
_NO_RATIO = "0.6"  # a ratio cell whose expected values are all zero
_FINDING = "boundary finding"  # dashed orange lines at the steps a boundary finding names
_MAX_MARKERS = 1000  # past this many non-finite cells, their fill alone marks them
_NARROW = 0.07  # a span narrower than this fraction of the buffer is named in the key
_PANEL, _DPI = (4.2, 3.0), 100  # inches of one heatmap panel; dots per inch of every picture
_KINDS = ("error", "signed", "ratio")
_WHAT = {"error": "max |a-e|", "signed": "a-e at the max |a-e|", "ratio": "<a,e>/<e,e>"}
_BAR = {"error": "max |a-e|", "signed": "a-e", "ratio": "<a,e>/<e,e>"}
_ACROSS = {"s": "sequence position s", "c": "chunk c", "i": "key row i"}


def __getattr__(name: str) -> Any:
    if name == "Picture":  # defined next to matplotlib's import, loaded on first use
        require_matplotlib()
        from ._picture import Picture

        return Picture
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plot_layout(
    layout: GdnBackwardLayout,
    *,
    dtype: DTypeLike = np.float32,
    path: str | os.PathLike[str] | None = None,
) -> Picture:
    """Draw the packed buffer as one bar with a span per gradient, proportional to its length;
    ``GdnBackwardLayout.plot()`` calls this. Saved to ``path`` too when given.

    >>> from gdn_layout import GdnBackwardLayout
    >>> plot_layout(GdnBackwardLayout(batch=1, seq=16, heads=4, state_size=8)).axes[0].get_title()
    'B=1 S=16 H=4 N=8, per-head gate, no state; float32'
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "plot_layout")
    require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.ticker import MaxNLocator, StrMethodFormatter

    from ._picture import Picture

    fig = Picture(figsize=(8, 1.8), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    total = layout.total_elems
    ax.set_title(f"{layout_caption(layout)}; {resolve(dtype, 'dtype').name}")
    ax.set_yticks([])
    ax.set_ylim(-0.6, 1.3)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    if total == 0:
        ax.set_xlim(0, 1)
        ax.text(0.5, 0.0, "empty buffer: every gradient has length 0", ha="center", va="center")
        return _saved(fig, path)
    ax.set_xlim(0, total)
    ax.set_xlabel(f"element offset (total {total}, {layout.nbytes(dtype)} bytes)")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=7, integer=True))
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))  # no "1e8" to read them by
    narrow = []
    for i, seg in enumerate(layout.segments()):
        colour = colormaps["tab10"](i)
        bar = ax.barh(0, seg.length, left=seg.offset, height=0.8, color=colour, edgecolor="white")
        if seg.length >= _NARROW * total:
            x = seg.offset + seg.length / 2
            ax.text(
                x,
                0,
                f"{seg.name}\n{seg.length}",
                ha="center",
                va="center",
                fontsize=8,
                color="white",
            )
        else:  # too narrow for its label: named in a key above the bar
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
    return _saved(fig, path)


def plot_errors(
    comparison: Comparison,
    *,
    names: tuple[str, ...] | list[str] | None = None,
    batch: SupportsIndex | None = None,
    only_failed: bool | None = None,
    chunk: SupportsIndex | None = None,
    kind: str = "error",
    path: str | os.PathLike[str] | None = None,
) -> Picture:
    """A heatmap per gradient of ``|a - e|`` over (head, sequence position), its errors marked
    (README.md, *In a notebook*); ``comparison.plot(...)`` calls this.

    Parameters
    ----------
    comparison : Comparison
        What :func:`~gdn_layout.compare` returned.
    names : sequence of str, optional
        The panels; by default every gradient, or the failing ones when some fail.
    batch : int, optional
        One batch element; by default the largest error over the batch.
    only_failed : bool, optional
        Overrides the default of ``names``: True the failing gradients, False all.
    chunk : int, optional
        A light line every ``chunk`` positions, ticks on its multiples.
    kind : {"error", "signed", "ratio"}
        ``|a - e|``; the signed ``a - e`` of largest magnitude; or ``<a, e> / <e, e>`` per cell,
        of a failing gradient (``dstate`` as one ``i x j`` tile per head).
    path : str or os.PathLike, optional
        Also saved there, in the format its suffix names.

    Returns
    -------
    Picture
        The figure, three panels a row; a TypeError or ValueError names a wrong argument.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout, compare, unpack
    >>> layout = GdnBackwardLayout(batch=2, seq=32, heads=2, state_size=4)
    >>> expected = np.zeros(layout.total_elems)
    >>> actual = expected.copy()
    >>> unpack(actual, layout).dq[1, 16:, 0, :] = np.nan  # b=1, head 0, the second chunk
    >>> fig = compare(actual, expected, layout).plot(batch=1, chunk=16)
    >>> [ax.get_title() for ax in fig.axes if ax.images]
    ['dq FAIL: 64 of 512 out, worst [1, 16, 0, 0]\\nerror/floor nan > 64\\nmax |a-e| over n']
    >>> [text.get_text() for text in fig.legends[0].get_texts()]
    ['chunk boundary (every 16)', 'NaN or Inf mismatch']
    """
    if not isinstance(comparison, Comparison):
        raise TypeError(
            "plot_errors: comparison must be a Comparison from compare(), "
            f"got {type(comparison).__name__}"
        )
    result = comparison
    chosen = list(result.names if names is None else names)
    if not chosen or any(n not in result.names for n in chosen):
        raise ValueError(
            f"plot_errors: names must be a non-empty selection of {', '.join(result.names)}; "
            f"got {chosen}"
        )
    batches = result.layout.batch
    batch, chunk = _index("batch", batch), _index("chunk", chunk)
    if batch is not None and not 0 <= batch < batches:
        raise ValueError(
            f"plot_errors: batch must be None or an index 0 <= batch < B = {batches}, got {batch}"
        )
    if chunk is not None and chunk < 1:
        raise ValueError(f"plot_errors: chunk must be None or at least 1, got {chunk}")
    if kind not in _KINDS:
        raise ValueError(
            f"plot_errors: kind must be one of {', '.join(map(repr, _KINDS))}, got {kind!r}"
        )
    if only_failed is None:
        only_failed = names is None and not result.passed
    failing = [n for n in chosen if not result[n].passed]
    if only_failed and failing:
        chosen = failing
    require_matplotlib()
    from ._picture import Picture

    ncols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / ncols)
    size = (_PANEL[0] * ncols, _PANEL[1] * nrows + 0.3)
    fig = Picture(figsize=size, dpi=_DPI, layout="constrained")
    verdict = "passed" if result.passed else f"FAILED ({', '.join(result.failed)})"
    shown = "" if batch is None else f"\nbatch element b={batch} of {batches}"
    fig.suptitle(f"compare {verdict}\n{layout_caption(result.layout)}{shown}", fontsize=9)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    marks: dict[str, Artist] = {}
    for ax, name in zip(axes, chosen, strict=False):
        grad = result[name]
        if kind != "error" and (grad.signed_error_map is None or grad.ratio_map is None):
            _no_map(ax, grad, kind)
        elif kind != "error" and name == "dstate":
            marks.update(_state_tiles(fig, ax, grad, kind))
        else:
            marks.update(_heatmap(fig, ax, grad, batch, chunk, kind))
        marks.update(_boundaries(ax, grad))
    for ax in axes[len(chosen) :]:
        fig.delaxes(ax)
    if marks:
        fig.legend(
            handles=list(marks.values()),
            labels=list(marks),
            loc="outside lower center",
            ncols=len(marks) if ncols > 1 else 1,
            fontsize=8,
            facecolor="0.85",  # grey, for the white chunk lines
            edgecolor="none",
        )
    return _saved(fig, path)


def _heatmap(
    fig: Figure,
    ax: Axes,
    grad: GradComparison,
    batch: int | None,
    chunk: int | None,
    kind: str,
) -> dict[str, Artist]:
    """One panel of ``kind`` over (head, position); the legend entries of its marks."""
    is_state = grad.name in ("dstate", "final_state")  # key rows across, no sequence axis
    across_axis = "i" if is_state else grad.axes[1]  # s, or the chunk c of h and dh
    if batch is None:
        errors, out = grad.error_map, grad.mismatch_map.sum(axis=0).T
    else:  # a binned batch keeps one map for batch_bins elements
        errors = grad.batch_error_map[batch // grad.batch_bins]
        out = grad.mismatch_map[batch // grad.batch_bins].T
    bad = ~np.isfinite(errors.T)  # a non-finite mismatch: inf in the error map
    data = errors.T if kind == "error" else _cause_cells(grad, batch, kind).T
    # The axes a cell reduces over: the gradient's own, less the map's two and the batch's.
    reduced = [a for a in grad.axes if a not in ("b", "h", across_axis)]
    if batch is None:
        reduced.insert(0, "b")
    elif grad.batch_bins > 1:
        first = batch // grad.batch_bins * grad.batch_bins
        last = min(first + grad.batch_bins, grad.shape[0]) - 1
        reduced.insert(0, f"b={first}..{last} (binned)")
    what = _WHAT[kind]
    over = f"{what} over {', '.join(reduced)}" if reduced else what.removeprefix("max ")
    ax.set_title(f"{grad.title()}\n{over}", fontsize=8)
    across_bin, down_bin = grad.error_map_bins  # a binned cell holds a block of positions
    ax.set_xlabel(_ACROSS[across_axis] + (f" / {across_bin} (binned)" if across_bin > 1 else ""))
    ax.set_ylabel("head h" + (f" / {down_bin} (binned)" if down_bin > 1 else ""))
    if data.size == 0:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(0.5, 0.5, "empty", ha="center", va="center", transform=ax.transAxes)
        return {}
    values, cmap, norm = _colours(data, kind)
    image = ax.imshow(
        np.ma.masked_invalid(values), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm
    )
    _colour_bar(fig, ax, image, data, kind)
    heads, across = data.shape
    if across_axis != "s":  # chunk lines fall between sequence positions only
        chunk = None
    _integer_ticks(ax, "x", across, None if across_bin > 1 else chunk)
    _integer_ticks(ax, "y", heads, None)
    marks: dict[str, Artist] = {}
    positions = across * across_bin  # at least S: a binned map's last cell may be partial
    # Drawn when at most one boundary falls in each cell, so that a binned map does not turn
    # white; a boundary at position p lies at p / across_bin - 0.5 in cells.
    if chunk is not None and across_bin <= chunk < positions:
        label = f"chunk boundary (every {chunk})"
        edges = np.arange(chunk, min(positions, grad.shape[1]), chunk) / across_bin - 0.5
        colour = "white" if kind == "error" else "black"  # seen on viridis and coolwarm
        marks[label] = ax.vlines(
            edges, -0.5, heads - 0.5, colors=colour, linewidths=0.8, alpha=0.6, label=label
        )
    # A non-finite cell is out of tolerance too, but its fill says more than an outline. A
    # gradient judged by the RMS ratio alone has no element counted out: no outline.
    if grad.criterion.counts_elements and (out[~bad] > 0).any():
        marks.update(_outline(ax, (out > 0) & ~bad))
    if kind == "ratio" and np.isnan(data).any():
        marks.update(_patch("expected all zero (no ratio)", _NO_RATIO))
    if bad.any():
        rows, cols = np.nonzero(bad)
        if rows.size <= _MAX_MARKERS:  # a square on each too: a cell may be under a pixel
            ax.scatter(cols, rows, s=20, marker="s", c=_BAD, edgecolors="black", lw=0.5)
        marks.update(_patch("NaN or Inf mismatch", _BAD))
    return marks


def _cause_cells(grad: GradComparison, batch: int | None, kind: str) -> NDArray[np.float64]:
    """A failing gradient's signed-error or ratio cells, ``[S, H]`` (or ``[N, H]``): of one
    batch element, or over the batch (the largest error's sign; the median ratio)."""
    maps = grad.signed_error_map if kind == "signed" else grad.ratio_map
    assert maps is not None  # drawn only for a gradient that failed
    if batch is not None:
        cells: NDArray[np.float64] = maps[batch // grad.batch_bins]
        return cells
    if kind == "ratio":
        with warnings.catch_warnings():  # a cell with no ratio in any batch element stays NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            median: NDArray[np.float64] = np.nanmedian(maps, axis=0)
        return median
    size = np.where(np.isnan(maps), np.inf, np.abs(maps))
    largest: NDArray[np.float64] = np.take_along_axis(maps, size.argmax(axis=0)[None], axis=0)[0]
    return largest


def _colours(data: NDArray[np.float64], kind: str) -> tuple[NDArray[np.float64], Any, Any]:
    """The values to draw, the colour map and the norm: viridis on a log scale for an error;
    coolwarm about 0 (symmetric-log) for a signed error, about 1 for a ratio."""
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm, Normalize, SymLogNorm, TwoSlopeNorm

    finite = np.isfinite(data)
    values = np.where(finite, data, np.nan)
    norm: Normalize
    if kind == "error":
        cmap = colormaps["viridis"].with_extremes(bad=_BAD)
        positive = data[finite & (data > 0)]
        if not positive.size:  # no error at all: one colour
            return values, cmap, Normalize(0.0, 1.0)
        high = float(positive.max())
        low = min(float(positive.min()), high / 100)  # two decades: labelled major ticks
        return np.where(finite, np.maximum(data, low), np.nan), cmap, LogNorm(low, high)
    if kind == "signed":
        high = float(np.abs(data[finite]).max()) if finite.any() else 0.0
        high = high if high > 0 else 1.0
        norm = SymLogNorm(high / 1000, vmin=-high, vmax=high)
        return values, colormaps["coolwarm"].with_extremes(bad=_BAD), norm
    low, high = np.percentile(data[finite], (1, 99)) if finite.any() else (1.0, 1.0)
    norm = TwoSlopeNorm(1.0, vmin=min(float(low), 1 - 1e-3), vmax=max(float(high), 1 + 1e-3))
    return values, colormaps["coolwarm"].with_extremes(bad=_NO_RATIO), norm


def _colour_bar(fig: Figure, ax: Axes, image: Any, data: NDArray[np.float64], kind: str) -> None:
    """A colour bar, with arrows at a ratio's ends when values lie beyond its range."""
    from matplotlib.ticker import NullLocator

    norm, finite = image.norm, data[np.isfinite(data)]
    below = kind == "ratio" and bool(finite.size and finite.min() < norm.vmin)
    above = kind == "ratio" and bool(finite.size and finite.max() > norm.vmax)
    extend = {(True, True): "both", (True, False): "min", (False, True): "max"}
    bar = fig.colorbar(image, ax=ax, label=_BAR[kind], extend=extend.get((below, above), "neither"))
    bar.ax.yaxis.set_minor_locator(NullLocator())  # minor ticks crowd and are slow to lay out


def _state_tiles(fig: Figure, ax: Axes, grad: GradComparison, kind: str) -> dict[str, Artist]:
    """``dstate``'s signed error or ratio as one ``i x j`` tile per head (over the batch), in
    a near-square grid: a transpose is a pattern mirrored about each tile's diagonal."""
    maps = grad.signed_error_map if kind == "signed" else grad.ratio_map
    assert maps is not None
    heads, side = maps.shape[0], maps.shape[1]
    cols = math.ceil(math.sqrt(heads))
    rows = math.ceil(heads / cols)
    binned = " (binned)" if side < grad.shape[2] else ""
    ax.set_title(f"{grad.title()}\n{_WHAT[kind]} over b; a tile of i x j per head", fontsize=8)
    ax.set_xlabel(f"value column j, per head{binned}")
    ax.set_ylabel(f"key row i, per head{binned}")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlim(-0.5, cols * (side + 1) - 1.5)
    ax.set_ylim(rows * (side + 1) - 1.5, -0.5)
    if maps.size == 0:
        ax.text(0.5, 0.5, "empty", ha="center", va="center", transform=ax.transAxes)
        return {}
    values, cmap, norm = _colours(maps, kind)  # one scale for every head
    for h in range(heads):
        y0, x0 = (step * (side + 1) for step in divmod(h, cols))
        extent = (x0 - 0.5, x0 + side - 0.5, y0 + side - 0.5, y0 - 0.5)
        image = ax.imshow(
            np.ma.masked_invalid(values[h]),
            extent=extent,
            interpolation="nearest",
            cmap=cmap,
            norm=norm,
        )
        ax.text(x0, y0, f"h={h}", fontsize=6, va="top", ha="left", color="black")
    ax.set_aspect("auto")
    _colour_bar(fig, ax, image, maps, kind)
    if not np.isnan(maps).any():
        return {}
    if kind == "signed":
        return _patch("NaN or Inf mismatch", _BAD)
    return _patch("expected all zero (no ratio)", _NO_RATIO)


def _patch(label: str, colour: str) -> dict[str, Artist]:
    """A legend entry for the cells filled with ``colour``."""
    from matplotlib.patches import Patch

    return {label: Patch(facecolor=colour, edgecolor="black", linewidth=0.5, label=label)}


def _no_map(ax: Axes, grad: GradComparison, kind: str) -> None:
    """The panel of a passing gradient, which keeps no signed-error or ratio map."""
    ax.set_title(grad.title(), fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    text = f"passed: no {kind} map\n(kept for failing gradients)"
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=8)


def _boundaries(ax: Axes, grad: GradComparison) -> dict[str, Artist]:
    """The steps a ``boundary`` finding names, as dashed lines across the panel; none where
    the error only fades with the decay (no step where it starts or stops)."""
    if grad.name == "dstate" or not ax.images:
        return {}
    marks: dict[str, Artist] = {}
    bottom = ax.get_ylim()[0]  # below the last head
    for finding in grad.findings:
        step = finding.details.get("step")
        if finding.kind != "boundary" or not isinstance(step, int):
            continue
        edges = np.asarray([step]) / grad.error_map_bins[0] - 0.5
        marks[_FINDING] = ax.vlines(
            edges,
            -0.5,
            bottom,
            colors="darkorange",
            linewidths=1.2,
            linestyles="--",
            label=_FINDING,
        )
    return marks


def _index(what: str, value: SupportsIndex | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"plot_errors: {what} must be None or an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"plot_errors: {what} must be None or an int, got {type(value).__name__}"
        ) from None


def _integer_ticks(ax: Axes, which: str, n: int, chunk: int | None) -> None:
    """Ticks on whole positions only, every k-th one for the smallest k of 1, 2, 5, 10, 20,
    ... (times ``chunk``) that keeps the labels from crowding."""
    digits = len(str(max(n - 1, 0)))
    room = (9 if digits <= 2 else 7 if digits <= 3 else 5) if which == "x" else 8
    base = 1 if chunk is None or chunk >= n else chunk
    steps = (base * f * 10**e for e in range(len(str(n)) + 1) for f in (1, 2, 5))
    step = next(k for k in steps if -(-n // k) <= room)
    setter = ax.set_xticks if which == "x" else ax.set_yticks
    ticks = list(range(0, n, step))
    setter(ticks, labels=[str(t) for t in ticks])
    setter([], minor=True)


def _outline(ax: Axes, mask: NDArray[np.bool_]) -> dict[str, Artist]:
    """The border of the ``True`` cells of ``mask`` (rows down) as one line collection."""
    from matplotlib.collections import LineCollection

    padded = np.pad(mask, 1)
    # A horizontal edge lies between two rows that differ, a vertical one between two columns;
    # cell (r, c) spans r - 0.5 .. r + 0.5 down and c - 0.5 .. c + 0.5 across.
    rows, cols = np.nonzero(padded[1:, 1:-1] != padded[:-1, 1:-1])
    horizontal = np.stack([cols - 0.5, rows - 0.5, cols + 0.5, rows - 0.5], axis=-1)
    rows, cols = np.nonzero(padded[1:-1, 1:] != padded[1:-1, :-1])
    vertical = np.stack([cols - 0.5, rows - 0.5, cols - 0.5, rows + 0.5], axis=-1)
    segments = np.concatenate([horizontal, vertical]).reshape(-1, 2, 2)
    lines = LineCollection(list(segments), colors=_OUT, linewidths=1.2, label="out of tolerance")
    lines.set_zorder(3)  # over the axes' frame, which a cell on the border shares
    lines.set_clip_on(False)  # or the frame would clip a border cell's outline to half its width
    ax.add_collection(lines, autolim=False)
    return {"out of tolerance": lines}


def _saved(figure: Picture, path: str | os.PathLike[str] | None) -> Picture:
    """``figure`` after writing it to ``path``: whole or not at all when the suffix names a
    format, else as ``savefig`` does (a file object; a name it adds the default suffix to)."""
    if path is None:
        return figure
    suffix = Path(path).suffix.lower().lstrip(".") if isinstance(path, str | os.PathLike) else ""
    if suffix not in figure.canvas.get_supported_filetypes():
        figure.savefig(path)
        return figure
    from .files._atomic import atomic_write

    atomic_write(Path(path), lambda f: figure.savefig(f, format=suffix), overwrite=True)
    return figure
    suffix = Path(path).suffix.lower().lstrip(".") if isinstance(path, str | os.PathLike) else ""
    if suffix not in figure.canvas.get_supported_filetypes():
        figure.savefig(path)  # a file object; or a name savefig adds the default suffix to
        return figure
    temporary = Path(path).with_name(f".{Path(path).name}.tmp")
    try:
        figure.savefig(temporary, format=suffix)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return figure

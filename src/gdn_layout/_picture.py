"""The figure type the plots return; it imports matplotlib, so it is imported only once
matplotlib is known to be there."""

from __future__ import annotations

import io

from matplotlib.figure import Figure

__all__ = ["Picture"]


class Picture(Figure):
    """A matplotlib ``Figure`` that Jupyter displays as a PNG, with no magic (README.md, *In a
    notebook*): made without pyplot, so it opens no window and leaves no global state; its one
    addition is ``_repr_png_``, the hook IPython calls to show an object as an image.

    See Also
    --------
    plot.plot_errors : Returns one.
    plot.plot_layout : Returns one.
    """

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        return buffer.getvalue()

"""The figure type the plots return; imports matplotlib, so only :mod:`gdn_layout.plot`'s
functions import it, once matplotlib is known to be there."""

from __future__ import annotations

import io

from matplotlib.figure import Figure

__all__ = ["Picture"]


class Picture(Figure):
    """A :class:`matplotlib.figure.Figure` that Jupyter displays as a PNG, with no magic.

    What :func:`~gdn_layout.plot.plot_layout` and :func:`~gdn_layout.plot.plot_errors`
    return. It is made without pyplot, so it never opens a window, needs no GUI backend and
    leaves no global state behind; its one addition to Figure is ``_repr_png_``, the hook
    IPython calls to show an object as an image (as it calls ``_repr_html_`` for a table).
    With ``%matplotlib inline`` active, IPython's own Figure printer is used instead: the
    picture still appears, once. Everything else is a Figure's: ``savefig``, ``axes``, ...

    See Also
    --------
    plot.plot_errors : Returns one.
    plot.plot_layout : Returns one.
    """

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        return buffer.getvalue()

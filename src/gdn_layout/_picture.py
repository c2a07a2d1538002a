"""The figure the plots return; imported only once matplotlib is known to be there."""

from __future__ import annotations

import io

from matplotlib.figure import Figure

__all__ = ["Picture"]


class Picture(Figure):
    """A matplotlib ``Figure``, made without pyplot, that Jupyter shows as a PNG by its
    ``_repr_png_`` (README.md, *In a notebook*)."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        return buffer.getvalue()

"""The packed-gradient layout of RLX's ``GatedDeltaNetBackward``, in NumPy.

>>> import numpy as np
>>> import gdn_layout as gl
>>> layout = gl.GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=8)
>>> flat, grads = gl.zeros(layout)
>>> grads.dg.shape, layout.total_elems
((1, 4, 2), 208)
"""

from importlib.metadata import PackageNotFoundError, version

from .layout import GdnBackwardLayout, Segment
from .packing import GdnGrads, empty, pack, unpack, zeros

try:
    __version__ = version("gdn-layout")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "GdnBackwardLayout",
    "GdnGrads",
    "Segment",
    "__version__",
    "empty",
    "pack",
    "unpack",
    "zeros",
]

"""The packed-gradient layout of RLX's ``GatedDeltaNetBackward``, in NumPy.

The layout and its views (:class:`GdnBackwardLayout`, :func:`unpack`, :func:`pack`,
:func:`empty`, :func:`zeros`), the comparison of a kernel's packed gradient with a reference
(:func:`compare`, :func:`assert_close`) and fixture files (:func:`load_fixture`,
:func:`save_fixture`) are here; the float64 reference forward and backward are in
:mod:`gdn_layout.reference`, fixture generation in :mod:`gdn_layout.generate` (gathered with
the files in :mod:`gdn_layout.fixtures`), pictures in :mod:`gdn_layout.plot`.

>>> import numpy as np
>>> import gdn_layout as gl
>>> layout = gl.GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=8)
>>> flat, grads = gl.zeros(layout)
>>> grads.dg.shape, layout.total_elems
((1, 4, 2), 208)
"""

from ._version import __version__
from .compare import Comparison, GradComparison, assert_close, compare, error_map
from .fixtures import Fixture, FixtureError, load_fixture, save_fixture
from .generate import draw_inputs, make_fixture, write_suite
from .layout import GdnBackwardLayout, Segment
from .packing import GdnGrads, empty, pack, unpack, zeros
from .suites import Case, load_suite, verify_suite

__all__ = [
    "Case",
    "Comparison",
    "Fixture",
    "FixtureError",
    "GdnBackwardLayout",
    "GdnGrads",
    "GradComparison",
    "Segment",
    "__version__",
    "assert_close",
    "compare",
    "draw_inputs",
    "empty",
    "error_map",
    "load_fixture",
    "load_suite",
    "make_fixture",
    "pack",
    "save_fixture",
    "unpack",
    "verify_suite",
    "write_suite",
    "zeros",
]

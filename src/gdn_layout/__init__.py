"""The packed-gradient layout of RLX's ``GatedDeltaNetBackward``, in NumPy: the layout,
``unpack``/``pack``, a float64 reference backward, fixtures and a comparison that explains a
wrong gradient; README.md is the guide.

>>> import gdn_layout as gl
>>> flat, grads = gl.zeros(gl.GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=8))
>>> grads.dg.shape, flat.shape
((1, 4, 2), (208,))
"""

from ._version import __version__
from .check import Comparison, GradComparison, assert_close, compare, error_map
from .files import Fixture, FixtureError, load_fixture, save_fixture
from .generate import draw_inputs, make_fixture, write_suite
from .layout import GdnBackwardLayout, Segment
from .packing import GdnGrads, empty, pack, unpack, zeros
from .suites import Case, load_suite, make_case, verify_suite

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
    "make_case",
    "make_fixture",
    "pack",
    "save_fixture",
    "unpack",
    "verify_suite",
    "write_suite",
    "zeros",
]

"""The packed-gradient layout of RLX's ``GatedDeltaNetBackward``, in NumPy.

What a kernel engineer calls is here; each name has one home module:

========================  ==================================================================
module                    concern
========================  ==================================================================
:mod:`~.layout`           :class:`GdnBackwardLayout` and its :class:`Segment` s
:mod:`~.packing`          :func:`unpack`, :func:`pack`, :func:`empty`, :func:`zeros`,
                          :class:`GdnGrads`
:mod:`~.check`            :func:`compare`, :func:`assert_close`, :func:`error_map`,
                          :class:`Comparison`, :class:`GradComparison`, ``Criterion``
:mod:`~.files`            :class:`Fixture`, :func:`load_fixture`, :func:`save_fixture`,
                          :class:`FixtureError`, kernel-output files (``open_packed``)
:mod:`~.generate`         :func:`draw_inputs`, :func:`make_fixture`, :func:`write_suite`
:mod:`~.suites`           :func:`load_suite`, :func:`verify_suite`, :func:`make_case`,
                          :class:`Case`
:mod:`~.reference`        the float64 reference forward, backward and chunk states
:mod:`~.regimes`          the gate regimes inputs are drawn in
:mod:`~.plot`             pictures (``gdn-layout[plot]``)
========================  ==================================================================

>>> import numpy as np
>>> import gdn_layout as gl
>>> layout = gl.GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=8)
>>> flat, grads = gl.zeros(layout)
>>> grads.dg.shape, layout.total_elems
((1, 4, 2), 208)
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

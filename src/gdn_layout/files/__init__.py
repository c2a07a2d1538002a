"""Fixtures (inputs, output and packed gradient, in safetensors) and kernel outputs: the
format is in README.md, *Fixtures*; saving, loading and memory mapping in docs/files.md.

>>> import tempfile, pathlib
>>> import numpy as np
>>> import gdn_layout as gl
>>> from gdn_layout.files import Fixture, load_fixture, save_fixture
>>> from gdn_layout.generate import draw_inputs
>>> layout = gl.GdnBackwardLayout(batch=1, seq=3, heads=2, state_size=4)
>>> x = draw_inputs(layout, regime="mild", seed=1)
>>> flat = np.zeros(layout.total_elems, np.float32)
>>> fx = Fixture(*x[:5], dy=x.dy, y=np.zeros_like(x.v), packed=flat, regime="mild", seed=1)
>>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny.safetensors"
>>> save_fixture(path, fx) == path
True
>>> back = load_fixture(path)
>>> back.layout == layout, back.grads.dg.shape, back.regime, back.seed
(True, (1, 3, 2), 'mild', 1)
>>> bool((back.q == x.q).all()), back.q.flags.writeable
(True, False)
>>> back.mapped, isinstance(back.q, np.memmap)
(False, False)
"""

from __future__ import annotations

from ._fixture import (
    FORMAT,
    FORMAT_VERSION,
    MAP_THRESHOLD,
    Fixture,
    FixtureError,
    GdnInputs,
    load_fixture,
    save_fixture,
)
from ._outputs import PackedFile, open_packed

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAP_THRESHOLD",
    "Fixture",
    "FixtureError",
    "GdnInputs",
    "PackedFile",
    "load_fixture",
    "open_packed",
    "save_fixture",
]

"""The files: fixtures (inputs, output and packed gradient, in safetensors) and kernel outputs.

A fixture is one `safetensors <https://github.com/huggingface/safetensors>`_ file, the format
RLX memory-maps its weights from, holding the tensors ``q, k, v, g, beta``, ``state`` (only
when carried), ``dy``, the forward output ``y`` and ``packed``, the 1-D gradient in rlx-ir's
order. Its ``__metadata__`` (string values only) records:

``format``
    ``"gdn-layout-fixture"``, so that any other safetensors file is refused.
``format_version``
    ``"1"``.
``gdn_layout_version``
    the version of gdn-layout that wrote the file.
``layout``
    the :class:`~gdn_layout.GdnBackwardLayout` as JSON, from its ``to_dict()``.
``seed``, ``regime``, ``compute_dtype``
    how the data was made, when known: the seed and gate regime of :func:`draw_inputs`, and
    the dtype the reference computed ``y`` and ``packed`` in.
``floors``
    the precision floors of each gradient for float32, float16 and bfloat16, as JSON
    ``{dtype: {gradient: [rms, max]}}``, measured by :func:`make_fixture`; what
    :func:`~gdn_layout.compare` judges a kernel against (see :mod:`gdn_layout.check`).
    Files without it load as before.
``states_chunk``, ``state_floors``
    with tensors ``h`` and ``dh`` (the state entering each chunk of ``states_chunk`` steps, and
    its cotangent, ``[B, ceil(S / states_chunk), H, N, N]``), and ``final_state``
    (``[B, H, N, N]``, kept whenever the state is carried): the floors of those and of ``y``,
    as ``floors`` are of the gradients (see :func:`make_fixture`'s ``states``).

The record and its files are in ``files._fixture``, the format in ``files._safetensors``,
atomic writes in ``files._atomic``, memory maps in ``files._mapping`` and the
kernel-output formats :func:`open_packed` reads in ``files._outputs``; generation is in
:mod:`gdn_layout.generate`.

Every tensor has one dtype: ``F64``, ``F32``, ``F16`` or ``BF16`` (bfloat16 needs ml_dtypes:
``pip install gdn-layout[bfloat16]``). Neither safetensors nor ml_dtypes is needed otherwise;
the format is read and written here with NumPy alone.

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

Loading a file smaller than :data:`MAP_THRESHOLD` (64 MiB) reads it into memory, so that no
later change to the file can change or break the fixture; a larger file is memory-mapped,
and judging it within :meth:`Fixture.unchanged` (as suites and the command line do) raises
:class:`FixtureError` if it changed under the mapping, and holds it unchanged meanwhile.

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

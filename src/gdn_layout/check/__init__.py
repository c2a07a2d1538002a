"""Judge a packed gradient buffer against a reference, gradient by gradient.

:func:`compare` returns a :class:`Comparison` of one :class:`GradComparison` per gradient,
each judged by its :class:`Criterion`; :func:`assert_close` raises when one fails;
:func:`error_map` draws one gradient's errors over (sequence position, head).

Each gradient is judged on its own, by one of these criteria:

calibrated (the default)
    A correct kernel differs from the float64 truth by the rounding of what it computes,
    whose *floors* a fixture stores per precision class and gradient
    (:attr:`~gdn_layout.Fixture.floors`): the worst RMS error ratio and largest error over
    the gradient's RMS among the correct forms a kernel of the class computes (the
    step-by-step form, and the chunked WY/UT form as fused kernels compute it, with TF32 or
    bfloat16 operands for those classes; see docs/criterion.md). Judged in the class
    ``precision=`` names (by default the fixture's dtype, or with bare buffers the less
    precise one's: ``float64``, ``float32``, ``tf32``, ``bfloat16``, ``float16``), a
    gradient passes when both figures are at most ``K`` times their floors: 16 for float32
    and tf32, 8 for float16 and bfloat16, 64 for float64 (whose truth is itself rounded to
    float64). No floor, as an
    error, is below half the unit roundoff times ``rms(e)``, nor below half the computation
    dtype's times the scale of the terms that form the gradient (a fixture's
    :attr:`~gdn_layout.Fixture.scales`): a ``dg`` that is exactly 0, or far below the
    ``q . dq - k . dk`` a chunked kernel forms it from, is judged against those terms.
    ``error_floor_ratio`` is the larger of the two errors over their floors; ``out/size``
    counts the elements over the largest error allowed. Without floors of the class, the
    defaults of :data:`~gdn_layout._dtypes.PRECISIONS` apply.
elementwise (``rtol`` or ``atol`` given)
    ``numpy.isclose`` semantics: ``|a - e| <= atol + rtol * |e|`` for every element; the one
    not given defaults by the less precise dtype (bfloat16: 1.6e-2/1e-5, float16:
    1e-3/1e-5, float32: 1.3e-6/1e-5, float64: 1e-7/1e-7).
RMS (``max_rms_ratio`` given)
    ``rms(a - e) / rms(e) <= max_rms_ratio``, the figure flash-linear-attention gates its
    kernel tests on. Given with ``rtol`` or ``atol``, both criteria apply.

Errors are computed in float64 whatever the two dtypes are.

Non-finite values:

* A pair of equal infinities (``+inf`` against ``+inf``) matches; it has error 0.
* NaN never matches, not even NaN in both buffers, unless ``equal_nan=True``, under which
  NaN against NaN matches (error 0). A NaN reference is usually a bug in the reference.
* Every other pair with a non-finite side (NaN against a number, ``inf`` against a number or
  ``-inf``) is a *non-finite mismatch*: it is out of tolerance, has error ``inf`` in the error
  map, and fails its gradient in both modes, since an RMS figure cannot account for it.
* ``max_abs_error``, ``max_rel_error`` and ``rms_ratio`` are taken over the pairs in which both
  values are finite, unless there is a non-finite mismatch: then they are NaN (a NaN is
  involved) or Inf, so that the report shows it. NaN and Inf are counted on each side apart.

>>> import numpy as np
>>> from gdn_layout import GdnBackwardLayout, unpack
>>> layout = GdnBackwardLayout(batch=1, seq=4, heads=2, state_size=3)
>>> expected = np.linspace(-1, 1, layout.total_elems)
>>> actual = expected.astype(np.float32)
>>> unpack(actual, layout).dk[0, 2, 1, 0] += 0.5
>>> result = compare(actual, expected, layout)
>>> result.passed, result.failed
(False, ('dk',))
>>> result["dk"].worst, result["dk"].mismatches
((0, 2, 1, 0), 1)
"""

from ._compare import assert_close, compare, compare_tensor, error_map
from ._criterion import Criterion, K
from ._findings import Finding
from ._records import Comparison, GradComparison

__all__ = [
    "Comparison",
    "Criterion",
    "Finding",
    "GradComparison",
    "K",
    "assert_close",
    "compare",
    "compare_tensor",
    "error_map",
]

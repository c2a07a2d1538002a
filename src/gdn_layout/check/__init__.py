"""Judge a packed gradient buffer against a reference, gradient by gradient: docs/criterion.md.

:func:`compare` returns a :class:`Comparison` of one :class:`GradComparison` per gradient,
each judged by its :class:`Criterion`; :func:`assert_close` raises when one fails;
:func:`error_map` draws one gradient's errors over (sequence position, head).

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

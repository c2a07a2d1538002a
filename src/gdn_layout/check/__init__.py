"""Judge a packed gradient buffer against a reference, gradient by gradient: :func:`compare`,
:func:`assert_close`, :func:`error_map`, :func:`compare_tensor` (docs/criterion.md)."""

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
